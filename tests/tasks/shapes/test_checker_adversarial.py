"""ShapesBench checker against near misses: images that are almost, but not, what the prompt asks
for must fail the strict verdict under both scoring paths and earn (almost) no training-reward
credit for the atom they attack; ground truth sits well inside every gate."""

import functools

import numpy as np
import pytest
from scipy import ndimage

from digen_jax.tasks.shapes import grammar as G
from digen_jax.tasks.shapes import render as R
from digen_jax.rewards import registry
from digen_jax.rewards.registry import build_reward
from digen_jax.tasks.shapes import checker as sc

# A near miss's credit for the atom it attacks, as shapes_dense pays it (the atom's soft value,
# in [0, 1]; the reward is the mean over the prompt's atoms).
SOFT_CREDIT_MAX = 0.05
_SS = 8  # the painter's supersampling (the renderer's is 4: the checker must not care)

CIRCLE = "a red circle on a white background"
SQUARE = "a blue square on a white background"
TRIANGLE = "a green triangle on a white background"


# --------------------------------------------------------------- a painter for arbitrary shapes


def _paint(size, background, objects):
  """[size, size, 3] in [-1, 1]: anti-aliased objects [(colour, inside(x, y) -> bool)]."""
  bg = np.asarray(G.BACKGROUNDS[background], np.float32)
  img = np.broadcast_to(bg, (size, size, 3)).copy()
  g = (np.arange(size * _SS) + 0.5) / _SS
  x, y = np.meshgrid(g, g)
  for color, inside in objects:
    cov = inside(x, y).astype(np.float32).reshape(size, _SS, size, _SS).mean(axis=(1, 3))
    img += cov[..., None] * (np.asarray(G.COLORS[color], np.float32) - bg)
  return np.clip(img * 2 - 1, -1, 1).astype(np.float32)


def _ellipse(cx, cy, rx, ry):
  return lambda x, y: ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1


def _rect(cx, cy, hx, hy):
  return lambda x, y: (np.abs(x - cx) <= hx) & (np.abs(y - cy) <= hy)


def _triangle(cx, cy, e, apex="up", sx=1.0, sy=1.0):
  """Isosceles, base = height = e (then scaled by sx, sy), apex up/down/left/right."""

  def inside(x, y):
    dx, dy = (x - cx) / sx, (y - cy) / sy
    if apex in ("left", "right"):
      dx, dy = dy, dx
    if apex in ("down", "right"):
      dy = -dy
    t = dy / e + 0.5
    return (t >= 0) & (t <= 1) & (np.abs(dx) <= e / 2 * t)

  return inside


def _diamond(cx, cy, r):
  return lambda x, y: np.abs(x - cx) + np.abs(y - cy) <= r


def _union(*fs):
  return lambda x, y: np.any([f(x, y) for f in fs], axis=0)


def _minus(f, g):
  return lambda x, y: f(x, y) & ~g(x, y)


def _dither(f, phase=0):
  """Checkerboard: only every other pixel of the shape."""
  return lambda x, y: f(x, y) & ((np.floor(x) + np.floor(y) + phase) % 2 == 0)


def _dropout(f, size, frac, seed):
  """The shape with a random `frac` of its pixels left as background."""
  keep = np.random.default_rng(seed).random((size, size)) >= frac
  return lambda x, y: f(x, y) & keep[np.floor(y).astype(int), np.floor(x).astype(int)]


def _shape(shape, cx, cy, e):
  """The renderer's shape, painted: circle, square, upward triangle of extent e."""
  return {
      "circle": _ellipse(cx, cy, e / 2, e / 2),
      "square": _rect(cx, cy, e / 2, e / 2),
      "triangle": _triangle(cx, cy, e),
  }[shape]


# --------------------------------------------------------------------------- the catalogue


