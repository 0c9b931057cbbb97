"""ShapesBench grammar (round trip, splits) and renderer (geometry, anti-aliasing, determinism)."""

import itertools

import numpy as np
import pytest

from digen_jax.tasks.shapes import grammar as G
from digen_jax.tasks.shapes import render as R

# ------------------------------------------------------------------------------------ grammar


def test_round_trip_every_prompt():
  prompts = G.all_prompts()
  texts = [p.to_text() for p in prompts]
  assert len(set(texts)) == len(texts) > 1000
  for p, t in zip(prompts, texts):
    q = G.parse(t)
    assert q == p and q.to_text() == t


def test_examples_and_normalisation():
  p = G.parse("two red circles on a white background")
  assert p.objects == (G.ShapeObject("red", "circle", 2),) and p.relation is None
  assert p.background == "white"
  q = G.parse("  A Red Circle left of a Blue Square on a black background ")
  assert q.relation == "left of" and [o.color for o in q.objects] == ["red", "blue"]
  assert q.to_text() == "a red circle left of a blue square on a black background"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a red circle",  # no background
        "a red circles on a white background",  # number disagreement
        "two red circle on a white background",
        "four red circles on a white background",  # count out of range
        "a pink circle on a white background",  # unknown colour
        "a red hexagon on a white background",
        "a red circle on a red background",  # background is not an object colour
        "a red circle left of a red square on a white background",  # same colour in a relation
        "two red circles left of a blue square on a white background",
        "a red circle near a blue square on a white background",
        "a red circle on a white background please",
    ],
)
def test_parse_rejects(text):
  with pytest.raises(ValueError):
    G.parse(text)


def test_parse_rejects_non_str():
  with pytest.raises(ValueError, match="str"):
    G.parse(None)


def test_structured_validation():
  with pytest.raises(ValueError, match="count"):
    G.ShapeObject("red", "circle", 0)
  with pytest.raises(ValueError, match="background"):
    G.ShapesPrompt((G.ShapeObject("red", "circle"),), None, "red")
  with pytest.raises(ValueError, match="relation"):
    G.ShapesPrompt((G.ShapeObject("red", "circle"),), "above", "white")
  with pytest.raises(ValueError, match="count 1"):
    G.ShapesPrompt(
        (G.ShapeObject("red", "circle", 2), G.ShapeObject("blue", "square")), "above", "white"
    )


def test_palette_is_separable():
  cols = {**G.COLORS, **G.BACKGROUNDS}
  for a, b in itertools.combinations(cols, 2):
    if a in G.BACKGROUNDS and b in G.BACKGROUNDS:
      continue
    assert np.linalg.norm(np.subtract(cols[a], cols[b])) >= 0.55, (a, b)
  assert not set(G.COLORS) & set(G.BACKGROUNDS)


def test_split_is_compositional_and_disjoint():
  s = G.split_prompts()
  train, ev = s["train"], s["eval"]
  assert len(train) >= 300 and 50 <= len(ev) <= 110
  train_t, eval_t = {p.to_text() for p in train}, {p.to_text() for p in ev}
  assert len(train_t) == len(train) and len(eval_t) == len(ev)
  assert not train_t & eval_t
  # The rule: no held-out (colour, shape) pair anywhere in train; one in every eval prompt.
  train_pairs = set().union(*(p.pairs() for p in train))
  assert not train_pairs & G.HELD_OUT_PAIRS
  assert all(p.pairs() & G.HELD_OUT_PAIRS for p in ev)
  assert {pair for p in ev for pair in p.pairs()} >= G.HELD_OUT_PAIRS
  # ... while training still sees every colour, shape, count, relation and background.
  assert {c for c, _ in train_pairs} == set(G.COLORS)
  assert {s_ for _, s_ in train_pairs} == set(G.SHAPES)
  assert {p.objects[0].count for p in train} == {1, 2, 3}
  assert {p.relation for p in train if p.relation} == set(G.RELATIONS)
  assert {p.background for p in train} == set(G.BACKGROUNDS)
  # Both prompt kinds are evaluated.
  assert sum(p.is_relation for p in ev) >= 20 and sum(not p.is_relation for p in ev) >= 20
  # val (for choosing settings) is held out like eval and shares no prompt with it or train.
  val_t = {p.to_text() for p in s["val"]}
  assert len(val_t) == len(s["val"]) == G.NUM_VAL_RELATIONS
  assert not val_t & eval_t and not val_t & train_t
  assert all(p.is_relation and p.pairs() & G.HELD_OUT_PAIRS for p in s["val"])
  # rl (RL's prompts) = train + the other held-out relations: never an eval or val prompt, never
  # a held-out single-object (counting) prompt, and every held-out pair inside some relation.
  rl = s["rl"]
  rl_t = {p.to_text() for p in rl}
  assert len(rl_t) == len(rl) and rl_t >= train_t
  assert not rl_t & eval_t and not rl_t & val_t
  held = [p for p in rl if p.pairs() & G.HELD_OUT_PAIRS]
  assert held and all(p.is_relation for p in held)
  assert len(rl) == len(train) + len(held)
  assert {pair for p in held for pair in p.pairs()} >= G.HELD_OUT_PAIRS
  every_held_relation = {
      p.to_text() for p in G.iter_all_prompts() if p.is_relation and G.is_held_out(p)
  }
  assert rl_t - train_t == every_held_relation - eval_t - val_t


