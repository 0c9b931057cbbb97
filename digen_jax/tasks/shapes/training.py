"""Pretraining pairs for the ShapesBench base generator: (rendered image, caption) batches.

Every batch is a pure function of (spec, step): prompts from the split, images rendered from the
true prompts, and a `spec.caption_noise` share of the captions made wrong in one attribute
(`grammar.miscaption`). So a `BatchStream` with worker processes yields exactly the batches of
one without (a GPU needs the workers: one core renders ~5k images/s, a GPU step eats 256 in a
few ms), and a resumed or repeated run sees the same data.

A miscaptioned pair never names a held-out (colour, shape) pair: the caption is left true when
every applicable corruption would name one, so the eval split's compositions stay unseen.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
from typing import Iterator

import numpy as np

from digen_jax.tasks.shapes import grammar
from digen_jax.tasks.shapes import render as render_lib


@dataclasses.dataclass(frozen=True)
class BatchSpec:
  """What one training batch holds.

  split: the prompts drawn from: 'train', 'val', 'eval', 'rl' (grammar.split_prompts) or 'all'
    (every composition; for image-only training, e.g. an autoencoder's).
  single_fraction: share of single-object prompts (< 0: uniform over the split; the train split is
    ~93% relation prompts, so uniform sampling would starve counting).
  single_count_weights: relative weights of counts 1..grammar.MAX_COUNT among the single-object
    prompts (None: uniform over the split's singles, i.e. equal weights). Counting three objects is
    the hardest thing a single-object prompt asks, so a base may weight it up.
  caption_noise: share of pairs whose caption is wrong in one attribute, drawn uniformly among
    `noise_kinds` that apply to the prompt (grammar.MISCAPTION_KINDS).
  shape_maps: also return each image's per-shape coverage maps (render.shape_coverage).
  color_maps: also return each image's colour-times-coverage maps (render.color_coverage).
  """

  batch: int
  size: int
  seed: int
  split: str = 'train'
  single_fraction: float = 0.5
  single_count_weights: tuple[float, ...] | None = None
  caption_noise: float = 0.0
  noise_kinds: tuple[str, ...] = grammar.MISCAPTION_KINDS
  shape_maps: bool = False
  color_maps: bool = False

  def __post_init__(self):
    if self.batch < 1:
      raise ValueError(f'batch={self.batch} must be >= 1')
    if not 0.0 <= self.caption_noise < 1.0:
      raise ValueError(f'caption_noise={self.caption_noise} must be in [0, 1)')
    bad = [k for k in self.noise_kinds if k not in grammar.MISCAPTION_KINDS]
    if bad or not self.noise_kinds:
      raise ValueError(
          f'noise_kinds={self.noise_kinds!r}: use a non-empty subset of '
          f'{grammar.MISCAPTION_KINDS}'
      )
    weights = self.single_count_weights
    if weights is not None and (
        len(weights) != grammar.MAX_COUNT
        or not all(np.isfinite(w) and w >= 0 for w in weights)
        or sum(weights) <= 0
    ):
      raise ValueError(
          f'single_count_weights={weights!r}: give {grammar.MAX_COUNT} finite weights >= 0 '
          f'(counts 1..{grammar.MAX_COUNT}, not all zero), e.g. (1, 2, 3)'
      )


@dataclasses.dataclass(frozen=True)
class Batch:
  """images [B, size, size, 3] float32 in [-1, 1]; captions (what the model is told); truths (what
  was drawn); miscaptioned [B] bool; shape_maps [B, size, size, len(SHAPES)] or None; color_maps
  [B, size, size, 3] or None."""

  images: np.ndarray
  captions: list[str]
  truths: list[str]
  miscaptioned: np.ndarray
  shape_maps: np.ndarray | None = None
  color_maps: np.ndarray | None = None


@dataclasses.dataclass
class _Pools:
  singles: list[grammar.ShapesPrompt]
  relations: list[grammar.ShapesPrompt]
  everything: list[grammar.ShapesPrompt]

  def single_probabilities(self, count_weights: tuple[float, ...]) -> np.ndarray:
    """[len(singles)] draw probabilities giving count c the share count_weights[c - 1]."""
    counts = np.array([p.objects[0].count for p in self.singles])
    weights = np.asarray(count_weights, np.float64)[counts - 1]
    per_count = np.bincount(counts, minlength=len(count_weights) + 1)[counts]
    probs = weights / per_count  # each count's weight shared by its prompts
    if not probs.sum() > 0:
      raise ValueError(
          f'single_count_weights={count_weights!r} give every single-object prompt of this '
          'split weight 0'
      )
    return probs / probs.sum()


_POOLS: dict[str, _Pools] = {}


def _pools(split: str) -> _Pools:
  if split not in _POOLS:
    splits = grammar.split_prompts()
    splits['all'] = list(grammar.iter_all_prompts())
    if split not in splits:
      raise ValueError(f'split={split!r} must be one of {sorted(splits)}')
    pool = splits[split]
    _POOLS[split] = _Pools(
        [p for p in pool if not p.is_relation], [p for p in pool if p.is_relation], list(pool)
    )
  return _POOLS[split]


def sample_prompts(spec: BatchSpec, rng: np.random.Generator, n: int) -> list[grammar.ShapesPrompt]:
  """n prompts of spec.split, spec.single_fraction of them single-object (if >= 0)."""
  pools = _pools(spec.split)
  if spec.single_fraction < 0:
    return [pools.everything[i] for i in rng.integers(0, len(pools.everything), n)]
  is_single = rng.random(n) < spec.single_fraction
  if spec.single_count_weights is None:
    draw_single = lambda: pools.singles[rng.integers(len(pools.singles))]
  else:
    probs = pools.single_probabilities(spec.single_count_weights)
    draw_single = lambda: pools.singles[rng.choice(len(probs), p=probs)]
  return [
      draw_single() if s else pools.relations[rng.integers(len(pools.relations))] for s in is_single
  ]


def caption_for(
    prompt: grammar.ShapesPrompt, spec: BatchSpec, rng: np.random.Generator
) -> grammar.ShapesPrompt:
  """The caption of one pair: the prompt itself, or with probability spec.caption_noise the prompt
  wrong in one applicable attribute that names no held-out pair."""
  if spec.caption_noise <= 0 or rng.random() >= spec.caption_noise:
    return prompt
  kinds = list(spec.noise_kinds)
  rng.shuffle(kinds)
  for kind in kinds:
    wrong = grammar.miscaption(prompt, kind, rng)
    if wrong is not None and not grammar.is_held_out(wrong):
      return wrong
  return prompt


def training_batch(spec: BatchSpec, step: int) -> Batch:
  """Batch number `step` of the stream `spec` describes (deterministic in (spec, step))."""
  # One stream each for prompts, layouts and captions: the same step draws the same prompts and
  # images whatever the caption noise, so noise levels compare on identical data.
  prompt_rng, image_rng, caption_rng = (
      np.random.default_rng([spec.seed, step, i]) for i in range(3)
  )
  truths = sample_prompts(spec, prompt_rng, spec.batch)
  captions = [caption_for(p, spec, caption_rng) for p in truths]
  layouts = [render_lib.layout(p, spec.size, image_rng) for p in truths]
  # Each object's coverage once, shared by the image and its coverage maps (rendering bounds
  # autoencoder pretraining).
  covs = [[render_lib.coverage(o, spec.size) for o in objs] for objs in layouts]
  images = np.stack(
      [
          render_lib.rasterize(objs, p.background, spec.size, coverages=c)
          for objs, p, c in zip(layouts, truths, covs)
      ]
  )
  maps = (
      np.stack(
          [render_lib.shape_coverage(o, spec.size, coverages=c) for o, c in zip(layouts, covs)]
      )
      if spec.shape_maps
      else None
  )
  colors = (
      np.stack(
          [render_lib.color_coverage(o, spec.size, coverages=c) for o, c in zip(layouts, covs)]
      )
      if spec.color_maps
      else None
  )
  return Batch(
      images,
      [c.to_text() for c in captions],
      [p.to_text() for p in truths],
      np.array([c != p for c, p in zip(captions, truths)]),
      maps,
      colors,
  )


class BatchStream:
  """Batches `first_step`, `first_step` + 1, ... of `spec`, rendered ahead by `workers` processes
  (0 = in this process). Use as a context manager; iteration never ends."""

  def __init__(self, spec: BatchSpec, first_step: int = 1, workers: int = 0, depth: int = 0):
    if workers < 0:
      raise ValueError(f'workers={workers} must be >= 0 (0 = render in this process)')
    self.spec, self.next_step, self.workers = spec, int(first_step), int(workers)
    self.depth = depth or 2 * max(workers, 1)
    self._pool = None
    self._pending: collections.deque = collections.deque()

  def __enter__(self) -> 'BatchStream':
    if self.workers:
      # spawn: the parent holds JAX's threads, which fork must not copy.
      self._pool = multiprocessing.get_context('spawn').Pool(self.workers)
    return self

  def __exit__(self, *exc) -> None:
    if self._pool is not None:
      self._pool.terminate()
      self._pool.join()
      self._pool = None

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    if self._pool is None:
      batch = training_batch(self.spec, self.next_step)
      self.next_step += 1
      return batch
    while len(self._pending) < self.depth:
      self._pending.append(
          self._pool.apply_async(training_batch, (self.spec, self.next_step + len(self._pending)))
      )
    batch = self._pending.popleft().get()
    self.next_step += 1
    return batch
