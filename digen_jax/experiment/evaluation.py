"""Evaluation: deterministic ODE sampling of N samples per eval prompt, scored by the reward and
by the eval metrics of the task the prompts belong to, if a task registered any
(rewards/eval_metrics.py: ShapesBench's strict checker); outputs/eval_report.py writes the report.

Used by `python -m digen_jax.eval` and periodically inside training."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from digen_jax import programs
from digen_jax.data import prompts as prompt_data
from digen_jax.rewards import eval_metrics
from digen_jax.parallel import mesh as mesh_lib


def eval_prompts(exp, workdir: str) -> list[str]:
  """The eval split's prompts (all of them, or the first eval.num_prompts)."""
  e = exp.eval
  data_dir = prompt_data.resolve_data_dir(e.data_dir, workdir)
  source = prompt_data.load_prompts(e.prompts, e.split, data_dir, e.max_prompt_chars)
  n = len(source) if e.num_prompts <= 0 else min(e.num_prompts, len(source))
  return list(source[:n])


class Evaluator:
  """Compiles the ODE sampler once for `mesh` and evaluates any params on the eval prompts."""

  def __init__(self, exp, mesh, prompts: list[str], *, frozen_fsdp: bool = False):
    """frozen_fsdp: the layout of the frozen weights on `mesh` (the rollout's, which it shares)."""
    self.exp, self.mesh, self.prompts = exp, mesh, prompts
    self.n_per = exp.eval.samples_per_prompt
    n_dev = mesh.devices.size
    self.batch = max(n_dev, (exp.eval.batch_size // n_dev) * n_dev)
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
    self.task_metrics = eval_metrics.for_prompts(prompts)
    self._uncond = self._encode([exp.sampler.negative_prompt] * self.batch)

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
        'eval/reward_mean': float(np.nanmean(rewards)) if np.isfinite(rewards).any() else 0.0,
        'eval/reward_failed': int(np.sum(~np.isfinite(rewards))),
        'eval/num_prompts': len(self.prompts),
        'eval/samples_per_prompt': self.n_per,
    }
    passed = None
    if self.task_metrics is not None:
      passed = self.task_metrics.score(images, all_prompts, metrics)
    return {
        'metrics': metrics,
        'images': images,
        'prompts': all_prompts,
        'rewards': rewards,
        'passed': passed,
    }