@functools.lru_cache(maxsize=None)
def _catalogue(size):
  """{name: (prompt, attacked atom, image)} of near misses, one object of the size the renderer
  draws for a single-object prompt (extent 0.32..0.44 of the image) off the pixel grid."""
  c, e = size / 2 + 0.3, 0.38 * size
  r, w, t3 = e / 2, max(1.0, size / 16), e / 3  # w: a 1-pixel stroke at 16 px
  cases = {}

  def add(name, prompt, atom, objects, image=None):
    cases[name] = (prompt, atom, _paint(size, "white", objects) if image is None else image)

  for k in (2.0, 1.5):  # stretched k:1 at the same area
    q = np.sqrt(k)
    add(f"ellipse {k}:1 wide", CIRCLE, "0_shape", [("red", _ellipse(c, c, r * q, r / q))])
    add(f"ellipse {k}:1 tall", CIRCLE, "0_shape", [("red", _ellipse(c, c, r / q, r * q))])
    add(f"rectangle {k}:1 wide", SQUARE, "0_shape", [("blue", _rect(c, c, r * q, r / q))])
    add(f"rectangle {k}:1 tall", SQUARE, "0_shape", [("blue", _rect(c, c, r / q, r * q))])
    add(
        f"triangle {k}:1 wide", TRIANGLE, "0_shape", [("green", _triangle(c, c, e, "up", q, 1 / q))]
    )
    add(
        f"triangle {k}:1 tall", TRIANGLE, "0_shape", [("green", _triangle(c, c, e, "up", 1 / q, q))]
    )
  for apex in ("down", "left", "right"):
    add(f"triangle pointing {apex}", TRIANGLE, "0_shape", [("green", _triangle(c, c, e, apex))])
  diamond = _diamond(c, c, r * np.sqrt(2) * 0.9)
  ell = _union(_rect(c - r + t3 / 2, c, t3 / 2, r), _rect(c, c + r - t3 / 2, r, t3 / 2))
  plus = _union(_rect(c, c, r, t3 / 2), _rect(c, c, t3 / 2, r))
  for what, prompt, color in (
      ("triangle", TRIANGLE, "green"),
      ("square", SQUARE, "blue"),
      ("circle", CIRCLE, "red"),
  ):
    add(f"diamond as {what}", prompt, "0_shape", [(color, diamond)])
    add(f"L-shape as {what}", prompt, "0_shape", [(color, ell)])
    add(f"plus as {what}", prompt, "0_shape", [(color, plus)])
  add(
      "ring as circle",
      CIRCLE,
      "0_shape",
      [("red", _minus(_ellipse(c, c, r, r), _ellipse(c, c, r - w, r - w)))],
  )
  add(
      "frame as square",
      SQUARE,
      "0_shape",
      [("blue", _minus(_rect(c, c, r, r), _rect(c, c, r - w, r - w)))],
  )
  add(
      "outline triangle",
      TRIANGLE,
      "0_shape",
      [("green", _minus(_triangle(c, c, e), _triangle(c, c + w / 2, e - 2.5 * w)))],
  )
  for what, prompt, color in (
      ("circle", CIRCLE, "red"),
      ("square", SQUARE, "blue"),
      ("triangle", TRIANGLE, "green"),
  ):
    add(f"dithered {what}", prompt, "0_shape", [(color, _dither(_shape(what, c, c, e)))])
    add(
        f"speckled {what} (30% dropout)",
        prompt,
        "0_shape",
        [(color, _dropout(_shape(what, c, c, e), size, 0.3, seed=1))],
    )
  pair = _union(
      _ellipse(c - 0.4 * e, c, 0.8 * r, 0.8 * r), _ellipse(c + 0.4 * e, c, 0.8 * r, 0.8 * r)
  )
  add("two circles merged, as a circle", CIRCLE, "0_shape", [("red", pair)])
  add(
      "two circles merged, as two",
      "two red circles on a white background",
      "0_count",
      [("red", pair)],
  )
  add(
      "two squares merged, as a square",
      SQUARE,
      "0_shape",
      [
          (
              "blue",
              _union(
                  _rect(c - 0.3 * e, c, 0.7 * r, 0.7 * r), _rect(c + 0.3 * e, c, 0.7 * r, 0.7 * r)
              ),
          )
      ],
  )
  spots = [(0.25 * size, 0.3 * size), (0.72 * size, 0.3 * size), (0.5 * size, 0.72 * size)]
  e2 = 0.28 * size
  add(
      "three circles for two",
      "two red circles on a white background",
      "0_count",
      [("red", _ellipse(x, y, e2 / 2, e2 / 2)) for x, y in spots],
  )
  add(
      "two squares for one",
      SQUARE,
      "0_count",
      [("blue", _rect(x, y, e2 / 2, e2 / 2)) for x, y in spots[:2]],
  )
  add(
      "a square beside the triangle",
      TRIANGLE,
      "0_count",
      [("green", _triangle(*spots[0], e2)), ("green", _rect(*spots[1], e2 / 2, e2 / 2))],
  )
  for inner in ("gray", "black"):  # the wrong background inside a 1-pixel frame of the right one
    img = _paint(size, inner, [("red", _ellipse(c, c, r, r))])
    img[0, :] = img[-1, :] = img[:, 0] = img[:, -1] = 1.0
    add(f"{inner} inside a white 1-px frame", CIRCLE, "background", None, img)
  return cases


