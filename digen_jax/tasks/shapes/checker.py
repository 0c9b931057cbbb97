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
on all eight sets: 100%. Near misses (tests/tasks/shapes/test_checker_adversarial.py; 16 px, 32 px) measure
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

Code: scene.py segments and classifies (steps 1-3, 5, 6: `analyze`, `Blob`, the shape gates),
geometry.py measures each object (step 4); this module holds the relation rule (step 7), the
atoms, both scoring paths and the registered rewards.

Cost: ~0.6 ms an image at 16 px on one core (~40 ms for a 64-image batch; the previous
fill/skewness checker took ~13 ms), most of it in the per-object template and hull.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from digen_jax.rewards.registry import check_batch, register
from digen_jax.tasks.shapes.grammar import SHAPES, ShapesPrompt, parse
from digen_jax.tasks.shapes.scene import (
    ASPECT_MAX,
    Blob,
    FILL_MIN,
    HOLES_MAX,
    MARGIN_WIDTHS,
    MIN_SHAPE_FRAC,
    SKEW_MAX,
    SOLIDITY_MIN,
    Scene,
    TEMPLATE_ERR_MAX,
    TEMPLATE_GAP_MIN,
    TRIANGLE_SKEW_Y_MAX,
    analyze,
    shape_gates,
    shape_margin,
)

# What other modules use: the segmentation and shape gates (scene.py) stay importable from here.
__all__ = [
    "Blob",
    "CheckResult",
    "Scene",
    "analyze",
    "atom_rates",
    "check",
    "check_all",
    "relation_holds",
    "relation_margin",
    "shape_gates",
    "shape_margin",
    "shape_ok",
    "shapes_dense_reward",
    "shapes_reward",
    "shapes_strict",
    "shapes_strict_atoms_reward",
    "shapes_strict_reward",
    "strict_atoms",
    "strict_atoms_all",
]

POSITION_THRESHOLD = 0.1
MARGIN_TEMPERATURE = 0.25  # in gate widths: one width past a threshold -> sigmoid(-4) = 0.018


@dataclasses.dataclass(frozen=True)
class CheckResult:
  atoms: dict[str, bool]
  partial: float
  strict: bool
  dense: float = 0.0  # mean of soft atoms (see module docstring); 0 for invalid images
  soft: dict = dataclasses.field(default_factory=dict)  # atom -> its credit in `dense`


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
