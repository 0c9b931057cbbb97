"""ShapesBench checker: scores an image against its prompt with plain code (no learned model).

It judges what a person would: an object counts as the prompted shape only if it looks like
the renderer's drawing of that shape (digen_jax/tasks/shapes/render.py: axis-aligned circle,
square, and an upward isosceles triangle with base = height), up to position, size and a slight
blur; stretched, rotated, hollow, concave, dithered or merged blobs are not a shape at all.

Per image ([H, W, 3] float32 in [-1, 1]):
  1. Validity: non-finite values, or values outside [-1 - RANGE_TOL, 1 + RANGE_TOL] (e.g. a
     [0, 255] image) -> score 0. Otherwise clip to [-1, 1] and map to [0, 1].
  2. Reference background: median of the 1-pixel border ring. If fewer than half of the border
     pixels lie within BG_UNIFORM_TOL of it there is no uniform background (noise, garbage):
     score 0, since nothing can be segmented. It is only the reference for segmentation; the
     background atom is judged on the whole background region (step 6).
  3. Objects: every pixel is projected onto the segment bg -> c of each of the six palette
     colours: alpha = <u - bg, c - bg> / |c - bg|^2 (its coverage, exact for anti-aliased
     edges) and residual = distance to the segment. A pixel is explained by c if its residual
     is < RESIDUAL_TOL, and belongs to the colour with the smallest residual (so the anti-aliased
     rim of a neighbour of another colour is not counted). Core pixels (alpha > 0.5) form
     8-connected components; every pixel goes to its nearest component (chessboard distance),
     and a component's soft coverage a is its core plus the RIM_PX pixel rings around it that
     belong to it (the second ring only where alpha >= RIM_ALPHA_MIN: a blurred edge, not
     noise). Components with mass sum(a) < MIN_AREA_FRAC * H * W are dropped as specks.
  4. Geometry of each component, from a: mass, centroid, covariance (+ 1/12 per axis, a pixel's
     own variance) -> aspect = sqrt(largest / smallest eigenvalue), and aspect_tri, the same
     after dividing the y variance by 4/3 (an up-triangle's var_y / var_x); skew_x / skew_y,
     the skewness of the column / row mass profiles (up-triangle: skew_y = -0.57, y downward);
     solidity = mass / area of the convex hull of its 0.5 iso-contour (sub-pixel crossings);
     holes = background enclosed by the core (binary_fill_holes), as sum(1 - a) / mass;
     fill = mass / (soft width * soft height), soft width = sum over columns of the column's max
     a (circle pi/4, square 1, triangle ~1/2); and, per shape s, the template error
     err_s = sum |a - T_s| / (2 mass): the fraction of mass misplaced relative to T_s, the
     coverage of the renderer's shape s (render._inside's geometry, rasterised exactly along x
     and with _SUBROWS sub-rows per pixel) with the same mass and centroid (triangle: centroid
     e/6 below its box centre), minimised over T_s and its Gaussian blurs TEMPLATE_BLURS.
  5. Shape: a component is shape s iff every gate of s passes:
       size      mass / (H W) > MIN_SHAPE_FRAC (half the smallest rendered object: a dot has
                 no shape);
       solidity  > SOLIDITY_MIN (L-shapes, plus signs, rings, dithering fail);
       holes     < HOLES_MAX (hollow rings / frames, dithered or speckled fills fail);
       fill      > FILL_MIN[s] (a diamond or a plus is not a circle or a square);
       template  err_s < TEMPLATE_ERR_MAX and err_s < err_o - TEMPLATE_GAP_MIN for both other
                 shapes o (corners and edges: the renderer's shape, not a near one; the gap also
                 makes the shapes exclusive);
       aspect    aspect (triangle: aspect_tri) < ASPECT_MAX (stretched shapes fail);
       skew      |skew_x| (circle, square: and |skew_y|) < SKEW_MAX;
       upright   triangle only: skew_y < TRIANGLE_SKEW_Y_MAX (upside-down and sideways fail).
     `Blob.shape` is the one shape whose gates all pass, else "none".
  6. Background: the background region is every pixel that is not an object of any palette
     colour (a core pixel, or a pixel within RIM_PX of a core that is a bg/colour mix). The
     image's background is the palette background that at least BG_REGION_FRAC of that region
     lies within BG_MATCH_TOL of (else unknown): a wrong background inside a frame of the right
     colour, or a region full of off-palette stuff, fails.
  7. Relation (GenEval's rule): offset = centroid(A) - centroid(B); its magnitude is reduced per
     axis by POSITION_THRESHOLD * (w_A + w_B) (resp. h) and divided by |offset|; "left of" iff
     that x-component < -0.5 (similarly right/above/below; y grows downward).

Atoms (each 0/1): per object -> present, count (number of components of its colour equals the
prompt count), shape (every component of its colour is the prompted shape); relation prompts
add relation (on the largest component of each colour); every prompt adds background.
`shapes_reward` = fraction of satisfied atoms (partial credit for training); `shapes_strict`
= all atoms satisfied (evaluation accuracy). `shapes_dense` (training only) replaces the 0/1
shape and relation atoms by sigmoid(margin / MARGIN_TEMPERATURE), the margin being the smallest
gate margin measured in gate widths (MARGIN_WIDTHS: (value - threshold) / width, signed so > 0
passes), so a sample that is *almost* the shape already scores higher than one that is not, but
a near miss one width or more past a threshold earns < 0.02 (sigmoid(-4)); at zero temperature
it equals `shapes_reward`. Extra objects of other colours are not penalised (as in GenEval's
attribute checks), except that off-palette stuff counts against the background.

Second scoring path: `strict_atoms` / the registered `shapes_strict_atoms` compute every atom
from plain threshold comparisons (`shape_ok`, `_relation_ok`), sharing segmentation and
geometry with `check` but none of the margin code the training reward smooths; eval can
report accuracy under both (they agree unless one of them has a bug).

Calibration. Each gate was set on the renderer's ground truth: all grammar prompts drawn at
random (train and eval compositions), rendered with render.render_batch, every object scored
against its own shape: ~2000 objects per shape at each of 16, 24, 32 and 64 px, ~2000 at 16 px
and ~1000 at 32 px with N(0, 0.05) noise added to the [-1, 1] image (+nz) or a Gaussian blur of
sigma 0.5 px (+bl). Worst value of each feature over all of them (minimum for a lower bound,
maximum for an upper one), against its gate:
  feature   gate       shape    16px   24px   32px   64px  16+nz  16+bl  32+nz  32+bl
  size_frac > 0.015    circle    0.042  0.045  0.045  0.047  0.041  0.042  0.046  0.046
  size_frac > 0.015    square    0.048  0.057  0.059  0.059  0.054  0.049  0.056  0.059
  size_frac > 0.015    triangle  0.026  0.029  0.028  0.029  0.025  0.025  0.028  0.028
  aspect    < 1.25     circle     1.07   1.03   1.02   1.01   1.09   1.06   1.02   1.02
  aspect    < 1.25     square     1.13   1.06   1.05   1.02   1.14   1.09   1.05   1.04
  aspect    < 1.25     triangle   1.11   1.06   1.03   1.01   1.18   1.15   1.05   1.05
  |skew|    < 0.4      circle     0.15   0.05   0.03   0.01   0.22   0.08   0.05   0.03
  |skew|    < 0.4      square     0.17   0.06   0.03   0.01   0.16   0.10   0.05   0.03
  |skew|    < 0.4      triangle   0.11   0.03   0.02   0.00   0.29   0.09   0.05   0.02
  skew_y    < -0.1     triangle  -0.28  -0.45  -0.48  -0.54  -0.17  -0.20  -0.46  -0.45
  solidity  > 0.9      circle     1.01   0.99   1.00   0.99   1.00   1.03   0.99   1.01
  solidity  > 0.9      square     0.99   0.98   0.98   0.98   0.98   1.01   0.96   0.99
  solidity  > 0.9      triangle   1.00   0.98   0.98   0.98   0.97   1.05   0.96   1.00
  holes     < 0.01     circle     0.00   0.00   0.00   0.00   0.00   0.00   0.00   0.00
  holes     < 0.01     square     0.00   0.00   0.00   0.00   0.00   0.00   0.00   0.00
  holes     < 0.01     triangle   0.00   0.00   0.00   0.00   0.00   0.00   0.00   0.00
  fill      > FILL_MIN circle     0.76   0.75   0.76   0.77   0.73   0.80   0.75   0.77
  fill      > FILL_MIN square     1.00   1.00   1.00   1.00   0.89   0.99   0.93   0.99
  fill      > FILL_MIN triangle   0.58   0.57   0.54   0.52   0.58   0.67   0.54   0.58
  err_s     < 0.10     circle    0.023  0.013  0.009  0.005  0.040  0.029  0.025  0.011
  err_s     < 0.10     square    0.030  0.019  0.015  0.008  0.056  0.047  0.029  0.023
  err_s     < 0.10     triangle  0.031  0.014  0.006  0.003  0.074  0.068  0.035  0.022
  gap       > 0.02     circle    0.043  0.065  0.074  0.084  0.038  0.026  0.065  0.066
  gap       > 0.02     square    0.045  0.066  0.073  0.082  0.041  0.023  0.066  0.064
  gap       > 0.02     triangle  0.125  0.148  0.166  0.177  0.083  0.051  0.146  0.138
holes is 0 on every rendered object; a 1-pixel hole in a 16 px circle is ~0.05. Strict accuracy
on all eight sets: 100%. Near misses (tests/test_checker_adversarial.py; 16 px, 32 px) measure
e.g. aspect 1.46, 1.49 (1.5:1 ellipse) and 1.89, 1.97 (2:1); upside-down triangle skew_y +0.52,
+0.55 and err 0.31, 0.33; sideways triangle |skew_x| 0.52, 0.55; diamond fill 0.59, 0.54 (and
err_triangle 0.20); L-shape solidity 0.81, 0.75 and err 0.31 to 0.35; ring / frame holes 0.69
to 0.77 and solidity 0.55 to 0.58; checkerboard dither solidity 0.53 to 0.64; two merged
circles aspect 2.14, 2.21. The thresholds sit between, and the widths put every near miss of
the tests at least ~1 width past a threshold (dense credit < 0.05), while clean ground truth
sits >= 1.1 widths inside every gate at every size (dense shape credit >= 0.99); with noise or
blur at 16 px, 99.9% of objects are >= 0.2 width inside (a 4-pixel square blurred by half a
pixel is nearly a circle). A shape drawn with exact geometry (finer anti-aliasing than the
renderer's 4x4 samples) fits as well: err < 0.03 at 16 px.

Cost: ~0.6 ms an image at 16 px on one core (~40 ms for a 64-image batch; the previous
fill/skewness checker took ~13 ms), most of it in the per-object template and hull.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np
from scipy import ndimage  # scipy is a hard dependency of jax, so always installed with it

from digen_jax.tasks.shapes.grammar import BACKGROUNDS, COLORS, SHAPES, ShapesPrompt, parse
from digen_jax.rewards.registry import check_batch, register

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
MIN_SHAPE_FRAC = 0.015
SOLIDITY_MIN = 0.9
HOLES_MAX = 0.01
FILL_MIN = {"circle": 0.68, "square": 0.85, "triangle": 0.45}
TEMPLATE_ERR_MAX = 0.10
TEMPLATE_GAP_MIN = 0.02
TEMPLATE_BLURS = (0.5, 0.8)  # besides the sharp template
ASPECT_MAX = 1.25
SKEW_MAX = 0.4
TRIANGLE_SKEW_Y_MAX = -0.1
POSITION_THRESHOLD = 0.1
MARGIN_TEMPERATURE = 0.25  # in gate widths: one width past a threshold -> sigmoid(-4) = 0.018
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
_AREA = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # renderer: area / extent^2
_AREA_ARRAY = np.array([_AREA[s] for s in SHAPES], np.float32)
_SUBROWS = 16
_COLOR_NAMES = tuple(COLORS)
_COLOR_RGB = np.asarray([COLORS[c] for c in _COLOR_NAMES], np.float32)
_BG_NAMES = tuple(BACKGROUNDS)
_BG_RGB = np.asarray([BACKGROUNDS[b] for b in _BG_NAMES], np.float32)


@dataclasses.dataclass(frozen=True)
class Blob:
  """One detected object and its geometry (module docstring, step 4). Pixels, y downward;
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


