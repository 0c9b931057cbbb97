"""A config's run model for the planner: from the costs cache (computing a missing entry by
compiling the programs in a child process), or analytic; its architecture read from the model
folder as main reads it, and said in the plan's notes."""

from __future__ import annotations

import dataclasses

from digen_jax.experiment import folder_config
from digen_jax.perf import analytic
from digen_jax.perf import cache
from digen_jax.perf import cached_run
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search
from digen_jax.perf import splits

PlanError = search.PlanError


def default_cost_devices(batch: int, fragment: int) -> int:
  """16, or the largest power of two dividing both batches."""
  for d in (16, 8, 4, 2, 1):
    if batch % d == 0 and fragment % d == 0:
      return d
  return 1


def run_model(
    config_arg: str,
    config,
    overrides: list[str],
    settings,
    *,
    directory: str = cache.COSTS_DIR,
    log=None,
) -> rm.RunModel:
  """The RunModel of a config from the costs cache; a missing entry is computed (compiling the
  programs in a child process) and stored, with a memory point (perf/cache.py). settings: the
  planner's Settings (costs, recompute, cost_devices)."""
  path, _ = cache.split_config_arg(config_arg)
  if 'pretrain' in config:
    raise PlanError(
        f'{config_arg} is a pretraining config (python -m digen_jax.tasks.shapes.pretrain); the '
        'planner plans GRPO runs: give an RL config, e.g. configs/shapes.py'
    )
  r = config.rl
  if r.prompts_per_step < 1 or r.group_size < 1:
    raise PlanError(
        f'config.rl.prompts_per_step={r.prompts_per_step} and group_size='
        f'{r.group_size} must be >= 1'
    )
  planned = planned_model(config, overrides)
  if settings.costs == 'analytic':
    try:
      run = analytic.run_model_of(config, config_arg)
    except ValueError as e:
      raise PlanError(f'{config_arg}: {e}') from None
    run.notes.append(planned)
    return run
  finetune, rank = cache.finetuning(config)
  # The FLOPs are split 1's (a split's are those over q): the programs of config.parallel.
  # sequence = 1; a split's memory comes from its own compiles (split_entries).
  config, overrides = splits.at_split(config, overrides, 1)
  digest = cache.config_digest(config)
  found = [] if settings.recompute else cache.matching(path, digest, finetune, rank, directory)
  notes = []
  main = [
      e
      for e in found
      if e.key.method != 'raw' and set(e.key.programs) >= {'rollout', 'grad', 'apply'}
  ]
  if not main:
    found = _compute_entries(config_arg, config, overrides, settings, found, notes, directory, log)
  split_entries = {} if settings.recompute else splits.cached_entries(path, config, directory)
  sources = [cache.describe(e) for e in found]
  try:
    run = cached_run.from_cache(config_arg, config, found, split_entries=split_entries, notes=notes)
  except ValueError as e:
    raise PlanError(f'{config_arg}: {e}') from None
  run.notes.append('costs: ' + '; '.join(sources))
  run.notes.append(planned)
  return run


def planned_model(config, overrides: list[str]) -> str:
  """Reads config's architecture from its pipeline folder as main does (folder_config.resolve:
  the sizes and the image size in pixels), in place; returns what is planned, in words."""
  try:
    folder_config.resolve(config, folder_config.explicit_fields(overrides))
  except ValueError as e:
    raise PlanError(str(e)) from None
  m, lat = config.model, config.latent
  path = folder_config.pipeline_folder(config)
  where = f'the folder {path}' if path else "the config's sizes (no model folder read)"
  frames = f'{lat.frames} x ' if lat.frames > 1 else ''
  return (
      f'planned {m.family} from {where}: {m.num_layers} layers, {m.num_attention_heads} heads x '
      f'{m.attention_head_dim}, latent {frames}{lat.height} x {lat.width}, text '
      f'{config.text.max_length} tokens'
  )


def _compute_entries(config_arg, config, overrides, settings, found, notes, directory, log):
  """Compiles the config's programs for the cache (an entry, a memory point and the scan's at
  it) and returns them with the memory points `found` already had."""
  path, variant = cache.split_config_arg(config_arg)
  r, m = config.rl, config.model
  finetune, rank = cache.finetuning(config)
  digest = cache.config_digest(config)
  batch, fragment = r.prompts_per_step * r.group_size, r.group_size
  if config.schedule.fragments > 1:
    fragment = batch // config.schedule.fragments
  old = [e for e in cache.stale(path, finetune, rank, directory) if e.digest != digest]
  if old and not settings.recompute:
    notes.append(
        f'the cache holds {len(old)} entries of {path} for other program settings '
        '(another variant/override, or the config changed since): computed anew'
    )
  n0 = settings.cost_devices or default_cost_devices(batch, fragment)
  if batch % n0 or fragment % n0:
    raise PlanError(
        f'--cost_devices={n0} must divide the batch {batch} and the fragment ' f'{fragment}'
    )
  key = cache.Key(
      path,
      variant,
      cache.program_overrides(overrides),
      finetune,
      rank,
      bool(m.remat),
      n0,
      batch,
      fragment,
      'extrapolate',
  )
  point = dataclasses.replace(
      key,
      rollout_batch=max(n0, batch // 4) if batch > n0 else 2 * batch,
      fragment_batch=2 * fragment,
      method='raw',
      programs=('rollout', 'grad'),
  )
  # The gradient's memory with the K steps as a scan too (what it keeps of every step).
  scan_point = dataclasses.replace(point, programs=('grad',), step_loop='scan')
  try:
    return [
        cache.compute(k, overrides, digest, directory=directory, **_log(log))
        for k in (key, point, scan_point)
    ] + [e for e in found if e.key.method == 'raw']
  except RuntimeError as e:
    raise PlanError(f'{config_arg}: {e}') from None


def trained_step_variants(run: rm.RunModel, values: list[str]) -> list[rm.RunModel]:
  """`run` with each K of `values` (--trained_steps; none: `run` itself). A K must be a
  whole number of the T - 1 trainable steps."""
  out = []
  for v in values:
    try:
      k = int(v)
    except ValueError:
      k = 0
    if not 1 <= k <= run.T - 1:
      raise PlanError(
          f'--trained_steps={",".join(values)}: {v!r} is not a step count in 1..{run.T - 1} '
          f'(T={run.T} sampler steps, the last one never trained)'
      )
    out.append(dataclasses.replace(run, K=k, notes=list(run.notes)))
  return out or [run]


def _log(log):
  return {} if log is None else {'log': log}
