"""Evaluation of a ShapesBench generator during pretraining (pretrain.py): fixed prompt sets,
B samples per prompt with fixed noise scored by the pure-code checker, and the single-object
rates (the capability gate) with why counted prompts miss it."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.tasks.shapes import checker as shapes_checker
from digen_jax.tasks.shapes import grammar


def eval_prompt_set(split: str, n: int, seed: int = 0) -> list[str]:
  """A fixed set of min(n, |split|) distinct prompts (the whole eval split when n >= 100)."""
  pool = [p.to_text() for p in grammar.split_prompts()[split]]
  if n >= len(pool):
    return pool
  idx = np.sort(np.random.default_rng(seed).choice(len(pool), n, replace=False))
  return [pool[i] for i in idx]


def evaluate(
    sample_fn: Callable,
    params,
    codec_params,
    encoder,
    prompts: Sequence[str],
    samples_per_prompt: int,
    batch: int,
    latent_shape: tuple[int, int],
    seed: int,
) -> tuple[dict[str, float], np.ndarray]:
  """Samples `samples_per_prompt` images per prompt and checks them.

  Noise is a fixed function of (seed, image index), so repeated evals of the same params agree.
  Returns (metrics, images [P*S, H, W, 3]) with metrics strict_accuracy, reward_mean, and the
  strict accuracy of single-object and relation prompts separately.
  """
  texts = [p for p in prompts for _ in range(samples_per_prompt)]
  n = len(texts)
  init_key, step_key = jax.random.split(jax.random.key(seed))
  images = []
  for start in range(0, n, batch):
    chunk = texts[start : start + batch]
    pad = batch - len(chunk)  # pad the last chunk so every call has the same (compiled) shape
    emb, mask = encoder.encode(chunk + [chunk[-1]] * pad)
    keys = jax.random.split(jax.random.fold_in(init_key, start // batch), batch)
    x1 = jax.vmap(lambda k: jax.random.normal(k, latent_shape, jnp.float32))(keys)
    out = sample_fn(
        params,
        codec_params,
        x1,
        jnp.asarray(emb),
        jnp.asarray(mask),
        jax.random.fold_in(step_key, start // batch),
    )
    images.append(np.asarray(out)[: len(chunk)])
  images = np.concatenate(images, axis=0)
  checked = shapes_checker.check_all(images, texts)
  strict = np.array([r.strict for r in checked])
  partial = np.array([r.partial for r in checked], np.float32)
  is_rel = np.array([grammar.parse(t).is_relation for t in texts])
  res = {
      'strict_accuracy': float(strict.mean()),
      'reward_mean': float(partial.mean()),
      'reward_std': float(partial.std()),
      'num_prompts': len(prompts),
      'samples_per_prompt': samples_per_prompt,
  }
  if (~is_rel).any():
    res['strict_accuracy_single'] = float(strict[~is_rel].mean())
  if is_rel.any():
    res['strict_accuracy_relation'] = float(strict[is_rel].mean())
  res.update(single_object_rates(strict, texts))
  res.update(single_count_misses(checked, texts))
  return res, images


def single_object_rates(strict: np.ndarray, texts: Sequence[str]) -> dict[str, float]:
  """Strict accuracy of the single-object prompts among `texts`, per shape, colour and count
  ('single/shape/circle', ...), and the smallest of them ('single/min'): the capability gate.

  Shapes and colours are judged on one-object prompts (count words are composition); each count
  on every single-object prompt with that count."""
  rates: dict[str, float] = {}
  parsed = [grammar.parse(t) for t in texts]
  single = np.array([not q.is_relation for q in parsed])
  if not single.any():
    return rates
  obj = [q.objects[0] for q in parsed]
  one = single & np.array([o.count == 1 for o in obj])
  for attr, values in (('shape', grammar.SHAPES), ('color', tuple(grammar.COLORS))):
    for v in values:
      sel = one & np.array([getattr(o, attr) == v for o in obj])
      if sel.any():
        rates[f'single/{attr}/{v}'] = float(strict[sel].mean())
  for n in range(1, grammar.MAX_COUNT + 1):
    sel = single & np.array([o.count == n for o in obj])
    if sel.any():
      rates[f'single/count/{n}'] = float(strict[sel].mean())
  rates['single/min'] = min(rates.values())
  return rates


def single_count_misses(
    checked: Sequence[shapes_checker.CheckResult], texts: Sequence[str]
) -> dict[str, float]:
  """Why the capability gate's counted prompts fail: among the single-object samples of each count
  n >= 2, the share whose count atom fails ('single/miss_count/n': a missing, extra or merged
  object) and the share whose shape atom fails ('single/miss_shape/n': some object not drawn as
  the prompted shape). A sample can miss both."""
  out: dict[str, float] = {}
  parsed = [grammar.parse(t) for t in texts]
  for n in range(2, grammar.MAX_COUNT + 1):
    sel = [r for r, q in zip(checked, parsed) if not q.is_relation and q.objects[0].count == n]
    if sel:
      out[f'single/miss_count/{n}'] = float(np.mean([not r.atoms['0_count'] for r in sel]))
      out[f'single/miss_shape/{n}'] = float(np.mean([not r.atoms['0_shape'] for r in sel]))
  return out
