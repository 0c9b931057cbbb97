"""A run's cost model (perf/runmodel.RunModel) from the costs cache (perf/cache.py: XLA's figures
of the config's compiled programs): FLOPs from the entry that counts every loop iteration, temp
memory from the raw compiles at one and two per-device batches (XLA:CPU's 'no_hoist' pipeline
where the cache holds it), and per sequence split the memory of the programs compiled at it.
"""

from __future__ import annotations

import dataclasses
import os

from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm


def _pipeline(entry) -> str:
  return entry.costs.settings.get('xla_pipeline', 'default')


def memory_entries(entries: list, devices: int) -> list:
  """The memory points (method 'raw') on `devices` devices the model reads: those of XLA:CPU's
  'no_hoist' pipeline where the cache holds them (no f32 copy of whole bf16 weight and residual
  stacks: closer to an accelerator, perf/program_costs.PIPELINES), else the default's."""
  raw = [e for e in entries if e.key.method == 'raw' and e.key.devices == devices]
  return [e for e in raw if _pipeline(e) == 'no_hoist'] or raw


def memory_model(points: list, name: str, remat=None, loop: str = '', trained_steps=1, tsp=False):
  """The ProgramModel of program `name` from memory points (perf/cache.Entry, method 'raw'; a
  grad of `remat` and step loop `loop`, '' or 'scan'), or None when none holds it. A grad's
  batch is its real samples' rows (fragment_samples); a scan's unit is one step of a sample
  (its temp holds what the K steps keep)."""
  same = [
      dataclasses.replace(
          e.costs.programs[name],
          batch=e.costs.settings.get('fragment_samples') or e.costs.programs[name].batch,
      )
      if name == 'grad'
      else e.costs.programs[name]
      for e in points
      if name in e.costs.programs
      and (remat is None or e.costs.settings['remat'] == remat)
      and (name != 'grad' or e.key.step_loop == loop)
  ]
  if not same:
    return None
  kw = {'trained_steps': trained_steps if not loop else 1, 'tsp': tsp} if name == 'grad' else {}
  return roles.program_model(same[0], memory_points=tuple(same[1:]), **kw)


def scan_models(points: list) -> dict:
  """By remat, the scans over K the memory points hold (rl.step_loop 'scan' compiles)."""
  return {r: g for r in (True, False) if (g := memory_model(points, 'grad', r, 'scan'))}


def split_memory_of(entries: list, trained_steps: int, tsp: bool, source: str) -> rm.SplitMemory:
  """SplitMemory from a split's cached memory points (perf/cache.Entry, method 'raw')."""
  devices = max(
      {e.key.devices for e in entries}, key=lambda d: [e.key.devices for e in entries].count(d)
  )
  points = memory_entries(entries, devices)
  rollout = memory_model(points, 'rollout')
  if rollout is None:
    raise ValueError(f'{source}: no cached rollout program')
  grads = {
      r: g
      for r in (True, False)
      if (g := memory_model(points, 'grad', r, '', trained_steps, tsp)) is not None
  }
  files = ', '.join(os.path.basename(e.path) for e in entries)
  return rm.SplitMemory(rollout, grads, scan_models(points), f'{source} ({files})')


def _programs(main, counted: list, points: list, own: bool, upcast: float, K: int, tsp: bool):
  """(the rollout's ProgramModel, the grads' by remat) from the counted entries' FLOPs and the
  memory points' temp memory (own: the counted entries' own memory too)."""
  rollout = roles.program_model(
      main.costs.programs['rollout'],
      memory_points=tuple(p.programs['rollout'] for p in points if 'rollout' in p.programs),
      upcast_bytes=upcast,
      own_memory=own,
  )
  grads = {}
  for e in sorted(counted, key=lambda e: e is not main):
    g = e.costs.programs.get('grad')
    if g is None or e.key.remat in grads or e.costs.settings['tsp'] != tsp:
      continue
    same = tuple(
        p.programs['grad']
        for p in points
        if 'grad' in p.programs and p.settings['remat'] == e.key.remat
    )
    grads[e.key.remat] = roles.program_model(
        g, trained_steps=K, tsp=tsp, memory_points=same, own_memory=own or not same
    )
  return rollout, grads