_NAMES = list(_catalogue(16))


@pytest.mark.parametrize("size", [16, 32])
def test_painter_draws_what_the_renderer_draws(size):
  """Control: the painter's renderer shapes (random place and size, finer anti-aliasing) pass, so
  the near misses below fail for what they are, not for how they are painted."""
  rng = np.random.default_rng(size)
  for shape, color in (("circle", "red"), ("square", "blue"), ("triangle", "green")):
    for _ in range(10):
      e = rng.uniform(0.24, 0.44) * size
      cx, cy = rng.uniform(e / 2 + 2, size - e / 2 - 2, size=2)
      img = _paint(size, "white", [(color, _shape(shape, cx, cy, e))])
      res = sc.check(img, f"a {color} {shape} on a white background")
      assert res.strict and res.soft["0_shape"] > 0.9, (shape, e, res)


@pytest.mark.parametrize("size", [16, 32])
@pytest.mark.parametrize("name", _NAMES)
def test_near_miss_fails(name, size):
  prompt, atom, img = _catalogue(size)[name]
  res, hard = sc.check(img, prompt), sc.strict_atoms(img, prompt)
  assert not res.strict and not res.atoms[atom] and not hard[atom], (res.atoms, hard)
  assert res.soft[atom] < SOFT_CREDIT_MAX, res.soft  # no training credit for the attacked atom
  assert sc.shapes_strict_atoms_reward(img[None], [prompt])[0] == 0.0


@pytest.mark.parametrize("size", [16, 32])
def test_blurred_near_misses_still_fail(size):
  """A slight blur (sigma 0.5 px) is tolerated for real shapes, and does not turn a near miss
  into one."""
  for name, (prompt, atom, img) in _catalogue(size).items():
    blurred = ndimage.gaussian_filter(img, (0.5, 0.5, 0), mode="nearest")
    assert not sc.check(blurred, prompt).atoms[atom], name
    assert not sc.strict_atoms(blurred, prompt)[atom], name


def test_random_speckle_and_dither_fail():
  """Dithered or 30%-dropout shapes at random places and sizes: fail, without credit (at 16 px a
  few dropouts that only chip an edge still look like the shape, hence the 5%)."""
  for size in (16, 32):
    rng = np.random.default_rng(size)
    for shape, color in (("circle", "red"), ("square", "blue"), ("triangle", "green")):
      prompt, soft, ok = f"a {color} {shape} on a white background", [], []
      for seed in range(20):
        e = rng.uniform(0.32, 0.44) * size
        cx, cy = rng.uniform(e / 2 + 2, size - e / 2 - 2, size=2)
        for f in (
            _dither(_shape(shape, cx, cy, e), seed % 2),
            _dropout(_shape(shape, cx, cy, e), size, 0.3, seed),
        ):
          res = sc.check(_paint(size, "white", [(color, f)]), prompt)
          soft.append(res.soft["0_shape"])
          ok.append(res.atoms["0_shape"])
      assert np.mean(ok) <= 0.05 and np.median(soft) < 0.01, (size, shape, np.mean(ok), soft)


@pytest.mark.parametrize("size", [16, 32])
def test_stretch_sweep(size):
  """The rendered shapes never exceed aspect ~1.13 (16 px) and the strict test passes up to 1.1;
  from 1.3 on it fails, and the dense credit falls monotonically with the stretch in between."""
  ks = [1.0, 1.1, 1.2, 1.25, 1.3, 1.4, 1.5, 2.0]
  for shape, color in (("circle", "red"), ("square", "blue"), ("triangle", "green")):
    prompt = f"a {color} {shape} on a white background"
    for off in (0.0, 0.25, 0.5):
      c, r, soft = size / 2 + off, 0.19 * size, []
      for k in ks:
        q = np.sqrt(k)
        f = {
            "circle": _ellipse(c, c, r * q, r / q),
            "square": _rect(c, c, r * q, r / q),
            "triangle": _triangle(c, c, 2 * r, "up", q, 1 / q),
        }[shape]
        res = sc.check(_paint(size, "white", [(color, f)]), prompt)
        if k <= 1.1 or k >= 1.3:
          assert res.strict == (k <= 1.1), (shape, k, res)
        soft.append(res.soft["0_shape"])
      assert np.all(np.diff(soft) < 0.02), (shape, off, soft)
      assert soft[-2] < SOFT_CREDIT_MAX and soft[-1] < SOFT_CREDIT_MAX, (shape, soft)


