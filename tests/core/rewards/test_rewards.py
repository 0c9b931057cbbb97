"""Reward registry, ShapesBench checker (accuracy on rendered ground truth) and JPEG rewards."""

import io

import numpy as np
import pytest
from PIL import Image

from digen_jax.tasks.shapes import grammar as G
from digen_jax.tasks.shapes import render as R
from digen_jax.rewards import registry
from digen_jax.rewards import jpeg
from digen_jax.rewards.registry import build_reward
from digen_jax.tasks.shapes import checker as sc


@pytest.fixture(scope="module")
def ground_truth():
  """320 train + 100 eval prompts, their texts and freshly rendered 32px images."""
  prompts = G.sample_prompts(320, seed=123, split="train") + G.split_prompts()["eval"]
  texts = [p.to_text() for p in prompts]
  return prompts, texts, R.render_batch(prompts, 32, seed=7)


def _mismatched(texts, seed=0):
  rng = np.random.default_rng(seed)
  while True:  # a derangement of the prompts, so no image keeps its own prompt
    perm = rng.permutation(len(texts))
    if np.all(perm != np.arange(len(texts))):
      break
  other = [texts[i] for i in perm]
  keep = np.array([a != b for a, b in zip(texts, other)])
  return other, keep


def test_strict_accuracy_on_ground_truth(ground_truth):
  prompts, texts, imgs = ground_truth
  ok = sc.shapes_strict(imgs, texts)
  assert ok.dtype == bool and ok.shape == (len(texts),)
  assert ok.mean() >= 0.99, [t for t, o in zip(texts, ok) if not o][:5]
  held = np.array([G.is_held_out(p) for p in prompts])
  assert held.sum() == 100 and ok[held].mean() >= 0.99  # the eval split too


def test_atom_rates_say_which_part_fails(ground_truth):
  _, texts, imgs = ground_truth
  truth = sc.atom_rates(sc.check_all(imgs, texts))
  assert set(truth) == {"present", "count", "shape", "relation", "background"}
  assert min(truth.values()) >= 0.99, truth
  assert sc.atom_rates(sc.strict_atoms_all(imgs, texts)) == truth  # the second scoring path
  blank = np.ones_like(imgs[:8])  # a white canvas: nothing present, background right or wrong
  rates = sc.atom_rates(sc.check_all(blank, texts[:8]))
  assert rates["present"] == 0.0 and rates["count"] == 0.0 and rates["shape"] == 0.0
  assert rates["background"] == np.mean([t.endswith("white background") for t in texts[:8]])


def test_strict_accuracy_other_sizes():
  prompts = G.sample_prompts(80, seed=9, split="train") + G.sample_prompts(20, 9, "eval")
  texts = [p.to_text() for p in prompts]
  for size in (16, 24, 64):  # 16 px: the shipped base model's size, squares ~4 px wide
    assert sc.shapes_strict(R.render_batch(prompts, size, seed=1), texts).mean() >= 0.99, size


def test_mismatched_prompts_fail(ground_truth):
  _, texts, imgs = ground_truth
  other, keep = _mismatched(texts)
  assert sc.shapes_strict(imgs, other)[keep].mean() <= 0.05
  true_r, wrong_r = sc.shapes_reward(imgs, texts), sc.shapes_reward(imgs, other)
  assert true_r.dtype == np.float32 and true_r.min() >= 0 and true_r.max() <= 1
  assert true_r.mean() - wrong_r[keep].mean() > 0.4
  assert np.mean(true_r[keep] > wrong_r[keep]) > 0.9


def test_robust_to_mild_noise(ground_truth):
  _, texts, imgs = ground_truth
  rng = np.random.default_rng(0)
  noisy = np.clip(imgs + 0.05 * rng.standard_normal(imgs.shape), -1, 1)
  assert sc.shapes_strict(noisy.astype(np.float32), texts).mean() >= 0.95
  prompts = G.sample_prompts(200, seed=4)  # and at 16 px
  small = R.render_batch(prompts, 16, seed=4)
  noisy = np.clip(small + 0.05 * rng.standard_normal(small.shape), -1, 1).astype(np.float32)
  assert sc.shapes_strict(noisy, [p.to_text() for p in prompts]).mean() >= 0.95


