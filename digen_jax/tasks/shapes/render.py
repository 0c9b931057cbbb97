"""ShapesBench renderer: draws an image that satisfies a `ShapesPrompt` (numpy only).

`layout` places objects (continuous pixel coordinates, y grows downward) with small random
jitter of size and position; objects never overlap (their bounding boxes are at least `gap`
pixels apart) and keep a `margin` from the border, so the outer pixel ring is pure background.
Counted objects (two or three) each sit in their own quadrant of the image, at least `count_gap`
(one cell of an 8 x 8 latent grid) from each other.
Relations are geometrically strict: for "A left of B", A's box ends at least `gap` pixels
before B's box starts, and the vertical offset of the centres is at most 0.3x the horizontal
one (similarly for the other three relations).

`rasterize` anti-aliases by supersampling (`supersample`^2 point samples per pixel), so an edge
pixel is exactly background + coverage * (colour - background). Shapes are axis-aligned:
circle (diameter = extent), square (side = extent), triangle pointing up (base = height = extent),
whose bounding-box fill ratios are pi/4, 1 and 1/2.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from digen_jax.tasks.shapes.grammar import BACKGROUNDS, COLORS, SHAPES, ShapesPrompt, parse

# Extent (bounding-box side) ranges as fractions of the image size, per layout kind.
_EXTENT_FRAC = {1: (0.32, 0.44), 2: (0.26, 0.34), 3: (0.26, 0.34), "relation": (0.26, 0.34)}
_MAX_TRIES = 200


@dataclasses.dataclass(frozen=True)
class Placed:
  """One drawn object: centre (cx, cy) and extent e in pixels (its box is e x e)."""

  color: str
  shape: str
  cx: float
  cy: float
  e: float

  @property
  def box(self) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1)."""
    h = self.e / 2
    return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


def _as_prompt(prompt: Union[ShapesPrompt, str]) -> ShapesPrompt:
  return parse(prompt) if isinstance(prompt, str) else prompt


def _as_rng(rng: Union[np.random.Generator, int, None]) -> np.random.Generator:
  if isinstance(rng, np.random.Generator):
    return rng
  return np.random.default_rng(rng)


def _box_gap(a: Placed, b: Placed) -> float:
  """Chebyshev distance between two boxes (0 if they overlap)."""
  ax0, ay0, ax1, ay1 = a.box
  bx0, by0, bx1, by1 = b.box
  return max(bx0 - ax1, ax0 - bx1, by0 - ay1, ay0 - by1, 0.0)


def default_margin(size: int) -> float:
  return max(1.5, 0.06 * size)


def default_gap(size: int) -> float:
  return max(2.0, 0.08 * size)


def count_gap(size: int) -> float:
  # One cell of the base's 8 x 8 latent grid: no cell holds two counted objects, so a generator
  # working in that grid draws them apart (at default_gap the base often merged two).
  return max(default_gap(size), size / 8)


