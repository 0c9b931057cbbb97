"""ShapesBench checker: scores an image against its prompt with plain code (no learned model).

Per image ([H, W, 3] float32 in [-1, 1]):
  1. Validity: non-finite values, or values outside [-1 - RANGE_TOL, 1 + RANGE_TOL] (e.g. a
     [0, 255] image) -> score 0. Otherwise clip to [-1, 1] and map to [0, 1].
  2. Background: median of the 1-pixel border ring. If fewer than half of the border pixels lie
     within BG_UNIFORM_TOL of it there is no uniform background (noise, garbage): score 0,
     since nothing can be segmented. The background *name* is the nearest palette background
     within BG_MATCH_TOL (else unknown).
  3. Objects, per prompted colour c: every pixel is projected onto the segment bg -> c:
     alpha = <u - bg, c - bg> / |c - bg|^2 (its coverage, exact for anti-aliased edges) and
     residual = distance to the segment. Core pixels (alpha > 0.5, residual < RESIDUAL_TOL)
     are grouped into 8-connected components (scipy.ndimage.label); components with soft mass
     sum(alpha) < MIN_AREA_FRAC * H * W are dropped as specks.
  4. Shape: fill = soft mass / (soft width * soft height), where soft width = sum over columns of
     the column's max alpha (a sub-pixel bounding-box width); skew = the larger |skewness| of
     the column and row mass profiles. Axis-aligned circle: fill ~0.785, square ~1, up-triangle
     ~0.5 (measured 0.52-0.65 at 32 px: its thin apex rows shrink the soft height), and only the
     triangle is lopsided (skew ~0.57 vs < 0.2). Triangle iff fill < FILL_TRIANGLE_MAX or
     skew > SKEW_TRIANGLE_MIN; otherwise circle iff fill < FILL_CIRCLE_MAX; else square.
  5. Relation (GenEval's rule): offset = centroid(A) - centroid(B); its magnitude is reduced per
     axis by POSITION_THRESHOLD * (w_A + w_B) (resp. h) and divided by |offset|; "left of" iff
     that x-component < -0.5 (similarly right/above/below; y grows downward).

Atoms (each 0/1): per object -> present, count (number of components of its colour equals the
prompt count), shape (every component of its colour has the prompted shape); relation prompts
add relation (on the largest component of each colour); every prompt adds background.
`shapes_reward` = fraction of satisfied atoms (partial credit for training); `shapes_strict`
= all atoms satisfied (evaluation accuracy). `shapes_dense` (training only) replaces the 0/1
shape and relation atoms by a sigmoid of the signed margin to the checker's decision boundary
(MARGIN_TEMPERATURE), so a sample whose square is *almost* square-cornered already scores higher
than a round one: the binary atom gives a group no gradient until some sample crosses the
threshold. At zero temperature it equals `shapes_reward`. Extra objects of other colours are not penalised
(as in GenEval's attribute checks).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from scipy import ndimage  # scipy is a hard dependency of jax, so always installed with it

from digen_jax.data.shapes.grammar import BACKGROUNDS, COLORS, ShapesPrompt, parse
from digen_jax.rewards.registry import check_batch, register

RANGE_TOL = 0.1
BG_UNIFORM_TOL = 0.15
BG_UNIFORM_FRAC = 0.5
BG_MATCH_TOL = 0.2
RESIDUAL_TOL = 0.2
MIN_COLOR_CONTRAST = 0.3
MIN_AREA_FRAC = 0.006
FILL_TRIANGLE_MAX = 0.70
FILL_CIRCLE_MAX = 0.9
SKEW_TRIANGLE_MIN = 0.3
POSITION_THRESHOLD = 0.1
MARGIN_TEMPERATURE = 0.03  # fill / skew / relation-component units; ~1/10 of the class gaps

_EIGHT = np.ones((3, 3), bool)


@dataclasses.dataclass(frozen=True)
class Blob:
    """One detected object. Coordinates in pixels, y downward; w/h are soft extents."""

    color: str
    shape: str
    mass: float
    cx: float
    cy: float
    w: float
    h: float
    fill: float
    skew: float


@dataclasses.dataclass(frozen=True)
class Scene:
    background: Optional[str]  # palette name, or None if the uniform background is off-palette
    blobs: dict[str, list[Blob]]  # colour -> components, largest first


@dataclasses.dataclass(frozen=True)
class CheckResult:
    atoms: dict[str, bool]
    partial: float
    strict: bool
    dense: float = 0.0  # mean of soft atoms (see module docstring); 0 for invalid images


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


def _skewness(p: np.ndarray, x: np.ndarray, mean: float) -> float:
    d = x - mean
    var = float(p @ (d * d))
    return float(p @ (d * d * d)) / max(var, 1e-12) ** 1.5


def classify_shape(fill: float, skew: float = 0.0) -> str:
    """Shape from bounding-box fill ratio and mass-profile skewness (see module docstring)."""
    if fill < FILL_TRIANGLE_MAX or skew > SKEW_TRIANGLE_MIN:
        return "triangle"
    if fill < FILL_CIRCLE_MAX:
        return "circle"
    return "square"


def shape_margin(fill: float, skew: float, shape: str) -> float:
    """Signed distance of (fill, skew) into `shape`'s decision region of classify_shape:
    > 0 iff classify_shape(fill, skew) == shape (up to ties on the boundary)."""
    tri = max(FILL_TRIANGLE_MAX - fill, skew - SKEW_TRIANGLE_MIN)
    if shape == "triangle":
        return tri
    if shape == "circle":
        return min(-tri, FILL_CIRCLE_MAX - fill)
    return min(-tri, fill - FILL_CIRCLE_MAX)


def _soft(margin: float) -> float:
    return float(0.5 * (1.0 + np.tanh(0.5 * margin / MARGIN_TEMPERATURE)))  # = sigmoid(m / T)


def _blobs_for_color(u: np.ndarray, bg: np.ndarray, name: str) -> list[Blob]:
    col = np.asarray(COLORS[name], np.float32)
    d = col - bg
    dd = float(d @ d)
    if dd < MIN_COLOR_CONTRAST ** 2:
        return []  # colour indistinguishable from the background
    rel = u - bg
    alpha = (rel @ d) / dd
    a01 = np.clip(alpha, 0.0, 1.0)
    resid = np.linalg.norm(rel - a01[..., None] * d, axis=-1)
    ok = resid < RESIDUAL_TOL
    core = ok & (alpha > 0.5)
    labels, n = ndimage.label(core, structure=_EIGHT)
    if n == 0:
        return []
    h_img, w_img = core.shape
    min_mass = MIN_AREA_FRAC * h_img * w_img
    soft = np.where(ok, a01, 0.0).astype(np.float32)
    # Each component's soft region: its core dilated by one pixel (the anti-aliased rim),
    # minus other components' cores.
    slices = ndimage.find_objects(labels)
    ys, xs = np.arange(h_img, dtype=np.float32), np.arange(w_img, dtype=np.float32)
    blobs = []
    for k, sl in enumerate(slices, start=1):
        r0, r1 = max(sl[0].start - 1, 0), min(sl[0].stop + 1, h_img)
        c0, c1 = max(sl[1].start - 1, 0), min(sl[1].stop + 1, w_img)
        lab = labels[r0:r1, c0:c1]
        mine = ndimage.binary_dilation(lab == k, structure=_EIGHT)
        region = mine & ((lab == 0) | (lab == k))
        a = np.where(region, soft[r0:r1, c0:c1], 0.0)
        mass = float(a.sum())
        if mass < min_mass:
            continue
        w = float(a.max(axis=0).sum())
        h = float(a.max(axis=1).sum())
        fill = mass / max(w * h, 1e-6)
        px, py = a.sum(axis=0) / mass, a.sum(axis=1) / mass  # marginal mass profiles
        cx = float(px @ (xs[c0:c1] + 0.5))
        cy = float(py @ (ys[r0:r1] + 0.5))
        skew = max(abs(_skewness(px, xs[c0:c1] + 0.5, cx)), abs(_skewness(py, ys[r0:r1] + 0.5, cy)))
        blobs.append(Blob(name, classify_shape(fill, skew), mass, cx, cy, w, h, fill, skew))
    blobs.sort(key=lambda b: -b.mass)
    return blobs


def analyze(image: np.ndarray, colors: Sequence[str] = tuple(COLORS)) -> Optional[Scene]:
    """Segments one [H, W, 3] image in [-1, 1]; None if invalid or without a uniform background."""
    u = _to_unit(image)
    if u is None:
        return None
    border = np.concatenate([u[0], u[-1], u[1:-1, 0], u[1:-1, -1]], axis=0)
    bg = np.median(border, axis=0).astype(np.float32)
    if np.mean(np.linalg.norm(border - bg, axis=-1) < BG_UNIFORM_TOL) < BG_UNIFORM_FRAC:
        return None
    dists = {k: float(np.linalg.norm(bg - np.asarray(v, np.float32))) for k, v in BACKGROUNDS.items()}
    best = min(dists, key=dists.get)
    bg_name = best if dists[best] < BG_MATCH_TOL else None
    return Scene(bg_name, {c: _blobs_for_color(u, bg, c) for c in colors})


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


def check(image: np.ndarray, prompt: ShapesPrompt | str) -> CheckResult:
    """Atoms, partial credit and strict pass for one image; invalid images score 0."""
    p = parse(prompt) if isinstance(prompt, str) else prompt
    names = [f"{i}_{k}" for i in range(len(p.objects)) for k in ("present", "count", "shape")]
    names += (["relation"] if p.is_relation else []) + ["background"]
    scene = analyze(image, [o.color for o in p.objects])
    if scene is None:
        return CheckResult({k: False for k in names}, 0.0, False)
    atoms, soft = {}, {}
    for i, o in enumerate(p.objects):
        blobs = scene.blobs[o.color]
        atoms[f"{i}_present"] = len(blobs) > 0
        atoms[f"{i}_count"] = len(blobs) == o.count
        atoms[f"{i}_shape"] = len(blobs) > 0 and all(b.shape == o.shape for b in blobs)
        # The worst component decides the strict atom, so it decides the soft one too.
        soft[f"{i}_shape"] = min((_soft(shape_margin(b.fill, b.skew, o.shape)) for b in blobs),
                                 default=0.0)
    if p.is_relation:
        ba, bb = scene.blobs[p.objects[0].color], scene.blobs[p.objects[1].color]
        atoms["relation"] = bool(ba and bb and relation_holds(ba[0], bb[0], p.relation))
        soft["relation"] = _soft(relation_margin(ba[0], bb[0], p.relation)) if ba and bb else 0.0
    atoms["background"] = scene.background == p.background
    partial = sum(atoms.values()) / len(atoms)
    dense = sum(soft.get(k, float(v)) for k, v in atoms.items()) / len(atoms)
    return CheckResult(atoms, float(partial), all(atoms.values()), float(dense))


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


def atom_rates(results: Sequence[CheckResult]) -> dict[str, float]:
    """Fraction of satisfied atoms per kind (present, count, shape, relation, background) over
    `results`: which part of the prompts a model gets wrong."""
    hits: dict[str, list[bool]] = {}
    for r in results:
        for name, ok in r.atoms.items():
            hits.setdefault(name.split("_")[-1], []).append(bool(ok))
    return {kind: float(np.mean(v)) for kind, v in sorted(hits.items())}


def shapes_strict(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """[B] bool: every atom satisfied (the evaluation accuracy)."""
    return np.array([r.strict for r in check_all(images, prompts)], bool)


@register("shapes_strict")
def shapes_strict_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """[B] float32 in {0, 1}: `shapes_strict` as a reward."""
    return shapes_strict(images, prompts).astype(np.float32)