@dataclasses.dataclass(frozen=True)
class CheckResult:
  atoms: dict[str, bool]
  partial: float
  strict: bool
  dense: float = 0.0  # mean of soft atoms (see module docstring); 0 for invalid images
  soft: dict = dataclasses.field(default_factory=dict)  # atom -> its credit in `dense`


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


def _aspect(vx: float, vy: float, cxy: float) -> float:
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


def _solidity(a: np.ndarray, mass: float) -> float:
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


def _template_errors(a: np.ndarray, r0: int, c0: int, cx: float, cy: float, mass: float) -> dict:
  """err_s for every shape (module docstring, step 4): `a` on a crop at (r0, c0) against the
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


def _holes(a: np.ndarray, mine: np.ndarray) -> float:
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
      aspect=_aspect(vx, vy, cxy),
      aspect_tri=_aspect(vx, 0.75 * vy, math.sqrt(0.75) * cxy),
      skew_x=float(col @ (dx2 * dx)) / mass / vx**1.5,
      skew_y=float(row @ (dy2 * dy)) / mass / vy**1.5,
      solidity=_solidity(a, mass),
      holes=_holes(a, mine) / mass,
      fill=mass / max(w * h, 1e-6),
      err=_template_errors(a, r0, c0, cx, cy, mass),
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
  # Each pixel belongs to its nearest component (chessboard distance); see module docstring.
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


def _soft(margin: float) -> float:
  return float(0.5 * (1.0 + np.tanh(0.5 * margin / MARGIN_TEMPERATURE)))  # = sigmoid(m / T)


def relation_margin(a: Blob, b: Blob, relation: str) -> float:
  """Signed margin of GenEval's relative-position rule for a w.r.t. b (y downward):
  > 0 iff the relation holds; -0.5 for coincident centroids."""
  off = np.array([a.cx - b.cx, a.cy - b.cy], np.float64)
  norm = float(np.linalg.norm(off))
  if norm < 1e-6:
    return -0.5
  dims = np.array([a.w + b.w, a.h + b.h], np.float64)
  rev = np.maximum(np.abs(off) - POSITION_THRESHOLD * dims, 0.0) * np.sign(off)
  dx, dy = rev / norm
  return float({"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation] - 0.5)


def relation_holds(a: Blob, b: Blob, relation: str) -> bool:
  """GenEval-style relative position of a w.r.t. b (y downward)."""
  return relation_margin(a, b, relation) > 0.0


def _atom_names(p: ShapesPrompt) -> list[str]:
  names = [f"{i}_{k}" for i in range(len(p.objects)) for k in ("present", "count", "shape")]
  return names + (["relation"] if p.is_relation else []) + ["background"]


def check(image: np.ndarray, prompt: ShapesPrompt | str) -> CheckResult:
  """Atoms, partial credit and strict pass for one image; invalid images score 0."""
  p = parse(prompt) if isinstance(prompt, str) else prompt
  names = _atom_names(p)
  scene = analyze(image, [o.color for o in p.objects])
  if scene is None:
    return CheckResult({k: False for k in names}, 0.0, False, 0.0, {k: 0.0 for k in names})
  atoms, soft = {}, {}
  for i, o in enumerate(p.objects):
    blobs = scene.blobs[o.color]
    margins = [shape_margin(b, o.shape) for b in blobs]
    atoms[f"{i}_present"] = len(blobs) > 0
    atoms[f"{i}_count"] = len(blobs) == o.count
    atoms[f"{i}_shape"] = len(blobs) > 0 and all(m > 0.0 for m in margins)
    # The worst component decides the strict atom, so it decides the soft one too.
    soft[f"{i}_shape"] = min((_soft(m) for m in margins), default=0.0)
  if p.is_relation:
    ba, bb = scene.blobs[p.objects[0].color], scene.blobs[p.objects[1].color]
    m = relation_margin(ba[0], bb[0], p.relation) if ba and bb else -1.0
    atoms["relation"] = m > 0.0
    soft["relation"] = _soft(m / MARGIN_WIDTHS["relation"]) if ba and bb else 0.0
  atoms["background"] = scene.background == p.background
  soft = {k: soft.get(k, float(v)) for k, v in atoms.items()}
  partial = sum(atoms.values()) / len(atoms)
  dense = sum(soft.values()) / len(atoms)
  return CheckResult(atoms, float(partial), all(atoms.values()), float(dense), soft)


# ------------------------------------------------- second scoring path: plain thresholds only


def shape_ok(b: Blob, shape: str) -> bool:
  """Whether blob `b` is `shape`, written as plain threshold comparisons (no margins, no
  smoothing); agrees with shape_margin(b, shape) > 0."""
  err = b.err[shape]
  if not (
      b.size_frac > MIN_SHAPE_FRAC
      and b.solidity > SOLIDITY_MIN
      and b.holes < HOLES_MAX
      and b.fill > FILL_MIN[shape]
      and err < TEMPLATE_ERR_MAX
      and all(b.err[o] - err > TEMPLATE_GAP_MIN for o in SHAPES if o != shape)
  ):
    return False
  if shape == "triangle":
    return b.aspect_tri < ASPECT_MAX and abs(b.skew_x) < SKEW_MAX and b.skew_y < TRIANGLE_SKEW_Y_MAX
  return b.aspect < ASPECT_MAX and abs(b.skew_x) < SKEW_MAX and abs(b.skew_y) < SKEW_MAX


def _relation_ok(a: Blob, b: Blob, relation: str) -> bool:
  """GenEval's relative-position rule (step 7) as plain comparisons."""
  off = (a.cx - b.cx, a.cy - b.cy)
  norm = math.hypot(*off)
  if norm < 1e-6:
    return False
  axis, sign = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}[relation]
  extent = (a.w + b.w, a.h + b.h)[axis]
  return (
      sign * math.copysign(max(abs(off[axis]) - POSITION_THRESHOLD * extent, 0.0), off[axis]) / norm
      > 0.5
  )