def test_split_and_sampling_deterministic():
  assert G.split_prompts() == G.split_prompts()
  a, b = G.sample_prompts(50, seed=3), G.sample_prompts(50, seed=3)
  assert a == b and a != G.sample_prompts(50, seed=4)
  ev = set(G.split_prompts()["eval"])
  assert all(p in ev for p in G.sample_prompts(40, seed=1, split="eval"))
  with pytest.raises(ValueError, match="split"):
    G.sample_prompts(2, 0, split="test")


def test_grammar_words_cover_all_prompts():
  words = set(G.grammar_words())
  used = {w for p in G.iter_all_prompts() for w in p.to_text().split()}
  assert used == words


def test_the_registered_vocabulary_and_the_toy_tokenizers_words_are_the_grammars():
  """The word encoder's vocabulary 'word' (registered by the task) and the toy pipelines'
  tokenizer words (experiment/tiny_pipeline.py keeps its own copy: the core does not import the
  task) are the grammar's words in its order, so every ShapesBench word is one token."""
  from digen_jax.experiment import tiny_pipeline
  from digen_jax.models.text import encoders as text_lib

  assert text_lib.vocabulary("word") == G.grammar_words()
  assert list(tiny_pipeline.TOY_WORDS) == G.grammar_words()


# ------------------------------------------------------------------------------------ render


def _relation_prompts(n, seed):
  return [p for p in G.sample_prompts(4 * n, seed) if p.is_relation][:n]


def test_render_contract():
  p = G.parse("three blue triangles on a gray background")
  img = R.render(p, 32, np.random.default_rng(0))
  assert img.shape == (32, 32, 3) and img.dtype == np.float32
  assert img.min() >= -1.0 and img.max() <= 1.0
  np.testing.assert_array_equal(img, R.render(p, 32, 0))  # int seed == Generator(seed)
  assert not np.array_equal(img, R.render(p, 32, 1))  # jitter
  assert R.render("a red circle on a white background", 48, 0).shape == (48, 48, 3)
  with pytest.raises(ValueError, match="size"):
    R.render(p, 8, 0)


@pytest.mark.parametrize("size", [24, 32, 64])
def test_border_is_pure_background_and_edges_antialiased(size):
  rng = np.random.default_rng(size)
  n_partial = 0
  for p in G.sample_prompts(30, seed=size):
    img = (R.render(p, size, rng) + 1) / 2
    bg = np.asarray(G.BACKGROUNDS[p.background], np.float32)
    ring = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    np.testing.assert_allclose(ring, np.broadcast_to(bg, ring.shape), atol=1e-6)
    # Anti-aliasing: some pixels are strict mixtures of background and an object colour.
    for o in p.objects:
      d = np.asarray(G.COLORS[o.color], np.float32) - bg
      alpha = ((img - bg) @ d) / (d @ d)
      resid = np.linalg.norm(img - bg - alpha[..., None] * d, axis=-1)
      n_partial += int(np.sum((alpha > 0.05) & (alpha < 0.95) & (resid < 1e-4)))
  assert n_partial > 100


