"""PNG grids of generated images with their prompts and scores, and animated GIF grids of videos
(pure PIL, no display needed)."""

from __future__ import annotations

import os
import textwrap

import numpy as np
from PIL import Image, ImageDraw


def to_uint8(images: np.ndarray) -> np.ndarray:
  """[B, (F,) H, W, 3] float in [-1, 1] (NaN-safe) -> uint8; uint8 (a video run's) as it is."""
  if np.asarray(images).dtype == np.uint8:
    return np.asarray(images)
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
  """image_grid into `path` (PNG); videos [B, F, H, W, 3] as save_video_grid's GIF beside it
  (`path` with .gif). Returns the grid (a video's: its first frame's)."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  if np.asarray(images).ndim == 5:
    return save_video_grid(os.path.splitext(path)[0] + '.gif', images, captions, **kw)[0]
  grid = image_grid(images, captions, **kw)
  Image.fromarray(grid).save(path)
  return grid


VIDEO_FPS = 8  # the GIF's frame rate (Flow-GRPO logs its Wan videos at 8 fps)


def video_grid(videos: np.ndarray, captions: list[str], **kw) -> np.ndarray:
  """image_grid of every frame of videos [B, F, H, W, 3] (uint8 or float in [-1, 1]): frames
  [F, H', W', 3] uint8, tile i of frame t the t-th frame of video i, captions and frames kept."""
  videos = to_uint8(videos)
  return np.stack([image_grid(videos[:, t], captions, **kw) for t in range(videos.shape[1])])


def save_video_grid(path: str, videos: np.ndarray, captions: list[str], **kw) -> np.ndarray:
  """video_grid as an animated GIF at VIDEO_FPS, looping; returns the frames."""
  frames = video_grid(videos, captions, **kw)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  first, *rest = [Image.fromarray(f) for f in frames]
  first.save(path, save_all=True, append_images=rest, duration=1000 // VIDEO_FPS, loop=0)
  return frames