def strict_atoms(image: np.ndarray, prompt: ShapesPrompt | str) -> dict[str, bool]:
  """Every atom of `prompt` for one image, from plain thresholds only (`shape_ok`, the plain
  relation rule): the second scoring path (module docstring). Invalid images fail every atom."""
  p = parse(prompt) if isinstance(prompt, str) else prompt
  scene = analyze(image, [o.color for o in p.objects])
  if scene is None:
    return {k: False for k in _atom_names(p)}
  atoms = {}
  for i, o in enumerate(p.objects):
    blobs = scene.blobs[o.color]
    atoms[f"{i}_present"] = bool(blobs)
    atoms[f"{i}_count"] = len(blobs) == o.count
    atoms[f"{i}_shape"] = bool(blobs) and all(shape_ok(b, o.shape) for b in blobs)
  if p.is_relation:
    ba, bb = scene.blobs[p.objects[0].color], scene.blobs[p.objects[1].color]
    atoms["relation"] = bool(ba and bb) and _relation_ok(ba[0], bb[0], p.relation)
  atoms["background"] = scene.background == p.background
  return atoms


def _parse_all(prompts: Sequence[str]) -> list[ShapesPrompt]:
  # An unparseable prompt is a configuration error (wrong reward for the prompt set), not a
  # bad sample, so it raises instead of scoring 0.
  return [parse(t) for t in prompts]