def _all_to_all_bytes(config, costs) -> float:
  """One forward of one sample's Ulysses all-to-alls: q, k, v and the output, each a [tokens,
  width] operand of every self-attention layer (MMDiT and FLUX attend over [text, image]
  jointly, Wan's text is cross-attention), every CFG row, in the compute dtype."""
  m, s = config.model, costs.settings
  layers = int(m.num_layers) + (int(m.num_single_layers) if m.family == 'flux' else 0)
  attended = int(s['image_tokens']) + (0 if m.family == 'wan' else int(s.get('text_tokens', 0)))
  width = int(m.num_attention_heads) * int(m.attention_head_dim)
  cfg_rows = int(costs.programs['grad'].trip_counts.get('cfg_branches', 1))
  return 4.0 * layers * attended * width * (2 if s['compute_dtype'] == 'bfloat16' else 4) * cfg_rows


def from_cache(
    name: str,
    config,
    entries: list,
    *,
    split_entries: dict[int, list] | None = None,
    notes: list[str] | None = None,
) -> rm.RunModel:
  """A RunModel from cached entries (perf/cache.Entry) of one config and fine-tuning: the entry
  with all three programs (the config's remat preferred), grads of other remat settings, and
  memory points (method 'raw' at other batches on the same device count; memory_entries).
  split_entries: by config.parallel.sequence > 1, the memory points compiled at that split."""
  counted = [e for e in entries if e.key.method != 'raw']
  full = [e for e in counted if set(e.costs.programs) >= {'rollout', 'grad', 'apply'}]
  if not full:
    raise ValueError(f'{name}: no cached entry holds the rollout, grad and apply programs')
  remat0 = bool(config.model.remat)
  main = sorted(full, key=lambda e: (e.key.remat != remat0, e.key.devices != 16))[0]
  c = main.costs
  s = c.settings
  memory = memory_entries(entries, c.devices)
  point_entries = [e for e in memory if not e.key.step_loop]
  no_hoist = bool(point_entries) and _pipeline(point_entries[0]) == 'no_hoist'
  # XLA:CPU's f32 copy of every bf16 weight the replicated rollout reads (roles docstring);
  # 'no_hoist' keeps it per layer.
  bf16 = s['compute_dtype'] == 'bfloat16'
  upcast = 2 * c.gathered_bytes if bf16 and s['rollout_layout'] == 'replicated' else 0
  T, K, tsp = int(s['num_steps']), int(s['trained_steps']), bool(s['tsp'])
  rollout, grads = _programs(
      main,
      counted,
      [e.costs for e in point_entries],
      # The counted entries' own memory only under the points' pipeline (else the points').
      not point_entries or _pipeline(point_entries[0]) == _pipeline(main),
      0 if no_hoist else upcast,
      K,
      tsp,
  )
  m = config.model
  lora = s['finetune'] == 'lora'
  # The copy the rollout samples with, in the dtype the config publishes (the cached compile
  # may have used another): float32 trainable bytes, halved for a bf16 copy of full weights.
  bf16_copy = not lora and config.cluster.rollout.param_dtype == 'bfloat16'
  published = c.trainable_bytes // 2 if bf16_copy else c.trainable_bytes
  return rm.RunModel(
      name=name,
      source='xla',
      prompts=int(config.rl.prompts_per_step),
      group_size=int(config.rl.group_size),
      T=T,
      K=K,
      image_tokens=int(s['image_tokens']),
      latent_channels=int(m.in_channels),
      layers=int(m.num_layers) + (int(m.num_single_layers) if m.family == 'flux' else 0),
      trainable_bytes=c.trainable_bytes,
      optimizer_state_bytes=c.optimizer_state_bytes,
      frozen_base_bytes=c.frozen_base_bytes,
      published_bytes=published,
      rollout_param_bytes=published + c.frozen_base_bytes,
      gathered_bytes=c.gathered_bytes,
      rollout=rollout,
      grads=grads,
      apply=roles.program_model(c.programs['apply']),
      ref_bytes=c.trainable_bytes if config.rl.kl_beta > 0 and not lora else 0,
      clean_samples=config.rl.get('algorithm', 'grpo') != 'grpo',
      finetune=s['finetune'],
      tcss_fraction=float(config.schedule.tcss_fraction),
      scans=scan_models(memory),
      heads=int(m.num_attention_heads),
      split_memory={
          q: split_memory_of(es, K, tsp, f'{name} at config.parallel.sequence={q}')
          for q, es in sorted((split_entries or {}).items())
          if q > 1 and es
      },
      sequence_bytes=_all_to_all_bytes(config, c),
      notes=list(notes or []),
      **rm.reward_terms(config),
  )
