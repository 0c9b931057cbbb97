"""Evaluation: deterministic ODE sampling of N samples per eval prompt, scored by the reward and
(for ShapesBench prompts) the strict checker; a JSON report and a PNG grid with pass/fail marks.

Used by `python -m digen_jax.eval` and periodically inside training."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from PIL import Image

from digen_jax import programs
from digen_jax import visualize
from digen_jax.data import prompts as prompt_data
from digen_jax.data.shapes import grammar
from digen_jax.rewards import shapes_checker
from digen_jax.runtime import mesh as mesh_lib


def eval_prompts(exp, workdir: str) -> list[str]:
  """The eval split's prompts (all of them, or the first eval.num_prompts)."""
  c = exp.config
  data_dir = prompt_data.resolve_data_dir(c.data.data_dir, workdir)
  source = prompt_data.load_prompts(c.data.prompts, c.eval.split, data_dir)
  n = len(source) if c.eval.num_prompts <= 0 else min(c.eval.num_prompts, len(source))
  return list(source[:n])


def _is_shapes(prompts) -> bool:
  try:
    for p in prompts:
      grammar.parse(p)
    return True
  except ValueError:
    return False


class Evaluator:
  """Compiles the ODE sampler once for `mesh` and evaluates any params on the eval prompts."""

  def __init__(self, exp, mesh, prompts: list[str], *, frozen_fsdp: bool = False):
    """frozen_fsdp: the layout of the frozen weights on `mesh` (the rollout's, which it shares)."""
    self.exp, self.mesh, self.prompts = exp, mesh, prompts
    c = exp.config
    self.n_per = c.eval.samples_per_prompt
    n_dev = mesh.devices.size
    self.batch = max(n_dev, (c.eval.batch_size // n_dev) * n_dev)
    # The rollout program itself, every step Euler: eval samples exactly as the rollout would
    # with the SDE off (same noise keys per sample: fold_in(eval key, sample index)).
    rep = mesh_lib.replicated(mesh)
    frozen = exp.weights.frozen(mesh, fsdp=frozen_fsdp, decode=True)
    self._sample = programs.make_rollout(
        exp,
        mesh,
        jax.tree.map(lambda _: rep, exp.params),
        with_offset=True,
        frozen=frozen,
        deterministic=True,
    )
    self._rep = rep
    self.shapes = _is_shapes(prompts)
    self._uncond = self._encode([c.sampler.negative_prompt] * self.batch)

  def _encode(self, prompts):
    cond = self.exp.conditioning(prompts)
    return jax.device_put(cond, programs.cond_shardings(self.mesh, cond))

  def __call__(self, params, seed: int = 0) -> dict[str, Any]:
    """Returns {'metrics': {...}, 'images', 'prompts', 'rewards', 'passed'} (numpy)."""
    all_prompts = [p for p in self.prompts for _ in range(self.n_per)]
    params = jax.device_put(params, mesh_lib.replicated(self.mesh))
    images = []
    key = jax.device_put(jax.random.key(seed), self._rep)
    step = jax.device_put(np.int32(0), self._rep)  # unused: every step is Euler
    for start in range(0, len(all_prompts), self.batch):
      chunk = all_prompts[start : start + self.batch]
      padded = chunk + [chunk[-1]] * (self.batch - len(chunk))
      offset = jax.device_put(np.int32(start), self._rep)
      out = self._sample(params, self._encode(padded), self._uncond, key, step, offset)
      images.append(jax.device_get(out)[: len(chunk)])
    images = np.concatenate(images)
    rewards = np.asarray(self.exp.reward_fn(images, all_prompts), np.float32)
    metrics = {
        'eval/reward_mean': float(rewards.mean()),
        'eval/num_prompts': len(self.prompts),
        'eval/samples_per_prompt': self.n_per,
    }
    passed = None
    if self.shapes:
      checked = shapes_checker.check_all(images, all_prompts)
      passed = np.array([r.strict for r in checked], bool)
      metrics['eval/strict_accuracy'] = float(passed.mean())
      metrics.update(
          {f'eval/atom_{kind}': rate for kind, rate in shapes_checker.atom_rates(checked).items()}
      )
      # A second scoring path that shares none of the reward's margin code (plain thresholds):
      # a policy that games the smoothed reward shows up as a gap between the two accuracies.
      hard = shapes_checker.strict_atoms_all(images, all_prompts)
      metrics['eval/strict_accuracy_hard'] = float(np.mean([all(h.values()) for h in hard]))
    return {
        'metrics': metrics,
        'images': images,
        'prompts': all_prompts,
        'rewards': rewards,
        'passed': passed,
    }


def write_report(result: dict[str, Any], out_dir: str, step: int, *, grid_prompts: int = 16) -> str:
  """eval_<step>.json (metrics + per-prompt pass rates) and eval_<step>.png (a sample grid with
  ✓/✗ marks and prompts). Returns the PNG path."""
  os.makedirs(out_dir, exist_ok=True)
  prompts, rewards, passed = result['prompts'], result['rewards'], result['passed']
  per_prompt: dict[str, dict[str, float]] = {}
  for i, p in enumerate(prompts):
    d = per_prompt.setdefault(p, {'reward_sum': 0.0, 'passed': 0, 'n': 0})
    d['reward_sum'] += float(rewards[i])
    d['passed'] += int(passed[i]) if passed is not None else 0
    d['n'] += 1
  report = {
      'step': step,
      **result['metrics'],
      'per_prompt': {
          p: {
              'reward_mean': d['reward_sum'] / d['n'],
              **({'pass_rate': d['passed'] / d['n']} if passed is not None else {}),
          }
          for p, d in per_prompt.items()
      },
  }
  with open(os.path.join(out_dir, f'eval_{step:06d}.json'), 'w') as f:
    json.dump(report, f, indent=1)
  # Grid: the first samples of the first `grid_prompts` prompts.
  n_per = result['metrics']['eval/samples_per_prompt']
  idx = [i for i in range(len(prompts)) if i // n_per < grid_prompts]
  caps = [
      ('PASS ' if passed is not None and passed[i] else 'FAIL ' if passed is not None else '')
      + f'{prompts[i]} r={rewards[i]:.2f}'
      for i in idx
  ]
  grid = visualize.image_grid(
      result['images'][idx],
      caps,
      cols=n_per,
      passed=None if passed is None else [bool(passed[i]) for i in idx],
  )
  path = os.path.join(out_dir, f'eval_{step:06d}.png')
  Image.fromarray(grid).save(path)
  # Every sample as uint8, for the end-of-run before/after grid (same prompts and noise at every
  # eval, so sample i of two evals is the same prompt and seed under two policies).
  np.savez_compressed(
      os.path.join(out_dir, f'eval_{step:06d}.npz'),
      images=visualize.to_uint8(result['images']),
      prompts=np.asarray(prompts),
      passed=(np.zeros(len(prompts), bool) if passed is None else passed),
      rewards=rewards,
  )
  return path


def before_after_grid(
    first_npz: str,
    last_npz: str,
    out_path: str,
    *,
    num_prompts: int = 12,
    samples: int = 2,
    labels=('base', 'final'),
) -> str:
  """A PNG with one row per prompt: `samples` eval samples of the first report, then the same
  prompts and noise from the last report, with PASS/FAIL frames. Prompts are picked evenly over
  the eval split (so single-object and relation prompts both show). Returns out_path."""
  a, b = np.load(first_npz), np.load(last_npz)
  if list(a['prompts']) != list(b['prompts']):
    raise ValueError(f'{first_npz} and {last_npz} were evaluated on different prompts')
  prompts = list(a['prompts'])
  uniq = list(dict.fromkeys(prompts))
  n_per = len(prompts) // len(uniq)
  samples = min(samples, n_per)
  picks = [uniq[i] for i in np.linspace(0, len(uniq) - 1, min(num_prompts, len(uniq))).astype(int)]
  images, caps, passed = [], [], []
  for p in picks:
    first = prompts.index(p)
    for src, label in ((a, labels[0]), (b, labels[1])):
      for k in range(samples):
        i = first + k
        images.append(src['images'][i].astype(np.float32) / 127.5 - 1.0)
        passed.append(bool(src['passed'][i]))
        caps.append(f'{label}: {p}' if k == 0 else f'{label}')
  grid = visualize.image_grid(np.stack(images), caps, cols=2 * samples, passed=passed)
  os.makedirs(os.path.dirname(out_path) or '.', exist_ok=True)
  Image.fromarray(grid).save(out_path)
  return out_path