@register("shapes")
def shapes_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32 partial credit in [0, 1] (fraction of satisfied atoms)."""
  images = check_batch(images, prompts)
  return np.array([check(im, p).partial for im, p in zip(images, _parse_all(prompts))], np.float32)


@register("shapes_dense")
def shapes_dense_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32 in [0, 1]: partial credit with margin-smoothed shape and relation atoms."""
  images = check_batch(images, prompts)
  return np.array([check(im, p).dense for im, p in zip(images, _parse_all(prompts))], np.float32)


def check_all(images: np.ndarray, prompts: Sequence[str]) -> list[CheckResult]:
  """`check` of every (image, prompt) pair of a [B, H, W, 3] batch."""
  images = check_batch(images, prompts)
  return [check(im, p) for im, p in zip(images, _parse_all(prompts))]


def strict_atoms_all(images: np.ndarray, prompts: Sequence[str]) -> list[dict[str, bool]]:
  """`strict_atoms` of every (image, prompt) pair of a [B, H, W, 3] batch."""
  images = check_batch(images, prompts)
  return [strict_atoms(im, p) for im, p in zip(images, _parse_all(prompts))]


def atom_rates(results: Sequence[CheckResult | dict]) -> dict[str, float]:
  """Fraction of satisfied atoms per kind (present, count, shape, relation, background) over
  `results` (CheckResults, or `strict_atoms` dicts): which part of the prompts a model gets
  wrong."""
  hits: dict[str, list[bool]] = {}
  for r in results:
    for name, ok in (r if isinstance(r, dict) else r.atoms).items():
      hits.setdefault(name.split("_")[-1], []).append(bool(ok))
  return {kind: float(np.mean(v)) for kind, v in sorted(hits.items())}


def shapes_strict(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] bool: every atom satisfied (the evaluation accuracy)."""
  return np.array([r.strict for r in check_all(images, prompts)], bool)


@register("shapes_strict")
def shapes_strict_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32 in {0, 1}: `shapes_strict` as a reward."""
  return shapes_strict(images, prompts).astype(np.float32)


@register("shapes_strict_atoms")
def shapes_strict_atoms_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """[B] float32 in {0, 1}: every atom satisfied under `strict_atoms` (plain thresholds, the
  second scoring path); its mean is the accuracy to report beside `shapes_strict`."""
  return np.array([all(a.values()) for a in strict_atoms_all(images, prompts)], np.float32)