def test_coverage_matches_analytic_area():
  for shape, area in [("circle", np.pi / 4), ("square", 1.0), ("triangle", 0.5)]:
    p = R.Placed("red", shape, 15.3, 16.7, 11.4)
    cov = R.coverage(p, 32, supersample=8)
    assert cov.min() >= 0 and cov.max() <= 1
    np.testing.assert_allclose(cov.sum(), area * 11.4**2, rtol=0.02)


def test_layout_counts_colours_no_overlap_margins():
  rng = np.random.default_rng(0)
  for p in G.sample_prompts(300, seed=5):
    for size in (32, 64):
      objs = R.layout(p, size, rng)
      want = [(o.color, o.shape) for o in p.objects for _ in range(o.count)]
      assert sorted((q.color, q.shape) for q in objs) == sorted(want)
      m = R.default_margin(size)
      for q in objs:
        x0, y0, x1, y1 = q.box
        assert x0 >= m - 1e-9 and y0 >= m - 1e-9 and x1 <= size - m + 1e-9 and y1 <= size - m + 1e-9
      # Counted objects keep a latent cell (size / 8) apart, so no cell of the 8 x 8 latent grid
      # holds two of them; a relation's pair keeps the default gap.
      gap = R.default_gap(size) if p.is_relation else R.count_gap(size)
      for a, b in itertools.combinations(objs, 2):
        assert R._box_gap(a, b) >= gap - 1e-9


def test_counted_objects_take_distinct_quadrants():
  rng = np.random.default_rng(2)
  for size in (16, 32, 64):
    half, seen = size / 2, set()
    for count in (2, 3):
      p = G.parse(f"{['', '', 'two', 'three'][count]} red squares on a white background")
      for _ in range(200):
        objs = R.layout(p, size, rng)
        quadrants = []
        for q in objs:
          x0, y0, x1, y1 = q.box
          # Wholly inside one quadrant, half a count gap clear of each midline.
          inner = R.count_gap(size) / 2
          assert (x1 <= half - inner + 1e-9) or (x0 >= half + inner - 1e-9), (size, q)
          assert (y1 <= half - inner + 1e-9) or (y0 >= half + inner - 1e-9), (size, q)
          quadrants.append((q.cx > half, q.cy > half))
        assert len(set(quadrants)) == count
        seen.update(quadrants)
    assert len(seen) == 4  # every quadrant is used


def test_relations_geometrically_true():
  rng = np.random.default_rng(1)
  for p in _relation_prompts(200, seed=7):
    a, b = R.layout(p, 32, rng)
    ax0, ay0, ax1, ay1 = a.box
    bx0, by0, bx1, by1 = b.box
    if p.relation == "left of":
      gap, du, dv = bx0 - ax1, b.cx - a.cx, b.cy - a.cy
    elif p.relation == "right of":
      gap, du, dv = ax0 - bx1, a.cx - b.cx, a.cy - b.cy
    elif p.relation == "above":  # y grows downward
      gap, du, dv = by0 - ay1, b.cy - a.cy, b.cx - a.cx
    else:
      gap, du, dv = ay0 - by1, a.cy - b.cy, a.cx - b.cx
    assert gap >= R.default_gap(32) - 1e-9, p.to_text()
    assert abs(dv) <= 0.3 * du + 1e-9, p.to_text()


def test_size_jitter():
  p = G.parse("a red square on a black background")
  extents = {round(R.layout(p, 32, s)[0].e, 3) for s in range(20)}
  assert len(extents) == 20
  assert max(extents) / min(extents) < 1.6


def test_render_batch_deterministic():
  ps = G.sample_prompts(8, 0)
  a, b = R.render_batch(ps, 32, seed=11), R.render_batch(ps, 32, seed=11)
  assert a.shape == (8, 32, 32, 3) and a.dtype == np.float32
  np.testing.assert_array_equal(a, b)


