"""Rewards of whole videos (registered with takes='videos': uint8 [B, F, H, W, 3]).

  'temporal_consistency'  1 - the mean absolute change between consecutive frames, in [0, 1]
                          (pixels and channels, as a fraction of 255): 1 for a still video,
                          lower the more frames flicker or jump. A still video maximises it, so
                          weigh it beside a reward of the content (e.g. 'jpeg_compressibility:1,
                          temporal_consistency:0.5'). One frame scores 1.

Image rewards need nothing here: in a video run the registry scores every frame with them and
averages (rewards/registry.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from digen_jax.rewards.registry import check_videos, register


@register("temporal_consistency", takes="videos")
def temporal_consistency(videos: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  videos = check_videos(videos, prompts)
  if videos.dtype != np.uint8:
    raise ValueError(f"temporal_consistency scores uint8 videos; got {videos.dtype}")
  b, f = videos.shape[:2]
  if f < 2:
    return np.ones((b,), np.float32)
  out = np.empty((b,), np.float32)
  for i in range(b):  # one video at a time: no [F, H, W, 3] int16 copy of the whole batch
    v = videos[i].astype(np.int16)
    out[i] = 1.0 - np.abs(np.diff(v, axis=0)).mean() / 255.0
  return out
