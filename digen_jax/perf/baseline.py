"""The colocated baseline: what a real colocated RL system pays for one step, term by term.

A synchronous colocated system (veRL-Omni's hybrid engine, the config's `baseline` section)
runs every part of a step on all the devices, one after another:

  rollout         the batch sampled by its generation engine, at that engine's calibrated
                  sampling fraction of peak (perf/calibrations.py: diffusers eager for 'torch')
  reward          scoring on the same devices (RunModel.reward_seconds: the config's stated
                  cost per sample; 0 for host rewards)
  behaviour_pass  a forward over the trained steps for the old log-probs before the update
                  (veRL's old_log_prob phase), at the engine's forward-only fraction (for
                  'torch' veRL-Omni's own timing of that phase, verl-omni#124)
  train           forward + backward with checkpointing of every sample-step, at the engine's
                  training fraction, micro-batch by micro-batch; each micro-step's FSDP
                  collectives (train_comm_seconds: hybrid sharding in groups of
                  baseline.fsdp_size, one node's by default as veRL-Omni's multi-node guide
                  sets it) overlap its compute (FSDP's prefetch): the slower of the two
  apply           the optimizer step, once per mini-batch (baseline.mini_batches)
  offload         FSDP params and/or optimizer state to host memory while it samples and back
                  (baseline.param_offload / optimizer_offload), over the host link
  engine_sleep    the generation engine's weight copy to host memory while it trains and back
                  (vLLM sleep level 1, which veRL-Omni's hybrid engine always uses so the text
                  encoder and VAE survive the sleep), over the host link
  layered_sync    the new weights gathered into the engine's copy, layer by layer, every step;
                  for LoRA the adapters only (its steady-state fast path)

term_sources says, per term, which figure or page each comes from.

TERMS names the switchable ones; a term switched off costs 0 (and 'engine' off runs our own
calibrated programs instead of the recipe's engine). Our own colocated mode is the planner's
'colocated' candidate (perf/search.py); this module prices the other systems' colocated step.
"""

from __future__ import annotations

import dataclasses
import math

from digen_jax.perf import calibrations
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import timing

TERMS = ('engine', 'reward', 'behaviour_pass', 'offload', 'engine_sleep', 'layered_sync')
RESHARD = ('auto', 'yes', 'no')

# Where veRL-Omni's behaviour comes from (verl-project/verl-omni at a1139baf unless a page says
# otherwise); each term's `source` in a plan names these.
_GUIDE = 'verl-project/verl-omni docs/start/multi_node_training.md (2026-06-15), section 4'
_WORKERS = 'verl-omni verl_omni/workers/engine_workers.py update_weights'
_SLEEP = 'verl-omni verl_omni/workers/rollout/vllm_rollout/vllm_omni_async_server.py _sleep_hybrid'


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
  fsdp_size: int = 0  # devices an FSDP shard group spans; 0: one node's (the guide's)
  reshard_after_forward: str = 'auto'  # RESHARD; 'auto': as veRL-Omni's docs set it (below)
  adapter_only_sync: bool = True  # LoRA: only the adapters reach the engine each step

  def shard_group(self, n: int, devices_per_node: int) -> int:
    """Devices one FSDP shard group spans on n devices (a divisor of n)."""
    size = min(n, self.fsdp_size or devices_per_node)
    while n % size:
      size -= 1
    return size

  def reshards(self, n: int, devices_per_node: int) -> bool:
    """Whether the backward gathers the weights again: 'auto' is no across nodes (the multi-node
    guide sets reshard_after_forward=False) and yes on one node (its single-node scripts keep
    FSDP's default)."""
    if self.reshard_after_forward == 'auto':
      return n <= devices_per_node
    return self.reshard_after_forward == 'yes'


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