def test_miscaption_changes_exactly_one_attribute():
  rng = np.random.default_rng(0)
  two = G.parse("two red squares on a white background")
  rel = G.parse("a red square left of a blue circle on a black background")
  one = G.parse("a red square on a white background")
  for _ in range(20):
    assert G.miscaption(two, "count", rng).objects[0].count == 3
    r = G.miscaption(rel, "relation", rng)
    assert r.relation != rel.relation and r.objects == rel.objects
  assert G.miscaption(rel, "binding", rng).to_text() == (
      "a red circle left of a blue square on a black background"
  )
  # Not applicable: one object is never miscounted; binding needs two different shapes.
  assert G.miscaption(one, "count", rng) is None and G.miscaption(one, "relation", rng) is None
  same = G.parse("a red square left of a blue square on a black background")
  assert G.miscaption(same, "binding", rng) is None and G.miscaption(rel, "count", rng) is None
  with pytest.raises(ValueError, match="kind='colour'"):
    G.miscaption(rel, "colour", rng)


def test_training_batches_are_deterministic_noisy_and_never_name_held_out_pairs():
  from digen_jax.tasks.shapes import training as T

  spec = T.BatchSpec(batch=400, size=16, seed=3, caption_noise=0.5)
  a, b = T.training_batch(spec, 7), T.training_batch(spec, 7)
  np.testing.assert_array_equal(a.images, b.images)
  assert a.captions == b.captions and a.captions != T.training_batch(spec, 8).captions
  truths = [G.parse(t) for t in a.truths]
  caps = [G.parse(t) for t in a.captions]
  assert 0.45 < np.mean([not p.is_relation for p in truths]) < 0.55
  # Every eligible pair (all but one-object prompts) is miscaptioned with probability 0.5.
  eligible = np.array([p.is_relation or p.objects[0].count > 1 for p in truths])
  assert not a.miscaptioned[~eligible].any()
  assert 0.4 < a.miscaptioned[eligible].mean() < 0.6
  assert a.miscaptioned.tolist() == [c != t for c, t in zip(a.captions, a.truths)]
  assert not any(G.is_held_out(p) for p in truths + caps)
  # The image is always the truth's: re-rendering the true prompts reproduces it.
  clean = T.training_batch(T.BatchSpec(batch=400, size=16, seed=3), 7)
  assert clean.truths == a.truths and not clean.miscaptioned.any()
  np.testing.assert_array_equal(clean.images, a.images)
  with pytest.raises(ValueError, match="caption_noise"):
    T.BatchSpec(batch=4, size=16, seed=0, caption_noise=1.5)


def test_single_count_weights_set_each_counts_share_of_the_singles():
  from digen_jax.tasks.shapes import training as T

  def count_shares(weights):
    spec = T.BatchSpec(batch=4000, size=16, seed=4, single_count_weights=weights)
    drawn = T.sample_prompts(spec, np.random.default_rng(0), spec.batch)
    singles = [p for p in drawn if not p.is_relation]
    counts = np.bincount([p.objects[0].count for p in singles], minlength=4)[1:]
    return counts / counts.sum(), singles

  equal, _ = count_shares(None)
  np.testing.assert_allclose(equal, [1 / 3] * 3, atol=0.04)  # the split holds every count alike
  skewed, singles = count_shares((1.0, 3.0, 5.0))
  np.testing.assert_allclose(skewed, [1 / 9, 3 / 9, 5 / 9], atol=0.04)
  only_three, _ = count_shares((0.0, 0.0, 1.0))
  assert only_three.tolist() == [0.0, 0.0, 1.0]
  # Within a count every prompt stays drawable: all shapes, colours and backgrounds appear.
  assert {p.objects[0].shape for p in singles} == set(G.SHAPES)
  for bad in ((1.0, 2.0), (0.0, 0.0, 0.0), (1.0, -1.0, 1.0), (1.0, float("nan"), 1.0)):
    with pytest.raises(ValueError, match="single_count_weights"):
      T.BatchSpec(batch=4, size=16, seed=0, single_count_weights=bad)


