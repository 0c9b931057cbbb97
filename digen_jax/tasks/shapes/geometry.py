"""The ShapesBench checker's measurements of one object: pure functions of its soft coverage.

`a` is a component's coverage in [0, 1] on a crop of the image (checker.py's docstring, steps 3
and 4 say how it is segmented and what each feature means); every function here is plain numpy
on that crop, with no thresholds: the gates that judge these numbers live in scene.py.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import ndimage  # scipy is a hard dependency of jax, so always installed with it

from digen_jax.tasks.shapes.grammar import SHAPES

TEMPLATE_BLURS = (0.5, 0.8)  # besides the sharp template
_AREA = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # renderer: area / extent^2
_AREA_ARRAY = np.array([_AREA[s] for s in SHAPES], np.float32)
_SUBROWS = 16


def aspect(vx: float, vy: float, cxy: float) -> float:
  """sqrt(largest / smallest eigenvalue) of [[vx, cxy], [cxy, vy]]."""
  half_tr = 0.5 * (vx + vy)
  disc = math.sqrt(max(half_tr * half_tr - (vx * vy - cxy * cxy), 0.0))
  return math.sqrt((half_tr + disc) / max(half_tr - disc, 1e-9))


def _hull_area(pts: np.ndarray) -> float:
  """Area of the convex hull of [N, 2] points (Andrew's monotone chain; 0 if degenerate)."""
  p = pts[np.lexsort((pts[:, 1], pts[:, 0]))].tolist()
  hull = []
  for seq in (p, p[::-1]):  # lower, then upper chain
    chain = []
    for x, y in seq:
      while len(chain) >= 2:
        (x1, y1), (x2, y2) = chain[-2], chain[-1]
        if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) > 0:
          break
        chain.pop()
      chain.append((x, y))
    hull += chain[:-1]
  area, (x0, y0) = 0.0, hull[-1] if hull else (0.0, 0.0)
  for x1, y1 in hull:
    area += x0 * y1 - x1 * y0
    x0, y0 = x1, y1
  return abs(area) / 2


def solidity(a: np.ndarray, mass: float) -> float:
  """mass / area of the convex hull of the 0.5 iso-contour of `a` (linearly interpolated
  crossings between 4-neighbours; outside the crop counts as 0)."""
  s = np.full((a.shape[0] + 2, a.shape[1] + 2), -0.5, np.float32)
  s[1:-1, 1:-1] = a - 0.5
  pos = s > 0
  y0, x0 = np.nonzero(pos[:, :-1] != pos[:, 1:])  # crossing between (y0, x0) and (y0, x0 + 1)
  lo, hi = s[y0, x0], s[y0, x0 + 1]
  y1, x1 = np.nonzero(pos[:-1] != pos[1:])  # between (y1, x1) and (y1 + 1, x1)
  lo1, hi1 = s[y1, x1], s[y1 + 1, x1]
  hull = _hull_area(
      np.stack(
          [np.concatenate([x0 + lo / (lo - hi), x1]), np.concatenate([y0, y1 + lo1 / (lo1 - hi1)])],
          axis=1,
      )
  )
  return mass / hull if hull > 0.0 else 1.0  # a line (no area) is left to the other gates


# Small dense matmuls are the fastest way to blur the few-pixel canvases of a 16-32 px image,
# but multi-threaded BLAS on bigger ones can be 100x slower on a busy CPU: above _MATMUL_MAX
# pixels a side the blur runs as an ndimage filter.
_MATMUL_MAX = 24


@functools.lru_cache(maxsize=None)
def _blur_matrix(size: int, sigma: float) -> np.ndarray:
  """[size, size]: K @ X @ K.T is ndimage.gaussian_filter(X, sigma, mode="constant")."""
  i = np.arange(size, dtype=np.float64)
  radius = int(4.0 * sigma + 0.5)  # gaussian_filter's default truncation
  k = np.exp(-0.5 * ((i[:, None] - i[None, :]) / sigma) ** 2)
  k[np.abs(i[:, None] - i[None, :]) > radius] = 0.0
  norm = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2).sum()
  return (k / norm).astype(np.float32)