def test_partial_credit_atoms():
  img = R.render("a red circle on a white background", 32, 0)[None]
  r = sc.shapes_reward(img, ["two red circles on a white background"])  # count wrong only
  np.testing.assert_allclose(r, [0.75])
  np.testing.assert_allclose(sc.shapes_reward(img, ["a red square on a white background"]), [0.75])
  np.testing.assert_allclose(sc.shapes_reward(img, ["a red circle on a black background"]), [0.75])
  # Colour absent -> present, count and shape fail; background holds.
  np.testing.assert_allclose(sc.shapes_reward(img, ["a blue circle on a white background"]), [0.25])

  rel = "a red circle left of a blue square on a gray background"
  img = R.render(rel, 32, 3)[None]
  assert sc.shapes_strict(img, [rel])[0]
  assert sc.shapes_strict(img, ["a blue square right of a red circle on a gray background"])[0]
  flipped = "a red circle right of a blue square on a gray background"
  res = sc.check(img[0], flipped)
  assert not res.strict and [k for k, v in res.atoms.items() if not v] == ["relation"]
  np.testing.assert_allclose(sc.shapes_reward(img, [flipped]), [7 / 8])


def test_shape_classifier_is_not_trivial():
  """Every shape is told apart from the other two on the same scene otherwise."""
  for s, others in [
      ("circle", ("square", "triangle")),
      ("square", ("circle", "triangle")),
      ("triangle", ("circle", "square")),
  ]:
    img = R.render(f"two green {s}s on a black background", 32, 5)[None]
    assert sc.shapes_strict(img, [f"two green {s}s on a black background"])[0]
    for o in others:
      assert not sc.shapes_strict(img, [f"two green {o}s on a black background"])[0]


@pytest.mark.parametrize(
    "kind",
    ["nan", "inf", "uniform_noise", "gauss_noise", "uint8_scale", "zero_to_255_float", "huge"],
)
def test_garbage_scores_zero(kind):
  rng = np.random.default_rng(0)
  shape = (6, 32, 32, 3)
  base = R.render_batch(G.sample_prompts(6, 2), 32, 0)
  imgs = {
      "nan": np.where(rng.random(shape) < 0.01, np.nan, base),
      "inf": np.where(rng.random(shape) < 0.01, np.inf, base),
      "uniform_noise": rng.uniform(-1, 1, shape),
      "gauss_noise": 0.4 * rng.standard_normal(shape),
      "uint8_scale": ((base + 1) * 127.5).round().astype(np.uint8),
      "zero_to_255_float": (base + 1) * 127.5,
      "huge": np.full(shape, 1e30),
  }[kind]
  texts = [p.to_text() for p in G.sample_prompts(6, 2)]
  r = sc.shapes_reward(imgs, texts)
  assert r.dtype == np.float32 and np.all(r == 0)
  assert not sc.shapes_strict(imgs, texts).any()


def test_checker_input_errors():
  imgs = np.zeros((2, 32, 32, 3), np.float32)
  with pytest.raises(ValueError, match="one prompt per image"):
    sc.shapes_reward(imgs, ["a red circle on a white background"])
  with pytest.raises(ValueError, match=r"\[B, H, W, 3\]"):
    sc.shapes_reward(imgs[0], ["a red circle on a white background"] * 32)
  with pytest.raises(ValueError, match="not a ShapesBench prompt"):
    sc.shapes_reward(imgs, ["a cat", "a dog"])


# ------------------------------------------------------------------------------------ registry


def test_registry_and_build_reward(ground_truth):
  _, texts, imgs = ground_truth
  imgs, texts = imgs[:8], texts[:8]
  names = registry.registered_names()
  assert {"shapes", "shapes_strict", "jpeg_compressibility", "jpeg_incompressibility"} <= set(names)
  fn = build_reward({"shapes": 1.0, "jpeg_compressibility": 0.5})
  out = fn(imgs, texts)
  assert out.shape == (8,) and out.dtype == np.float32
  want = sc.shapes_reward(imgs, texts) + 0.5 * jpeg.jpeg_compressibility(imgs, texts)
  np.testing.assert_allclose(out, want, rtol=1e-6)
  comps = fn.components(imgs, texts)
  assert set(comps) == {"shapes", "jpeg_compressibility"}
  with pytest.raises(ValueError, match="registered rewards: .*jpeg_compressibility.*shapes"):
    build_reward({"shapez": 1.0})
  with pytest.raises(ValueError, match="finite"):
    build_reward({"shapes": float("nan")})
  with pytest.raises(ValueError, match="non-empty"):
    build_reward({})


