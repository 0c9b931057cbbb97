"""Sequence splits in the planner (config.parallel.sequence: each sample's tokens over q devices
of each role): the config at a split, the memory of the programs compiled at each split (from
the costs cache, or compiled and stored), and the search over splits, smallest first.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Callable

from digen_jax.perf import cache
from digen_jax.perf import cached_run
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search

PlanError = search.PlanError


def at_split(config, overrides: list[str], q: int):
  """(config, overrides) with config.parallel.sequence = q (the overrides say so for q > 1)."""
  config = copy.deepcopy(config)
  config.parallel.sequence = q
  kept = [o for o in overrides if not o.lstrip('-').startswith('config.parallel.sequence=')]
  return config, kept + ([f'--config.parallel.sequence={q}'] if q > 1 else [])


def split_computer(
    config_arg: str,
    config,
    overrides: list[str],
    run: rm.RunModel,
    *,
    directory: str = cache.COSTS_DIR,
    log=None,
) -> Callable[[int], rm.SplitMemory]:
  """A function of a split q that returns the SplitMemory of the config's programs compiled at
  config.parallel.sequence = q (method 'raw', XLA:CPU's 'no_hoist' pipeline), compiling and
  storing in the cache the ones it lacks: the rollout at one and two samples a device (it lays
  rows out in multiples of the devices), the gradient (its K steps as a vmap and as a scan) at
  one and two samples a row of q devices, the per-device work the split exists for."""
  path, variant = cache.split_config_arg(config_arg)
  finetune, rank = cache.finetuning(config)
  n0 = run.rollout.n0

  def compute(q: int) -> rm.SplitMemory:
    split_config, split_overrides = at_split(config, overrides, q)
    digest = cache.config_digest(split_config)
    devices = n0 * q // math.gcd(n0, q)
    entries = []
    for rows, loop in ((1, ''), (2, ''), (1, 'scan'), (2, 'scan')):
      key = cache.Key(
          path,
          variant,
          cache.program_overrides(split_overrides),
          finetune,
          rank,
          bool(config.model.remat),
          devices,
          rows * devices,
          devices,
          'raw',
          ('grad',) if loop else ('rollout', 'grad'),
          'no_hoist',
          rows * devices // q,
          loop,
      )
      stored = os.path.join(directory, key.filename())
      if os.path.exists(stored) and (entry := cache.load(stored)).digest == digest:
        entries.append(entry)
        continue
      try:
        entries.append(
            cache.compute(
                key,
                split_overrides,
                digest,
                directory=directory,
                **({} if log is None else {'log': log}),
            )
        )
      except RuntimeError as e:
        raise PlanError(f'{config_arg} at config.parallel.sequence={q}: {e}') from None
    return cached_run.split_memory_of(
        entries, run.K, False, f'{config_arg} at config.parallel.sequence={q}'
    )

  return compute


def cached_entries(path: str, config, directory: str = cache.COSTS_DIR) -> dict[int, list]:
  """By split q > 1 (dividing the model's heads), the cached memory compiles of `config` (at
  split 1) at q, where the cache holds the scan's too (else split_computer completes them)."""
  finetune, rank = cache.finetuning(config)
  heads = int(config.model.num_attention_heads)
  out = {}
  for q in range(2, heads + 1):
    if heads % q:
      continue
    digest = cache.config_digest(at_split(config, [], q)[0])
    raw = [
        e for e in cache.matching(path, digest, finetune, rank, directory) if e.key.method == 'raw'
    ]
    if any(e.key.step_loop == 'scan' for e in raw):
      out[q] = raw
  return out


def search_splits(run: rm.RunModel, parts, knobs: rm.Knobs, split_memory, **planner_kw):
  """(run at its split, the search.Planner, its search result); planner_kw: search.Planner's.
  A split (config.parallel.sequence > 1) buys memory with all-to-alls, so with run.sequence = 1
  the splits are tried smallest first and the first under which any mode fits is kept; a next
  one only while the trainer's state fits and no mode does (no split helps otherwise). A split
  the run sets (the config's) is planned alone; split_memory (split_computer) compiles a
  split's memory the run lacks, None: only the cached splits are tried."""
  devices = sum(p.count for p in parts)
  fixed = run.sequence > 1
  # Tried: splits within a node (each attention layer's all-to-alls would cross the NICs).
  splits = (
      [run.sequence]
      if fixed
      else [q for q in run.sequence_splits(devices) if q <= knobs.devices_per_node]
  )
  if fixed:
    q = run.sequence
    if not run.heads:
      raise PlanError(
          f'config.parallel.sequence={q}: --costs=analytic does not model a sequence split; '
          'plan it from the compiled programs (the default --costs=xla)'
      )
    if devices % q or run.heads % q:
      raise PlanError(
          f'config.parallel.sequence={q} must divide the {devices} devices of the cluster and '
          f"the model's {run.heads} heads"
      )
    if q not in run.split_memory and split_memory is None:
      raise PlanError(
          f'config.parallel.sequence={q}: the costs cache holds no programs compiled at that '
          'split; python -m digen_jax.plan compiles them'
      )
  tried = []
  for q in splits:
    if q > 1 and q not in run.split_memory:
      if split_memory is None:
        continue
      run.split_memory[q] = split_memory(q)
    trial = dataclasses.replace(run, sequence=q, notes=list(run.notes))
    planner = search.Planner(trial, parts, knobs, **planner_kw)
    found = planner.search()
    tried.append(q)
    if any(c is not None for c in found['modes'].values()) or not rm.trainer_fits(
        trial, roles.Group(parts), knobs
    ):
      break
  if trial.sequence > 1:
    how = (
        'the config'
        if fixed
        else 'the smallest split under which a mode fits; tried ' + ', '.join(map(str, tried))
    )
    trial.notes.append(
        f"config.parallel.sequence={trial.sequence}: each sample's tokens over "
        f'{trial.sequence} devices of each role ({how}); its temp memory from '
        f"{trial.split_memory[trial.sequence].source}'s compiled programs, its FLOPs split "
        "1's over the split, plus the all-to-alls over the split's link"
    )
  return trial, planner, found