def test_batch_stream_workers_yield_the_in_process_batches():
  from digen_jax.tasks.shapes import training as T

  spec = T.BatchSpec(batch=8, size=16, seed=1, caption_noise=0.3)
  with T.BatchStream(spec, first_step=5) as s0, T.BatchStream(spec, first_step=5, workers=2) as s2:
    for _ in range(4):
      x, y = next(s0), next(s2)
      assert x.captions == y.captions
      np.testing.assert_array_equal(x.images, y.images)
  assert T.training_batch(spec, 8).captions == x.captions


def test_shape_maps_are_the_drawn_objects_coverage_per_shape():
  from digen_jax.tasks.shapes import training as T

  spec = T.BatchSpec(batch=64, size=32, seed=5)
  plain, mapped = T.training_batch(spec, 2), T.training_batch(
      T.BatchSpec(batch=64, size=32, seed=5, shape_maps=True), 2
  )
  assert plain.shape_maps is None
  np.testing.assert_array_equal(plain.images, mapped.images)  # maps never change the images
  assert mapped.shape_maps.shape == (64, 32, 32, len(G.SHAPES))
  for img, truth, maps in zip(mapped.images, mapped.truths, mapped.shape_maps):
    p = G.parse(truth)
    drawn = {o.shape for o in p.objects}
    for k, shape in enumerate(G.SHAPES):
      # A shape's channel is lit exactly when the prompt draws that shape.
      assert (maps[..., k].sum() > 0) == (shape in drawn)
    # Wherever a channel is lit, the image shows an object colour, not the background.
    bg = np.asarray(G.BACKGROUNDS[p.background]) * 2 - 1
    covered = maps.sum(-1) > 0.99
    assert np.abs(img[covered] - bg).max(axis=-1).min() > 0.3
    assert np.abs(img[maps.sum(-1) == 0] - bg).max() < 1e-6


def test_color_maps_are_coverage_times_object_colour_and_split_all_holds_every_pair():
  """color_maps (the autoencoder's colour-channel targets) equal the image's object part exactly:
  image = background + coverage * (colour - background), so where the background is black,
  (image + 1) / 2 == colour x coverage. split='all' draws every composition, held-out pairs too."""
  from digen_jax.tasks.shapes import training as T

  b = T.training_batch(
      T.BatchSpec(batch=256, size=32, seed=9, split="all", shape_maps=True, color_maps=True), 1
  )
  assert (
      b.color_maps.shape == (256, 32, 32, 3) and 0 <= b.color_maps.min() <= b.color_maps.max() <= 1
  )
  black = [i for i, t in enumerate(b.truths) if G.parse(t).background == "black"]
  assert black
  np.testing.assert_allclose((b.images[black] + 1) / 2, b.color_maps[black], atol=1e-5)
  # Colour maps are lit exactly where shape maps are.
  np.testing.assert_array_equal(b.color_maps.max(-1) > 0, b.shape_maps.max(-1) > 0)
  assert any(G.is_held_out(G.parse(t)) for t in b.truths)
  assert not any(G.is_held_out(G.parse(t)) for t in T.training_batch(
      T.BatchSpec(batch=256, size=32, seed=9), 1).truths)  # fmt: skip


def test_shared_coverages_give_the_same_image_and_maps():
  """training_batch computes each object's coverage once for the image and both map kinds: the
  results are bit-identical to computing them per view, and a wrong-length list is refused."""
  rng = np.random.default_rng(3)
  for text in (
      "three red circles on a white background",
      "a blue square left of a yellow triangle on a gray background",
  ):
    p = G.parse(text)
    objs = R.layout(p, 32, rng)
    covs = [R.coverage(o, 32) for o in objs]
    np.testing.assert_array_equal(
        R.rasterize(objs, p.background, 32, coverages=covs), R.rasterize(objs, p.background, 32)
    )
    np.testing.assert_array_equal(R.shape_coverage(objs, coverages=covs), R.shape_coverage(objs))
    np.testing.assert_array_equal(R.color_coverage(objs, coverages=covs), R.color_coverage(objs))
    with pytest.raises(ValueError, match="coverages: 0 maps for"):
      R.shape_coverage(objs, coverages=[])