def test_parse_weights_spec():
  assert registry.parse_weights("shapes") == {"shapes": 1.0}
  assert registry.parse_weights(" shapes:1, shapes_strict:0.5 ") == {
      "shapes": 1.0,
      "shapes_strict": 0.5,
  }
  assert registry.parse_weights("jpeg_compressibility:-2e-1") == {"jpeg_compressibility": -0.2}
  for bad, match in (
      ("", "empty"),
      ("shapes,", "'' is not NAME"),
      (":1", "':1' is not NAME"),
      ("shapes:one", "'shapes:one' is not NAME"),
      ("shapes,shapes:2", "twice"),
  ):
    with pytest.raises(ValueError, match=match):
      registry.parse_weights(bad)


def test_register_custom_and_duplicates():
  name = "test_rewards_brightness"
  try:

    @registry.register(name)
    def brightness(images, prompts):
      return np.asarray(images).mean(axis=(1, 2, 3))

    imgs = np.stack([np.full((4, 4, 3), -0.5, np.float32), np.full((4, 4, 3), 0.25, np.float32)])
    np.testing.assert_allclose(build_reward({name: 2.0})(imgs, ["a", "b"]), [-1.0, 0.5])
    with pytest.raises(ValueError, match="already registered"):
      registry.register(name)(lambda images, prompts: np.zeros(len(prompts)))

    @registry.register(name + "_bad")
    def bad(images, prompts):
      return np.zeros((len(prompts), 2))

    with pytest.raises(ValueError, match="returned shape"):
      build_reward({name + "_bad": 1.0})(imgs, ["a", "b"])
  finally:
    registry._REGISTRY.pop(name, None)
    registry._REGISTRY.pop(name + "_bad", None)


# ------------------------------------------------------------------------------------ jpeg


def test_jpeg_flat_beats_noise_and_units():
  rng = np.random.default_rng(0)
  flat = np.full((32, 32, 3), 0.2, np.float32)
  noise = rng.uniform(-1, 1, (32, 32, 3)).astype(np.float32)
  imgs = np.stack([flat, noise])
  comp = jpeg.jpeg_compressibility(imgs, ["", ""])
  incomp = jpeg.jpeg_incompressibility(imgs, ["", ""])
  assert comp[0] > comp[1] and incomp[1] > incomp[0]
  np.testing.assert_allclose(comp, -incomp)
  # Units: kilobytes of a PIL quality-95 JPEG of the uint8 image (DDPO's convention).
  buf = io.BytesIO()
  Image.fromarray(np.clip(np.round((noise + 1) * 127.5), 0, 255).astype(np.uint8)).save(
      buf, format="JPEG", quality=95
  )
  np.testing.assert_allclose(incomp[1], len(buf.getvalue()) / 1000, rtol=1e-6)


@pytest.mark.parametrize("size", [8, 32, 64])
def test_jpeg_invalid_images_get_finite_penalty(size):
  rng = np.random.default_rng(size)
  noise = rng.uniform(-1, 1, (size, size, 3)).astype(np.float32)
  bad = noise.copy()
  bad[0, 0, 0] = np.nan
  inf = noise.copy()
  inf[1, 1, 1] = -np.inf
  imgs = np.stack([noise, bad, inf])
  for fn in (jpeg.jpeg_compressibility, jpeg.jpeg_incompressibility):
    r = fn(imgs, ["x"] * 3)
    assert np.all(np.isfinite(r))
    np.testing.assert_allclose(r[1:], jpeg.invalid_penalty(size, size))
    assert r[1] < r[0]  # worse than the least compressible valid image


