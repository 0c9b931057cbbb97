"""The colocated baseline: what a real colocated RL system pays for one step, term by term.

A synchronous colocated system (veRL-Omni's hybrid engine, the config's `baseline` section)
runs every part of a step on all the devices, one after another:

  rollout         the batch sampled by its generation engine, at that engine's calibrated
                  sampling fraction of peak (hardware.calibration: diffusers eager for 'torch')
  reward          scoring on the same devices (RunModel.reward_seconds: the config's stated
                  cost per sample; 0 for host rewards)
  behaviour_pass  a forward over the trained steps for the old log-probs before the update
                  (veRL's old_log_prob phase), at the sampling fraction
  train           forward + backward with checkpointing of every sample-step, at the engine's
                  training fraction, micro-batch by micro-batch; each micro-step's FSDP
                  all-gathers (forward and backward) and gradient reduce-scatter overlap its
                  compute (FSDP's prefetch): the slower of the two
  apply           the optimizer step, once per mini-batch (baseline.mini_batches)
  offload         FSDP params and/or optimizer state to host memory while it samples and back
                  (baseline.param_offload / optimizer_offload), over the host link
  engine_sleep    the generation engine's weight copy to host memory while it trains and back
                  (vLLM sleep level 1: docs.vllm.ai "Sleep Mode"), over the host link
  layered_sync    the new weights gathered into the engine's copy, layer by layer, every step

TERMS names the switchable ones; a term switched off costs 0 (and 'engine' off runs our own
calibrated programs instead of the recipe's engine). Our own colocated mode is the planner's
'colocated' candidate (perf/search.py); this module prices the other systems' colocated step.
"""

from __future__ import annotations

import dataclasses
import math

from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm

TERMS = ('engine', 'reward', 'behaviour_pass', 'offload', 'engine_sleep', 'layered_sync')


@dataclasses.dataclass(frozen=True)
class Recipe:
  """config.baseline: how the compared colocated system runs (experiment/config.py)."""

  engine: str = 'torch'
  param_offload: bool = True
  optimizer_offload: bool = True
  engine_sleep: bool = True
  layered_sync: bool = True
  behaviour_pass: bool = True
  mini_batches: int = 2
  micro_batch: int = 16


def recipe_of(config) -> Recipe:
  b = config.baseline
  return Recipe(**{f.name: b[f.name] for f in dataclasses.fields(Recipe)})


def parse_terms(spec: str) -> frozenset[str]:
  """'all' | 'none' | a comma-separated subset of TERMS."""
  if spec == 'all':
    return frozenset(TERMS)
  if spec == 'none':
    return frozenset()
  terms = frozenset(t for t in spec.split(',') if t)
  bad = sorted(terms - set(TERMS))
  if bad:
    raise ValueError(f'colocated terms {bad} unknown; use all, none or a subset of {TERMS}')
  return terms


def _host_seconds(bytes_per_device: float, group: roles.Group, knobs: rm.Knobs) -> float:
  """Out to host memory and back over the slowest kind's host link."""
  return max(2 * bytes_per_device / (a.host_bw * knobs.eff.link) for a in group.kinds)


def step_seconds(
    run: rm.RunModel,
    group: roles.Group,
    knobs: rm.Knobs,
    recipe: Recipe,
    terms: frozenset[str] = frozenset(TERMS),
) -> dict[str, float]:
  """Seconds of each part of one colocated step of `run` on `group` (module docstring), with
  'total' their sum: nothing overlaps in a synchronous colocated step."""
  n, batch = group.n, run.batch
  k = dataclasses.replace(knobs, engine=recipe.engine) if 'engine' in terms else knobs
  rollout = min(
      rm.rollout_options(run, group, batch, k, layouts=('replicated',)), key=lambda o: o.seconds
  ).seconds
  per_device = math.ceil(batch / n)
  forward = run.rollout.per_unit / run.T  # one sample's forward, all its CFG rows
  behaviour = 0.0
  if 'behaviour_pass' in terms and recipe.behaviour_pass:
    behaviour = k.seconds(group, run.rollout, per_device * run.K * forward, 0.0)
  grad = run.grads[True] if True in run.grads else next(iter(run.grads.values()))
  per_mini = math.ceil(per_device / recipe.mini_batches)
  micro = min(recipe.micro_batch, per_mini)
  micro_steps = recipe.mini_batches * math.ceil(per_mini / micro) * run.K
  # The engine's own LoRA (PEFT, engine != ours) trains A and B directly: no full dW.
  peft = run.lora_weight_grad_flops if k.engine != 'digen_jax' else 0.0
  per_unit = grad.per_unit - peft / grad.matmul_share
  compute = k.seconds(group, grad, micro * per_unit, 0.0)
  comm = group.fsdp_seconds(
      run.gathered_bytes, run.trainable_bytes, 2, knobs.devices_per_node, knobs.eff
  )
  out = {
      'rollout': rollout,
      'reward': run.reward_seconds(batch, group) if 'reward' in terms else 0.0,
      'behaviour_pass': behaviour,
      'train': micro_steps * max(compute, comm),
      'apply': recipe.mini_batches * rm.apply_seconds(run, group, k),
      'offload': 0.0,
      'engine_sleep': 0.0,
      'layered_sync': 0.0,
  }
  if 'offload' in terms:
    held = (run.trainable_bytes + run.frozen_base_bytes) * recipe.param_offload
    held += run.optimizer_state_bytes * recipe.optimizer_offload
    out['offload'] = _host_seconds(held / n, group, knobs)
  if 'engine_sleep' in terms and recipe.engine_sleep:
    out['engine_sleep'] = _host_seconds(run.gathered_bytes, group, knobs)
  if 'layered_sync' in terms and recipe.layered_sync:
    out['layered_sync'] = group.gather_seconds(
        run.gathered_bytes, knobs.devices_per_node, knobs.eff
    )
  out['total'] = sum(out.values())
  return out


def samples_per_s(
    run: rm.RunModel,
    group: roles.Group,
    knobs: rm.Knobs,
    recipe: Recipe,
    terms: frozenset[str] = frozenset(TERMS),
) -> float:
  return run.batch / step_seconds(run, group, knobs, recipe, terms)['total']