def _layout_count(prompt: ShapesPrompt, size: int, rng: np.random.Generator) -> list[Placed]:
  obj = prompt.objects[0]
  lo, hi = _EXTENT_FRAC[obj.count]
  margin = default_margin(size)
  if obj.count == 1:
    e = rng.uniform(lo, hi) * size
    cx, cy = rng.uniform(margin + e / 2, size - margin - e / 2, size=2)
    return [Placed(obj.color, obj.shape, cx, cy, e)]
  # Counted objects each take their own quadrant (which ones is random): a box keeps `margin`
  # from the border and half of `count_gap` from the midlines, so any two are >= count_gap apart.
  # Free placement crowded three ~9 px objects into 32 px, and a generator on the 8 x 8 latent
  # grid drew a fourth, partial one or merged two.
  half = size / 2
  inner = count_gap(size) / 2
  room = half - margin - inner
  out = []
  for quadrant in rng.choice(4, size=obj.count, replace=False):
    e = min(rng.uniform(lo, hi) * size, room)
    centre = []
    for low_half in (quadrant % 2 == 0, quadrant // 2 == 0):
      start = margin if low_half else half + inner
      centre.append(start + e / 2 + rng.uniform(0.0, room - e))
    out.append(Placed(obj.color, obj.shape, centre[0], centre[1], e))
  return out


def _layout_relation(prompt: ShapesPrompt, size: int, rng: np.random.Generator) -> list[Placed]:
  a, b = prompt.objects
  lo, hi = _EXTENT_FRAC["relation"]
  margin, gap = default_margin(size), default_gap(size)
  for _ in range(_MAX_TRIES):
    ea, eb = rng.uniform(lo, hi, size=2) * size
    # Work in (u, v): u is the relation axis, low-u object first; v is the other axis.
    first_is_a = prompt.relation in ("left of", "above")
    e_lo, e_hi = (ea, eb) if first_is_a else (eb, ea)
    room = size - 2 * margin - e_lo - e_hi
    if room < gap:
      continue
    gu = rng.uniform(gap, min(room, max(gap, 0.35 * size)))
    du = e_lo / 2 + gu + e_hi / 2  # centre distance along u
    dv = rng.uniform(-0.3, 0.3) * du
    u0 = rng.uniform(margin, size - margin - (e_lo + gu + e_hi))
    u_lo, u_hi = u0 + e_lo / 2, u0 + e_lo + gu + e_hi / 2
    # Centre v of the pair chosen so both objects stay inside the margins.
    v_min = max(margin + e_lo / 2 + dv / 2, margin + e_hi / 2 - dv / 2)
    v_max = min(size - margin - e_lo / 2 + dv / 2, size - margin - e_hi / 2 - dv / 2)
    if v_min > v_max:
      continue
    vc = rng.uniform(v_min, v_max)
    v_lo, v_hi = vc - dv / 2, vc + dv / 2
    horizontal = prompt.relation in ("left of", "right of")
    pts = [(u_lo, v_lo, e_lo), (u_hi, v_hi, e_hi)]
    if not first_is_a:
      pts = pts[::-1]
    out = []
    for obj, (u, v, e) in zip((a, b), pts):
      cx, cy = (u, v) if horizontal else (v, u)
      out.append(Placed(obj.color, obj.shape, cx, cy, e))
    return out
  raise RuntimeError(f"could not place a relation pair in a {size}px image")


def layout(
    prompt: Union[ShapesPrompt, str],
    size: int = 32,
    rng: Union[np.random.Generator, int, None] = None,
) -> list[Placed]:
  """Random object placement satisfying the prompt (see module docstring)."""
  if not isinstance(size, (int, np.integer)) or size < 16:
    raise ValueError(f"size={size!r} must be an int >= 16 (objects need a few pixels each)")
  prompt, rng = _as_prompt(prompt), _as_rng(rng)
  if prompt.is_relation:
    return _layout_relation(prompt, int(size), rng)
  return _layout_count(prompt, int(size), rng)


def _inside(shape: str, x: np.ndarray, y: np.ndarray, p: Placed) -> np.ndarray:
  dx, dy, h = x - p.cx, y - p.cy, p.e / 2
  if shape == "circle":
    return dx * dx + dy * dy <= h * h
  if shape == "square":
    return (np.abs(dx) <= h) & (np.abs(dy) <= h)
  if shape == "triangle":
    t = (dy + h) / p.e  # 0 at apex (top), 1 at base
    return (t >= 0) & (t <= 1) & (np.abs(dx) <= h * t)
  raise ValueError(f"shape={shape!r} must be one of {SHAPES}")


def coverage(p: Placed, size: int, supersample: int = 4) -> np.ndarray:
  """[size, size] float32 fraction of each pixel covered by the object."""
  cov = np.zeros((size, size), np.float32)
  x0, y0, x1, y1 = p.box
  c0, r0 = max(int(np.floor(x0)), 0), max(int(np.floor(y0)), 0)
  c1, r1 = min(int(np.ceil(x1)), size), min(int(np.ceil(y1)), size)
  if c1 <= c0 or r1 <= r0:
    return cov
  s = supersample
  offs = (np.arange(s) + 0.5) / s
  xs = (np.arange(c0, c1)[:, None] + offs[None, :]).reshape(-1)
  ys = (np.arange(r0, r1)[:, None] + offs[None, :]).reshape(-1)
  hit = _inside(p.shape, xs[None, :], ys[:, None], p).astype(np.float32)
  cov[r0:r1, c0:c1] = hit.reshape(r1 - r0, s, c1 - c0, s).mean(axis=(1, 3))
  return cov


Coverages = Optional[Sequence[np.ndarray]]


def _coverages(
    objects: Sequence[Placed], size: int, supersample: int, coverages: Coverages
) -> Sequence[np.ndarray]:
  """Each object's coverage map: `coverages` when given (computed once for an image's several
  views, e.g. by training.training_batch), else computed here."""
  if coverages is None:
    return [coverage(p, size, supersample) for p in objects]
  if len(coverages) != len(objects):
    raise ValueError(f"coverages: {len(coverages)} maps for {len(objects)} objects")
  return coverages


def rasterize(
    objects: Sequence[Placed],
    background: str,
    size: int = 32,
    supersample: int = 4,
    coverages: Coverages = None,
) -> np.ndarray:
  """[size, size, 3] float32 in [-1, 1]: background plus anti-aliased objects."""
  if background not in BACKGROUNDS:
    raise ValueError(f"background={background!r} must be one of {tuple(BACKGROUNDS)}")
  bg = np.asarray(BACKGROUNDS[background], np.float32)
  img = np.broadcast_to(bg, (size, size, 3)).copy()
  for p, cov in zip(objects, _coverages(objects, size, supersample, coverages)):
    col = np.asarray(COLORS[p.color], np.float32)
    img += cov[..., None] * (col - bg)
  return np.clip(img * 2.0 - 1.0, -1.0, 1.0).astype(np.float32)


def shape_coverage(
    objects: Sequence[Placed], size: int = 32, supersample: int = 4, coverages: Coverages = None
) -> np.ndarray:
  """[size, size, len(SHAPES)] float32: per pixel, the coverage by objects of each shape (in
  SHAPES order); what an autoencoder with shape channels is taught to put in its latents."""
  maps = np.zeros((size, size, len(SHAPES)), np.float32)
  for p, cov in zip(objects, _coverages(objects, size, supersample, coverages)):
    maps[..., SHAPES.index(p.shape)] += cov
  return np.clip(maps, 0.0, 1.0)


def color_coverage(
    objects: Sequence[Placed], size: int = 32, supersample: int = 4, coverages: Coverages = None
) -> np.ndarray:
  """[size, size, 3] float32 in [0, 1]: per pixel, the objects' RGB colour times their coverage
  (0 on the background); what an autoencoder with colour channels is taught to put in its latents
  beside the shape channels, so shape and colour are separate latent factors."""
  maps = np.zeros((size, size, 3), np.float32)
  for p, cov in zip(objects, _coverages(objects, size, supersample, coverages)):
    maps += cov[..., None] * np.asarray(COLORS[p.color], np.float32)
  return np.clip(maps, 0.0, 1.0)


def render(
    prompt: Union[ShapesPrompt, str],
    size: int = 32,
    rng: Union[np.random.Generator, int, None] = None,
    supersample: int = 4,
) -> np.ndarray:
  """Renders an image satisfying `prompt`: [size, size, 3] float32 in [-1, 1]."""
  prompt = _as_prompt(prompt)
  return rasterize(layout(prompt, size, rng), prompt.background, size, supersample)


def render_batch(
    prompts: Sequence[Union[ShapesPrompt, str]],
    size: int = 32,
    seed: Optional[int] = 0,
    supersample: int = 4,
) -> np.ndarray:
  """[B, size, size, 3] float32; one generator seeded by `seed` drives the whole batch."""
  rng = np.random.default_rng(seed)
  out = np.empty((len(prompts), size, size, 3), np.float32)
  for i, p in enumerate(prompts):
    out[i] = render(p, size, rng, supersample)
  return out