def _blur(t: np.ndarray, size: int, sigma: float) -> np.ndarray:
  """Gaussian blur (zero padding) of every [size, size] map of t [n, size, size]."""
  if size <= _MATMUL_MAX:
    k = _blur_matrix(size, sigma)
    return k @ t @ k.T
  return ndimage.gaussian_filter(t, (0.0, sigma, sigma), mode="constant")


def _templates(size: int, cx: float, cy: float, mass: float) -> np.ndarray:
  """[3, size, size] coverage of the renderer's circle, square and up-triangle (the geometry of
  render._inside) of the given mass and centroid: exact across each of _SUBROWS sub-rows of a
  pixel row, where every shape is one span [cx - half_width(y), cx + half_width(y)]."""
  e = np.sqrt(np.float32(mass) / _AREA_ARRAY)  # extents
  h = e / 2
  box_cy = np.array([cy, cy, cy - e[2] / 6], np.float32)  # triangle: centroid e/6 below centre
  r0 = max(int(math.floor(float(np.min(box_cy - h)))), 0)
  r1 = min(int(math.ceil(float(np.max(box_cy + h)))) + 1, size)
  dy = (np.arange(r0 * _SUBROWS, r1 * _SUBROWS, dtype=np.float32) + 0.5) / _SUBROWS - box_cy[
      :, None
  ]  # [3, sub-rows]
  t = dy[2] / e[2] + 0.5  # 0 at the apex, 1 at the base
  half_width = np.empty_like(dy)
  half_width[0] = np.sqrt(np.maximum(h[0] * h[0] - dy[0] * dy[0], 0.0))
  half_width[1] = np.where(np.abs(dy[1]) <= h[1], h[1], 0.0)
  half_width[2] = np.where((t >= 0.0) & (t <= 1.0), h[2] * t, 0.0)
  col = np.arange(size, dtype=np.float32)
  cov = np.clip(
      np.minimum(cx + half_width[..., None], col + 1.0)
      - np.maximum(cx - half_width[..., None], col),
      0.0,
      1.0,
  )  # [3, sub-rows, size]
  out = np.zeros((3, size, size), np.float32)
  out[:, r0:r1] = cov.reshape(3, r1 - r0, _SUBROWS, size).mean(axis=2)
  return out


def template_errors(a: np.ndarray, r0: int, c0: int, cx: float, cy: float, mass: float) -> dict:
  """err_s for every shape (checker.py's docstring, step 4): `a` on a crop at (r0, c0) against the
  renderer's shape s with the same mass and centroid, sharp or blurred."""
  # A square canvas around the centroid that holds the crop and every template (they reach
  # at most 2e/3 < 0.7 e_max from the centroid: the triangle's apex).
  e_max = math.sqrt(mass / _AREA["triangle"])
  half = (
      int(math.ceil(max(cx - c0, c0 + a.shape[1] - cx, cy - r0, r0 + a.shape[0] - cy, 0.7 * e_max)))
      + 1
  )
  ox, oy = int(math.floor(cx)) - half, int(math.floor(cy)) - half
  size = 2 * half + 1
  canvas = np.zeros((size, size), np.float32)
  canvas[r0 - oy : r0 - oy + a.shape[0], c0 - ox : c0 - ox + a.shape[1]] = a
  t = _templates(size, cx - ox, cy - oy, mass)
  errs = np.abs(canvas - t).sum(axis=(1, 2))
  for sigma in TEMPLATE_BLURS:
    errs = np.minimum(errs, np.abs(canvas - _blur(t, size, sigma)).sum(axis=(1, 2)))
  return {s: float(e) / (2.0 * mass) for s, e in zip(SHAPES, errs)}


def holes(a: np.ndarray, mine: np.ndarray) -> float:
  """sum(1 - a) over the background pixels enclosed by the core `mine`: 4-connected non-core
  regions that do not reach the crop's border (as ndimage.binary_fill_holes)."""
  # A hole lies between two core runs of a row: rows with one run at most have none.
  starts = mine[:, 1:] & ~mine[:, :-1]
  if not (starts.sum(axis=1) + mine[:, 0] > 1).any():
    return 0.0
  labels, n = ndimage.label(~mine)
  if n <= 1:
    return 0.0
  border = np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])
  enclosed = (labels > 0) & ~np.isin(labels, border)
  return float((1.0 - a)[enclosed].sum())