def _red_ellipse(size, rx, ry, cx, cy):
  """A red ellipse on white, anti-aliased like the renderer (4x4 samples per pixel)."""
  g = (np.arange(size * 4) + 0.5) / 4
  inside = ((g[None, :] - cx) / rx) ** 2 + ((g[:, None] - cy) / ry) ** 2 <= 1
  cov = inside.astype(np.float32).reshape(size, 4, size, 4).mean(axis=(1, 3))[..., None]
  img = 1.0 + cov * (np.asarray(G.COLORS["red"], np.float32) - 1.0)
  return (img * 2 - 1).astype(np.float32)


def test_dense_reward_tracks_margins(ground_truth, monkeypatch):
  """shapes_dense: high on ground truth, equal to partial credit at ~zero temperature; the soft
  shape atom agrees with the gates (margin > 0 iff shape_ok iff Blob.shape), and a circle scores
  lower the more it is stretched, on both sides of the binary threshold."""
  _, texts, imgs = ground_truth
  dense, partial = sc.shapes_dense_reward(imgs, texts), sc.shapes_reward(imgs, texts)
  assert dense.mean() > 0.9 and np.all(dense <= 1.0) and np.all(dense >= 0.0)
  other, keep = _mismatched(texts)
  assert sc.shapes_dense_reward(imgs[keep], [t for t, k in zip(other, keep) if k]).mean() < 0.8
  monkeypatch.setattr(sc, "MARGIN_TEMPERATURE", 1e-9)
  np.testing.assert_allclose(sc.shapes_dense_reward(imgs[:64], texts[:64]), partial[:64], atol=1e-6)
  monkeypatch.undo()
  for img in imgs[:40]:
    for blobs in sc.analyze(img).blobs.values():
      for b in blobs:
        for s in G.SHAPES:
          assert (sc.shape_margin(b, s) > 0) == sc.shape_ok(b, s) == (b.shape == s)
  prompt = "a red circle on a white background"
  stretch = [1.0, 1.1, 1.2, 1.3, 1.4, 1.6]  # aspect ratio of an ellipse of constant area
  margins = []
  for k in stretch:
    img = _red_ellipse(32, 6 * np.sqrt(k), 6 / np.sqrt(k), 16.3, 15.8)
    (b,) = sc.analyze(img, ["red"]).blobs["red"]
    margins.append(sc.shape_margin(b, "circle"))
    assert sc.check(img, prompt).soft["0_shape"] == pytest.approx(sc._soft(margins[-1]))
  assert np.all(np.diff(margins) < 0)
  assert (np.array(margins) > 0).tolist() == [True] * 3 + [False] * 3
  assert sc.check(np.full((16, 16, 3), np.nan, np.float32), texts[0]).dense == 0.0


def test_user_reward_callable_from_the_config(tmp_path):
  """config.reward.callables registers a user's function over uint8 images without editing the
  package; bad specs are one clear error naming the field."""
  from configs import qwenimage
  from digen_jax.experiment import config as configlib
  from digen_jax.rewards import registry

  (tmp_path / "my_reward.py").write_text(
      "import numpy as np\n"
      "def brightness(images, prompts):\n"
      "  assert images.dtype == np.uint8 and images.ndim == 4, images.dtype\n"
      "  return images.reshape(len(images), -1).mean(1) / 255.0 + len(prompts[0]) * 0\n"
  )
  c = qwenimage.get_config("tiny")
  c.reward.callables = f'bright={tmp_path / "my_reward.py"}:brightness'
  c.reward.weights = "bright:2,jpeg_compressibility:0"
  configlib.validate(c, 2)
  fn = registry.build_reward(registry.parse_weights(c.reward.weights))
  imgs = np.stack([np.full((8, 8, 3), -1.0, np.float32), np.full((8, 8, 3), 1.0, np.float32)])
  np.testing.assert_allclose(fn(imgs, ["a", "b"]), [0.0, 2.0], atol=1e-6)
  configlib.validate(c, 2)  # registering the same spec again is fine
  for spec, msg in [
      ("bright", "NAME=module"),
      (f"x={tmp_path}/nope.py:f", "does not exist"),
      (f'y={tmp_path / "my_reward.py"}:missing', "no function"),
      ("z=no_such_module_xyz:f", "cannot import"),
      ("shapes=json:dumps", "already registered"),
  ]:
    c.reward.callables = spec
    with pytest.raises(ValueError, match=f"config.reward.*{msg}"):
      configlib.validate(c, 2)
