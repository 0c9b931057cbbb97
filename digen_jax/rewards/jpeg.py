"""DDPO's JPEG (in)compressibility rewards.

Each image ([H, W, 3] in [-1, 1]) is mapped to uint8 the way DDPO does it
(round(255 * (x + 1) / 2), clamped to [0, 255]), encoded with PIL as JPEG at quality 95, and
scored by its size in kilobytes (bytes / 1000):
  'jpeg_compressibility'   reward = -size_kB  (smaller files score higher)
  'jpeg_incompressibility' reward = +size_kB

Images with NaN/inf values cannot be encoded; both rewards give them
-2 * (H * W * 3 / 1000 + 1), i.e. minus twice (raw uint8 size + 1 kB of header allowance) in kB.
That is finite and below every encodable image's reward (a quality-95 JPEG of even pure noise
stays under the raw size plus its ~0.6 kB of headers, and incompressibility rewards are
positive), without being so large that it swamps a group's reward spread more than necessary.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
from PIL import Image

from digen_jax.rewards.registry import check_batch, register

JPEG_QUALITY = 95
_HEADER_ALLOWANCE_KB = 1.0


def to_uint8(image: np.ndarray) -> np.ndarray:
  """[H, W, 3] float in [-1, 1] -> uint8 (out-of-range values are clamped)."""
  x = (np.asarray(image, np.float32) + 1.0) * 0.5
  return np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)


def jpeg_size_kb(image: np.ndarray, quality: int = JPEG_QUALITY) -> float:
  """JPEG size in kB of one finite [H, W, 3] image in [-1, 1]."""
  buf = io.BytesIO()
  Image.fromarray(to_uint8(image), mode="RGB").save(buf, format="JPEG", quality=quality)
  return buf.tell() / 1000.0


def invalid_penalty(height: int, width: int) -> float:
  """The reward given to a non-finite [height, width, 3] image (see module docstring)."""
  return -2.0 * (height * width * 3 / 1000.0 + _HEADER_ALLOWANCE_KB)


def _sizes(images: np.ndarray, prompts: Sequence[str], sign: float) -> np.ndarray:
  images = check_batch(images, prompts)
  _, h, w, _ = images.shape
  out = np.empty(images.shape[0], np.float32)
  for i, im in enumerate(images):
    im = np.asarray(im, np.float32)
    out[i] = sign * jpeg_size_kb(im) if np.all(np.isfinite(im)) else invalid_penalty(h, w)
  return out


@register("jpeg_compressibility")
def jpeg_compressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32: -JPEG size in kB (prompts are ignored)."""
  return _sizes(images, prompts, -1.0)


@register("jpeg_incompressibility")
def jpeg_incompressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32: +JPEG size in kB (prompts are ignored)."""
  return _sizes(images, prompts, +1.0)