def test_background_is_judged_over_the_whole_region():
  img = R.render(CIRCLE, 16, rng=0)
  assert sc.check(img, CIRCLE).strict
  for width in (1, 2):  # a frame of the right colour around a wrong background
    framed = np.full_like(img, 1.0)
    framed[width:-width, width:-width] = R.render("a red circle on a gray background", 16, 0)[
        width:-width, width:-width
    ]
    assert not sc.check(framed, CIRCLE).atoms["background"]
    assert not sc.strict_atoms(framed, CIRCLE)["background"]
  stuff = img.copy()
  stuff[1:6, 9:15] = np.array([1.0, 0.5, 0.0]) * 2 - 1  # an orange patch: 12% of the background
  assert not sc.check(stuff, CIRCLE).atoms["background"]
  speck = img.copy()
  speck[1, 14] = np.array([1.0, 0.5, 0.0]) * 2 - 1  # one stray pixel is still a white background
  assert sc.check(speck, CIRCLE).strict
  other_colour = R.render("a red circle left of a blue square on a white background", 16, 1)
  assert sc.check(other_colour, CIRCLE).atoms["background"]  # other palette objects are objects


def _images_for_agreement():
  prompts = G.sample_prompts(120, seed=5, split="train") + G.sample_prompts(40, 5, "eval")
  texts = [p.to_text() for p in prompts]
  rng = np.random.default_rng(0)
  out = []
  for size in (16, 32):
    imgs = R.render_batch(prompts, size, seed=size)
    noisy = np.clip(imgs + 0.05 * rng.standard_normal(imgs.shape), -1, 1).astype(np.float32)
    blotchy = np.clip(
        ndimage.gaussian_filter(imgs + 0.3 * rng.standard_normal(imgs.shape), (0, 0.8, 0.8, 0)),
        -1,
        1,
    ).astype(np.float32)
    shuffled = list(np.roll(texts, 1))
    out += [(imgs, texts), (noisy, texts), (imgs, shuffled), (blotchy, texts)]
    cat = _catalogue(size).values()
    out.append((np.stack([im for _, _, im in cat]), [p for p, _, _ in cat]))
  return out


@pytest.mark.slow
def test_two_scoring_paths_agree():
  """check (the reward's margins at zero temperature) and strict_atoms (plain thresholds) give
  the same atoms on ground truth, noisy, mismatched, blotchy and near-miss images."""
  assert "shapes_strict_atoms" in registry.registered_names()
  for imgs, texts in _images_for_agreement():
    checked, hard = sc.check_all(imgs, texts), sc.strict_atoms_all(imgs, texts)
    for r, h, t in zip(checked, hard, texts):
      assert r.atoms == h, (t, r.atoms, h)
    np.testing.assert_array_equal(
        build_reward({"shapes_strict_atoms": 1.0})(imgs, texts),
        sc.shapes_strict(imgs, texts).astype(np.float32),
    )
    assert sc.atom_rates(hard) == sc.atom_rates(checked)


@pytest.mark.parametrize("size", [16, 32])
def test_ground_truth_sits_inside_every_gate(size):
  """Calibration guard: every rendered object is at least half a gate width inside every gate
  of its shape, so its dense shape credit is >= sigmoid(2) = 0.88 (module docstring table)."""
  prompts = G.sample_prompts(200, seed=size, split="train") + G.sample_prompts(50, size, "eval")
  imgs = R.render_batch(prompts, size, seed=3)
  for p, img in zip(prompts, imgs):
    scene = sc.analyze(img, [o.color for o in p.objects])
    for o in p.objects:
      assert len(scene.blobs[o.color]) == o.count
      for b in scene.blobs[o.color]:
        assert b.shape == o.shape and sc.shape_margin(b, o.shape) >= 0.5, (
            p.to_text(),
            sc.shape_gates(b, o.shape),
        )
