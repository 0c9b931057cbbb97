"""PNG grids of generated images with their prompts and scores (pure PIL, no display needed)."""

from __future__ import annotations

import os
import textwrap

import numpy as np
from PIL import Image, ImageDraw


def to_uint8(images: np.ndarray) -> np.ndarray:
  """[B, H, W, 3] float in [-1, 1] (NaN-safe) -> uint8."""
  x = np.nan_to_num(np.asarray(images, np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
  return np.clip((x + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)


PASS_COLOR, FAIL_COLOR = (0, 170, 0), (210, 0, 0)


def image_grid(
    images: np.ndarray,
    captions: list[str],
    *,
    cols: int = 4,
    scale: int = 4,
    caption_lines: int = 4,
    passed: list[bool] | None = None,
) -> np.ndarray:
  """Tiles images (upscaled `scale`x, nearest) with a wrapped caption under each; with `passed`,
  a green (pass) or red (fail) frame around each tile. -> [H, W, 3] uint8."""
  imgs = to_uint8(images)
  b, h, w, _ = imgs.shape
  cell_w, cell_h = max(w * scale, 128), h * scale + 11 * caption_lines + 4
  cols = min(cols, b)
  rows = (b + cols - 1) // cols
  canvas = Image.new('RGB', (cols * cell_w, rows * cell_h), (255, 255, 255))
  draw = ImageDraw.Draw(canvas)
  for i in range(b):
    x0, y0 = (i % cols) * cell_w, (i // cols) * cell_h
    tile = Image.fromarray(imgs[i]).resize((w * scale, h * scale), Image.NEAREST)
    tx = x0 + (cell_w - w * scale) // 2
    canvas.paste(tile, (tx, y0))
    if passed is not None:
      draw.rectangle(
          [tx, y0, tx + w * scale - 1, y0 + h * scale - 1],
          outline=PASS_COLOR if passed[i] else FAIL_COLOR,
          width=2,
      )
    lines = textwrap.wrap(captions[i], width=max(8, cell_w // 6))[:caption_lines]
    for j, line in enumerate(lines):
      draw.text((x0 + 2, y0 + h * scale + 2 + 11 * j), line, fill=(0, 0, 0))
  return np.asarray(canvas)


def save_grid(path: str, images: np.ndarray, captions: list[str], **kw) -> np.ndarray:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  grid = image_grid(images, captions, **kw)
  Image.fromarray(grid).save(path)
  return grid
