"""The ShapesBench checker's view of an image: validity, background, and every object of each
palette colour segmented, measured (geometry.py) and classified by the shape gates.

checker.py's docstring is the specification: steps 1-3 (validity, reference background,
segmentation) and 6 (the background region) are `analyze`, step 4 `Blob`'s fields, step 5
`shape_gates` / `shape_margin` and their thresholds below, calibrated as it records.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import ndimage  # scipy is a hard dependency of jax, so always installed with it

from digen_jax.tasks.shapes import geometry
from digen_jax.tasks.shapes.grammar import BACKGROUNDS, COLORS, SHAPES

# Validity, background and segmentation (steps 1-3 and 6).
RANGE_TOL = 0.1
BG_UNIFORM_TOL = 0.15
BG_UNIFORM_FRAC = 0.5
BG_MATCH_TOL = 0.2
BG_REGION_FRAC = 0.9
RESIDUAL_TOL = 0.2
MIN_COLOR_CONTRAST = 0.3
RIM_PX = 2
RIM_ALPHA_MIN = 0.15
MIN_AREA_FRAC = 0.006
# The shape gates (step 5; the calibration table says where each sits).
MIN_SHAPE_FRAC = 0.015
SOLIDITY_MIN = 0.9
HOLES_MAX = 0.01
FILL_MIN = {"circle": 0.68, "square": 0.85, "triangle": 0.45}
TEMPLATE_ERR_MAX = 0.10
TEMPLATE_GAP_MIN = 0.02
ASPECT_MAX = 1.25
SKEW_MAX = 0.4
TRIANGLE_SKEW_Y_MAX = -0.1
# One gate width of each margin (the dense reward's unit; 'relation' is checker.py's rule).
MARGIN_WIDTHS = {
    "size": 0.5,
    "solidity": 0.05,
    "holes": 0.005,
    "fill": 0.05,
    "template_err": 0.03,
    "template_gap": 0.02,
    "aspect": 0.1,
    "skew": 0.1,
    "upright": 0.1,
    "relation": 0.12,
}

_EIGHT = np.ones((3, 3), bool)
_COLOR_NAMES = tuple(COLORS)
_COLOR_RGB = np.asarray([COLORS[c] for c in _COLOR_NAMES], np.float32)
_BG_NAMES = tuple(BACKGROUNDS)
_BG_RGB = np.asarray([BACKGROUNDS[b] for b in _BG_NAMES], np.float32)


@dataclasses.dataclass(frozen=True)
class Blob:
  """One detected object and its geometry (checker.py's docstring, step 4). Pixels, y downward;
  w/h are soft extents."""

  color: str
  shape: str  # the shape whose every gate passes (shape_margin > 0), else "none"
  mass: float
  cx: float
  cy: float
  w: float
  h: float
  size_frac: float
  aspect: float
  aspect_tri: float
  skew_x: float
  skew_y: float
  solidity: float
  holes: float
  fill: float
  err: dict  # shape -> template error


@dataclasses.dataclass(frozen=True)
class Scene:
  background: Optional[str]  # palette name of the whole background region, or None
  blobs: dict[str, list[Blob]]  # colour -> components, largest first


def _to_unit(image: np.ndarray) -> Optional[np.ndarray]:
  """[-1, 1] image -> [0, 1] float32, or None if it is not a valid image."""
  image = np.asarray(image)
  if image.ndim != 3 or image.shape[-1] != 3 or min(image.shape[:2]) < 3:
    return None
  if not np.issubdtype(image.dtype, np.floating) and not np.issubdtype(image.dtype, np.integer):
    return None
  x = image.astype(np.float32)
  if not np.all(np.isfinite(x)) or np.max(np.abs(x)) > 1.0 + RANGE_TOL:
    return None
  return (np.clip(x, -1.0, 1.0) + 1.0) * 0.5


def _blob(
    name: str, a: np.ndarray, mine: np.ndarray, r0: int, c0: int, mass: float, img_area: int
) -> Blob:
  """Geometry of one component: `a` its soft coverage on a crop at (r0, c0), `mine` its core."""
  col, row = a.sum(axis=0), a.sum(axis=1)  # marginal mass profiles
  dx = np.arange(c0 + 0.5, c0 + a.shape[1])
  dy = np.arange(r0 + 0.5, r0 + a.shape[0])
  cx, cy = float(col @ dx) / mass, float(row @ dy) / mass
  dx -= cx
  dy -= cy
  dx2, dy2 = dx * dx, dy * dy
  vx = float(col @ dx2) / mass + 1.0 / 12  # + a pixel's own variance
  vy = float(row @ dy2) / mass + 1.0 / 12
  cxy = float(dy @ a @ dx) / mass
  w, h = float(a.max(axis=0).sum()), float(a.max(axis=1).sum())
  b = Blob(
      color=name,
      shape="none",
      mass=mass,
      cx=cx,
      cy=cy,
      w=w,
      h=h,
      size_frac=mass / img_area,
      aspect=geometry.aspect(vx, vy, cxy),
      aspect_tri=geometry.aspect(vx, 0.75 * vy, math.sqrt(0.75) * cxy),
      skew_x=float(col @ (dx2 * dx)) / mass / vx**1.5,
      skew_y=float(row @ (dy2 * dy)) / mass / vy**1.5,
      solidity=geometry.solidity(a, mass),
      holes=geometry.holes(a, mine) / mass,
      fill=mass / max(w * h, 1e-6),
      err=geometry.template_errors(a, r0, c0, cx, cy, mass),
  )
  # The gates are exclusive (template gap), so at most one shape passes.
  object.__setattr__(b, "shape", next((s for s in SHAPES if shape_margin(b, s) > 0.0), "none"))
  return b


def _blobs_for_color(name: str, core: np.ndarray, soft: np.ndarray) -> list[Blob]:
  labels, n = ndimage.label(core, structure=_EIGHT)
  if n == 0:
    return []
  h_img, w_img = core.shape
  min_mass = MIN_AREA_FRAC * h_img * w_img
  # Each pixel belongs to its nearest component (chessboard distance); checker.py's docstring.
  if n == 1:
    dist, owner = ndimage.distance_transform_cdt(~core, metric="chessboard"), None
  else:
    dist, (iy, ix) = ndimage.distance_transform_cdt(~core, metric="chessboard", return_indices=True)
    owner = labels[iy, ix]
  soft = np.where((dist <= 1) | ((dist <= RIM_PX) & (soft >= RIM_ALPHA_MIN)), soft, 0.0)
  blobs = []
  for k, sl in enumerate(ndimage.find_objects(labels), start=1):
    r0, r1 = max(sl[0].start - RIM_PX, 0), min(sl[0].stop + RIM_PX, h_img)
    c0, c1 = max(sl[1].start - RIM_PX, 0), min(sl[1].stop + RIM_PX, w_img)
    a = soft[r0:r1, c0:c1]
    if owner is not None:
      a = np.where(owner[r0:r1, c0:c1] == k, a, 0.0)
    mass = float(a.sum())
    if mass < min_mass:
      continue
    blobs.append(_blob(name, a, labels[r0:r1, c0:c1] == k, r0, c0, mass, h_img * w_img))
  blobs.sort(key=lambda b: -b.mass)
  return blobs


def _border_background(u: np.ndarray) -> Optional[np.ndarray]:
  border = np.concatenate([u[0], u[-1], u[1:-1, 0], u[1:-1, -1]], axis=0)
  bg = np.median(border, axis=0).astype(np.float32)
  if np.mean(np.linalg.norm(border - bg, axis=-1) < BG_UNIFORM_TOL) < BG_UNIFORM_FRAC:
    return None
  return bg


def analyze(image: np.ndarray, colors: Sequence[str] = tuple(COLORS)) -> Optional[Scene]:
  """Segments one [H, W, 3] image in [-1, 1]; None if invalid or without a uniform border."""
  u = _to_unit(image)
  if u is None:
    return None
  bg = _border_background(u)
  if bg is None:
    return None
  rel = u - bg
  d = _COLOR_RGB - bg  # [C, 3]
  dd = (d * d).sum(axis=-1)
  seen = dd >= MIN_COLOR_CONTRAST**2  # a colour too close to the background cannot be seen
  proj = rel @ d.T  # [H, W, C]
  alpha = proj / np.where(seen, dd, 1.0)
  a01 = np.clip(alpha, 0.0, 1.0)
  # Squared distance to the segment bg -> colour: |rel|^2 - 2 a <rel, d> + a^2 |d|^2.
  resid2 = (rel * rel).sum(axis=-1, keepdims=True) + a01 * (a01 * dd - 2.0 * proj)
  resid2 = np.where(seen, resid2, np.inf)
  ok = resid2 < RESIDUAL_TOL**2
  core = ok & (alpha > 0.5)
  own = ok & (resid2 <= resid2.min(axis=-1, keepdims=True) + 1e-6)
  blobs = {}
  for c in colors:
    i = _COLOR_NAMES.index(c)
    blobs[c] = _blobs_for_color(c, core[..., i], np.where(own[..., i], a01[..., i], 0.0))
  # Background (step 6): the pixels that are no palette object, core or rim.
  obj = ndimage.binary_dilation(core.any(axis=-1), _EIGHT, iterations=RIM_PX) & ok.any(axis=-1)
  region = u[~obj]
  name = None
  if len(region):
    near = np.linalg.norm(region[:, None, :] - _BG_RGB, axis=-1) < BG_MATCH_TOL  # [N, 3]
    frac = near.mean(axis=0)
    j = int(np.argmax(frac))
    if frac[j] >= BG_REGION_FRAC:
      name = _BG_NAMES[j]
  return Scene(name, blobs)


def shape_gates(b: Blob, shape: str) -> dict[str, float]:
  """Signed margin of every gate of `shape` in its natural units: > 0 iff the gate passes."""
  err = b.err[shape]
  gates = {
      "size": b.size_frac / MIN_SHAPE_FRAC - 1.0,
      "solidity": b.solidity - SOLIDITY_MIN,
      "holes": HOLES_MAX - b.holes,
      "fill": b.fill - FILL_MIN[shape],
      "template_err": TEMPLATE_ERR_MAX - err,
      "template_gap": min(b.err[o] for o in SHAPES if o != shape) - err - TEMPLATE_GAP_MIN,
  }
  if shape == "triangle":
    gates["aspect"] = ASPECT_MAX - b.aspect_tri
    gates["skew"] = SKEW_MAX - abs(b.skew_x)
    gates["upright"] = TRIANGLE_SKEW_Y_MAX - b.skew_y
  else:
    gates["aspect"] = ASPECT_MAX - b.aspect
    gates["skew"] = SKEW_MAX - max(abs(b.skew_x), abs(b.skew_y))
  return gates


def shape_margin(b: Blob, shape: str) -> float:
  """Signed distance of blob `b` into `shape`'s acceptance region in gate widths
  (MARGIN_WIDTHS): the smallest normalised gate margin; > 0 iff every gate passes."""
  return min(m / MARGIN_WIDTHS[g] for g, m in shape_gates(b, shape).items())