def train_comm_seconds(run: rm.RunModel, group: roles.Group, knobs: rm.Knobs, recipe: Recipe):
  """FSDP collectives of one micro-step (hybrid sharding): within each shard group, the weights'
  all-gathers (one, or two when the backward reshards) and the gradient's reduce-scatter; across
  the groups, the all-reduce of each shard's gradient. Over the slowest kind's links: the
  intra-node one inside a node, the NIC when a group spans nodes or kinds."""
  n, per_node = group.n, knobs.devices_per_node
  shard = recipe.shard_group(n, per_node)
  gathers = 2 if recipe.reshards(n, per_node) else 1
  within = max(
      timing.fsdp_seconds(
          run.gathered_bytes,
          run.trainable_bytes,
          shard,
          a,
          gathers=gathers,
          devices_per_node=group.per_node(per_node),
          eff=knobs.eff,
      )
      for a in group.kinds
  )
  replicas = n // shard
  across = 0.0
  if replicas > 1:
    across = max(
        2
        * (replicas - 1)
        / replicas
        * run.trainable_bytes
        / shard
        / (a.inter_node_bw * knobs.eff.link)
        for a in group.kinds
    )
  return within + across


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
    behaviour = k.seconds(group, run.rollout, per_device * run.K * forward, 0.0, 'forward_only')
  grad = run.grads[True] if True in run.grads else next(iter(run.grads.values()))
  per_mini = math.ceil(per_device / recipe.mini_batches)
  micro = min(recipe.micro_batch, per_mini)
  micro_steps = recipe.mini_batches * math.ceil(per_mini / micro) * run.K
  # The engine's own LoRA (PEFT, engine != ours) trains A and B directly: no full dW.
  peft = run.lora_weight_grad_flops if k.engine != 'digen_jax' else 0.0
  per_unit = grad.per_unit - peft / grad.matmul_share
  compute = k.seconds(group, grad, micro * per_unit, 0.0)
  comm = train_comm_seconds(run, group, knobs, recipe)
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
    synced = run.gathered_bytes
    if run.finetune == 'lora' and recipe.adapter_only_sync:
      synced = run.trainable_bytes
    out['layered_sync'] = group.gather_seconds(synced, knobs.devices_per_node, knobs.eff)
  out['total'] = sum(out.values())
  return out


def term_sources(
    run: rm.RunModel,
    group: roles.Group,
    knobs: rm.Knobs,
    recipe: Recipe,
    terms: frozenset[str] = frozenset(TERMS),
) -> dict[str, str]:
  """Where each of step_seconds' terms comes from, in words (a plan's `source` per term)."""
  engine = recipe.engine if 'engine' in terms else knobs.engine
  kind = group.kinds[0]

  def frac(work: str) -> str:
    if engine == 'uniform':
      return f'{knobs.eff.mfu:.0%} of peak (assumed)'
    value = calibrations.calibration(engine, kind).of(work)
    return f'{engine} {work} {value:.3f} of peak (perf/calibrations.py)'

  n, per_node = group.n, knobs.devices_per_node
  shard = recipe.shard_group(n, per_node)
  off = lambda t: t not in terms
  return {
      'rollout': f'the batch at {frac("sampling")}',
      'reward': 'off'
      if off('reward')
      else (
          f'config.reward.device_s_per_sample {run.reward_device_s:g} device-s a sample'
          + (f' ({run.reward_accelerator})' if run.reward_accelerator else '')
      ),
      'behaviour_pass': 'off'
      if off('behaviour_pass') or not recipe.behaviour_pass
      else (f'a forward over the K trained steps at {frac("forward_only")} (veRL old_log_prob)'),
      'train': (
          f'{recipe.mini_batches} mini-batches of micro-batches of {recipe.micro_batch} a device, '
          f'forward + backward at {frac("training")}; FSDP in groups of {shard} (fsdp_size, '
          f'{_GUIDE}), {"two gathers" if recipe.reshards(n, per_node) else "one gather"} a '
          f'micro-step (reshard_after_forward {recipe.reshard_after_forward}), '
          f'{n // shard}-way gradient all-reduce across groups; the slower of compute and comm'
      ),
      'apply': f'the optimizer step once a mini-batch ({recipe.mini_batches}) at {frac("training")}',
      'offload': 'off'
      if off('offload')
      else (
          f'params {"offloaded" if recipe.param_offload else "kept"}, optimizer state '
          f'{"offloaded" if recipe.optimizer_offload else "kept"} while it samples: out and '
          'back over the host link once a step'
      ),
      'engine_sleep': 'off'
      if off('engine_sleep') or not recipe.engine_sleep
      else (f"the engine's weights to host and back, sleep level 1 ({_SLEEP})"),
      'layered_sync': 'off'
      if off('layered_sync') or not recipe.layered_sync
      else (
          ('the adapters only (LoRA fast path, ' + _WORKERS + ')')
          if run.finetune == 'lora' and recipe.adapter_only_sync
          else f'every weight gathered into the engine each step ({_WORKERS})'
      ),
  }


def samples_per_s(
    run: rm.RunModel,
    group: roles.Group,
    knobs: rm.Knobs,
    recipe: Recipe,
    terms: frozenset[str] = frozenset(TERMS),
) -> float:
  return run.batch / step_seconds(run, group, knobs, recipe, terms)['total']
