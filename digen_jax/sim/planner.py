"""What python -m digen_jax.plan does, as functions: input validation, the run's cost model from
the costs cache (computing a missing entry), the search, the report and the files.

Every input error is a PlanError with one line saying what is wrong and what would fix it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from digen_jax.runtime import trace as trace_lib
from digen_jax.sim import cache
from digen_jax.sim import hardware
from digen_jax.sim import roles
from digen_jax.sim import runmodel as rm
from digen_jax.sim import search
from digen_jax.sim import timing

PlanError = search.PlanError
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Settings:
  roofline: str = 'compute'  # 'compute' | 'bytes'
  mfu: float = 0.0  # 0: the calibrated fractions (hardware.calibration); else one for all
  hbm_efficiency: float = 0.8
  link_efficiency: float = 0.8
  devices_per_node: int = 8
  memory_fraction: float = 0.9
  sharded_decode: bool = False
  steps: int = 6
  simulate_top: int = 6
  grid: int = 16
  tcss_fraction: float = 0.0
  recompute: bool = False
  cost_devices: int = 0
  pad: bool = False  # cost batches that do not divide a role's devices, padded
  trace_devices: int = 32  # up to this many devices the best candidates' traces hold
  # every device; above, one row per role

  def knobs(self) -> rm.Knobs:
    if self.mfu < 0:
      raise PlanError(f'--mfu={self.mfu} must be in (0, 1], or 0 for the calibrated fractions')
    try:
      eff = timing.Efficiency(
          mfu=self.mfu or timing.DEFAULT.mfu, hbm=self.hbm_efficiency, link=self.link_efficiency
      )
    except ValueError as e:
      raise PlanError(str(e)) from None
    return rm.Knobs(
        eff=eff,
        engine='uniform' if self.mfu else 'digen_jax',
        devices_per_node=self.devices_per_node,
        memory_fraction=self.memory_fraction,
        sharded_decode=self.sharded_decode,
        hbm=self.roofline == 'bytes',
    )


# ---------------------------------------------------------------------------------------------
# Input.


def validate(
    cluster: str, trainer: str | None, settings: Settings, *, accelerators: str | None = None
):
  """(cluster parts, fixed Split or None). Raises PlanError (one line) on bad input."""
  if accelerators:
    try:
      hardware.load_json(accelerators)
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as e:
      raise PlanError(f'--accelerators={accelerators}: {e}') from None
  try:
    parts = hardware.parse_cluster(cluster)
  except ValueError as e:
    raise PlanError(str(e)) from None
  settings.knobs()
  if not 0 < settings.memory_fraction <= 1:
    raise PlanError(f'--memory_fraction={settings.memory_fraction} must be in (0, 1]')
  if settings.steps < 2:
    raise PlanError(f'--steps={settings.steps}: need >= 2 (the first step fills the pipeline)')
  if not 0 <= settings.tcss_fraction <= 1:
    raise PlanError(f'--tcss_fraction={settings.tcss_fraction} must be in [0, 1]')
  total = sum(p.count for p in parts)
  if trainer is None:
    return parts, None
  return parts, fixed_split(parts, trainer, total, cluster)


def fixed_split(parts, trainer: str, total: int, cluster: str) -> search.Split:
  """The Split of --trainer (a count on a one-kind cluster, or COUNTxKIND parts)."""
  spec = trainer.strip()
  if spec.isdigit():
    if len({p.accelerator.name for p in parts}) > 1:
      raise PlanError(
          f'--trainer={spec}: a bare count is ambiguous on the mixed cluster '
          f'{cluster}; name the kinds, e.g. --trainer=8x{parts[0].accelerator.name}'
      )
    spec = f'{spec}x{parts[0].accelerator.name}'
    if int(trainer) == 0:
      raise PlanError(f'--trainer=0 leaves the trainer 0 devices; give it 1 to {total - 1}')
  try:
    want = hardware.parse_cluster(spec)
  except ValueError as e:
    raise PlanError(f'--trainer: {e}') from None
  have = {}
  for p in parts:
    have[p.accelerator.name] = have.get(p.accelerator.name, 0) + p.count
  taken = {}
  for p in want:
    taken[p.accelerator.name] = taken.get(p.accelerator.name, 0) + p.count
  for name, n in taken.items():
    if n > have.get(name, 0):
      raise PlanError(
          f'--trainer={trainer} asks for {n}x{name} but the cluster {cluster} has '
          f'{have.get(name, 0)}'
      )
  if sum(taken.values()) >= total:
    raise PlanError(
        f'--trainer={trainer} takes all {total} devices of {cluster} and leaves the '
        'rollout 0; leave it at least 1 (or plan colocated only: omit --trainer)'
    )
  t = tuple(hardware.ClusterPart(n, hardware.get(k)) for k, n in taken.items())
  r = tuple(
      hardware.ClusterPart(have[k] - taken.get(k, 0), hardware.get(k))
      for k in have
      if have[k] - taken.get(k, 0) > 0
  )
  return search.Split(roles.Group(t), roles.Group(r))


# ---------------------------------------------------------------------------------------------
# The run's costs.


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
    settings: Settings,
    *,
    directory: str = cache.COSTS_DIR,
    log=None,
) -> rm.RunModel:
  """The RunModel of a config from the costs cache; a missing entry is computed (compiling the
  programs in a child process) and stored, with a memory point (sim/cache.py)."""
  path, variant = cache.split_config_arg(config_arg)
  if 'pretrain' in config:
    raise PlanError(
        f'{config_arg} is a pretraining config (python -m digen_jax.tasks.shapes.pretrain); the '
        'planner plans GRPO runs: give an RL config, e.g. configs/shapes.py'
    )
  r, m = config.rl, config.model
  if r.prompts_per_step < 1 or r.group_size < 1:
    raise PlanError(
        f'config.rl.prompts_per_step={r.prompts_per_step} and group_size='
        f'{r.group_size} must be >= 1'
    )
  lora = int(m.lora.rank) > 0
  finetune, rank = ('lora', int(m.lora.rank)) if lora else ('full', 0)
  digest = cache.config_digest(config)
  found = [] if settings.recompute else cache.matching(path, digest, finetune, rank, directory)
  notes = []
  batch, fragment = r.prompts_per_step * r.group_size, r.group_size
  if config.schedule.fragments > 1:
    fragment = batch // config.schedule.fragments
  main = [
      e
      for e in found
      if e.key.method != 'raw' and set(e.key.programs) >= {'rollout', 'grad', 'apply'}
  ]
  if not main:
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
    try:
      found = [
          cache.compute(key, overrides, digest, directory=directory, **_log(log)),
          cache.compute(point, overrides, digest, directory=directory, **_log(log)),
      ] + [e for e in found if e.key.method == 'raw']
    except RuntimeError as e:
      raise PlanError(f'{config_arg}: {e}') from None
  sources = [cache.describe(e) for e in found]
  run = rm.from_cache(config_arg, config, found, notes=notes)
  run.notes.append('costs: ' + '; '.join(sources))
  return run


def _log(log):
  return {} if log is None else {'log': log}


# ---------------------------------------------------------------------------------------------
# The plan.


def plan(
    run: rm.RunModel,
    parts,
    settings: Settings,
    *,
    trainer: search.Split | None = None,
    cluster: str = '',
) -> dict:
  """Searches every mode and returns the report (a JSON-able dict; simulation results under
  '_results' for the timelines)."""
  knobs = settings.knobs()
  planner = search.Planner(
      run,
      parts,
      knobs,
      steps=settings.steps,
      simulate_top=settings.simulate_top,
      grid=settings.grid,
      tcss_fraction=settings.tcss_fraction or None,
      fixed=trainer,
      pad=settings.pad,
  )
  found = planner.search()
  modes = found['modes']
  if all(c is None for c in modes.values()):
    if planner.indivisible and not planner.costed:
      raise PlanError(
          f'no split of {cluster} divides the batch of {run.batch} samples (or its fragments) '
          "over both roles' devices, which the runtime needs: change rl.prompts_per_step / "
          'rl.group_size or the device counts, or pass --pad to cost padded batches'
      )
    raise PlanError(diagnose(run, parts, knobs, cluster))
  out_modes, results = _mode_rows(planner, modes, settings)
  fitted = [k for k in search.MODES + search.EXTRA_MODES if modes[k] is not None]
  best = max(fitted, key=lambda k: modes[k].samples_per_s)
  on_policy = [k for k in fitted if not k.endswith('tcss')]
  best_on = max(on_policy, key=lambda k: modes[k].samples_per_s) if on_policy else None
  tried = {
      k: [
          {
              'split': c.split.label if c.split else 'colocated',
              'fragments': c.fragments,
              'bound_s': c.bound_s,
              'samples_per_s': c.samples_per_s,
          }
          for c in v
      ]
      for k, v in found['tried'].items()
  }
  kinds = list({p.accelerator.name: p.accelerator for p in parts}.values())
  uniform = knobs.engine == 'uniform'
  calibration = [] if uniform else hardware.describe_calibration(knobs.engine, kinds)
  sources = [] if uniform else hardware.describe_calibration(knobs.engine, kinds, sources=True)
  return {
      'model': run.name,
      'cluster': cluster,
      'calibration': calibration,
      'calibration_sources': sources,
      'devices': sum(p.count for p in parts),
      'source': run.source,
      'run': run_json(run),
      'settings': dataclasses.asdict(settings),
      'modes': out_modes,
      'best': best,
      'best_on_policy': best_on,
      'best_split': out_modes[best_on or best].get('split'),
      'tried': tried,
      'notes': list(run.notes) + planner.notes(modes),
      '_results': results,
  }


def _mode_rows(planner, modes: dict, settings: Settings) -> tuple[dict, dict]:
  """(per mode its report row or why it has none, per mode its simulation result)."""
  col = modes['colocated']
  dis = modes['disagg']
  out_modes, results = {}, {}
  for key, c in modes.items():
    if c is not None and c.layout.num_devices <= settings.trace_devices:
      planner.simulate(c, real_layout=True)  # every device's spans, for the trace
    if c is None:
      out_modes[key] = {
          'samples_per_s': None,
          'utilization': None,
          'fits': False,
          'why': _why_not(planner, key),
      }
      continue
    results[key] = c.result.pop('_sim')
    row = candidate_json(c)
    row['x_colocated'] = c.samples_per_s / col.samples_per_s if col else None
    row['x_disagg'] = c.samples_per_s / dis.samples_per_s if dis else None
    out_modes[key] = row
  return out_modes, results


def _why_not(planner, key: str) -> str:
  """Why mode `key` has no candidate."""
  if key != 'colocated' and planner.all.n < 2:
    return 'needs >= 2 devices (one per role)'
  if (planner.costed and key != 'colocated') or (
      key == 'colocated' and key not in planner.indivisible
  ):
    return 'does not fit in memory'
  return 'no split divides the batch over the devices (--pad costs it padded)'


def option_json(o: roles.Option | None) -> dict | None:
  if o is None:
    return None
  return {
      'label': o.label,
      'seconds': o.seconds,
      'calls': o.calls,
      'fits': o.fits,
      'memory_gib': {k: v / GIB for k, v in o.memory.items()},
      **{k: v for k, v in o.detail.items()},
  }


def candidate_json(c: search.Candidate) -> dict:
  r = {k: v for k, v in c.result.items() if not k.startswith('_')}
  out = {
      'samples_per_s': r['samples_per_s'],
      'utilization': r['utilization'],
      'wall_s': r['wall_s'],
      'bts_inserts': r['bts_inserts'],
      'fragments': c.fragments,
      'trainer_busy': r['trainer_busy'],
      'rollout_busy': r['rollout_busy'],
      'split': c.split.label if c.split else 'colocated on all devices',
      'trainer': c.split.trainer.label if c.split else None,
      'rollout': c.split.rollout.label if c.split else None,
      'step_costs': dataclasses.asdict(c.costs),
      'schedule': dataclasses.asdict(c.schedule),
      'bound_s': c.bound_s,
      'fits': True,
  }
  for k in ('rollout', 'grad', 'tag'):
    out[f'{k}_option'] = option_json(c.choices.get(k))
  return out


def run_json(run: rm.RunModel) -> dict:
  d = {
      k: getattr(run, k)
      for k in (
          'name',
          'source',
          'prompts',
          'group_size',
          'T',
          'K',
          'image_tokens',
          'latent_channels',
          'layers',
          'trainable_bytes',
          'optimizer_state_bytes',
          'frozen_base_bytes',
          'published_bytes',
          'rollout_param_bytes',
          'gathered_bytes',
          'finetune',
      )
  }
  d['batch'] = run.batch
  d['programs'] = {
      p.name: {
          'temp_fit': p.temp_fit,
          'per_unit_flops': p.per_unit,
          'temp_const_gib': p.temp_const / GIB,
          'temp_per_unit_gib': p.temp_per_unit / GIB,
          'cpu_upcast_gib': p.upcast_bytes / GIB,
      }
      for p in [run.rollout, run.apply, *run.grads.values()]
  }
  d['remat_costed'] = sorted(run.grads)
  return d


def diagnose(run: rm.RunModel, parts, knobs: rm.Knobs, cluster: str) -> str:
  """Why nothing fits, and what would: the smallest-memory option of each role on all the
  cluster's devices, and the device count or memory that would hold it."""
  g = roles.Group(parts)
  limit = g.memory_bytes * knobs.memory_fraction
  kind = min(g.kinds, key=lambda a: a.memory_bytes).name
  grad = rm.smallest(rm.grad_options(run, g, g.n, knobs, tsp=False))
  roll = rm.smallest(rm.rollout_options(run, g, g.n, knobs))
  msgs = []
  # Bytes that shrink with more devices (FSDP), and what does not.
  for role, o, sharded in (
      ('trainer', grad, run.trainer_persistent(1)),
      ('rollout', roll, run.rollout_param_bytes if roll.detail.get('layout') == 'fsdp' else 0.0),
  ):
    if o.fits:
      continue
    fixed = o.memory['total'] - sharded / g.n
    need = o.memory['total'] / GIB
    msg = (
        f'the {role} needs {need:.1f} GiB per device even on all {g.n} devices ({o.label}; '
        f'{limit / GIB:.1f} GiB usable on {kind})'
    )
    if fixed < limit and sharded:
      msg += f'; it would fit on >= {math.ceil(sharded / (limit - fixed))} such devices'
    else:
      msg += f'; it needs an accelerator with >= {need / knobs.memory_fraction:.0f} GiB'
    if run.finetune == 'full' and role == 'trainer':
      msg += ', or LoRA (full fine-tuning holds f32 weights, gradients and optimizer state)'
    msgs.append(msg)
  if not msgs:
    col = rm.smallest(rm.colocated_rollout_options(run, g, g.n, knobs))
    msgs.append(
        f'colocated needs {col.memory["total"] / GIB:.1f} GiB per device ({col.label}; '
        f'{limit / GIB:.1f} GiB usable on {kind}) and '
        + (
            'disaggregation needs >= 2 devices'
            if g.n < 2
            else 'no split gives both roles enough devices'
        )
        + ': add devices'
    )
  return f'{run.name} does not fit {cluster}: ' + '; '.join(msgs)


# ---------------------------------------------------------------------------------------------
# Report and files.


def format_plan(p: dict) -> str:
  r = p['run']
  lines = [
      f'{p["model"]} on {p["cluster"]} ({p["devices"]} devices): {r["finetune"]}, batch '
      f'{r["batch"]} ({r["prompts"]} prompts x {r["group_size"]}), T={r["T"]}, K={r["K"]}, '
      f'{r["image_tokens"]} image tokens; costs {p["source"]}; roofline '
      f'{p["settings"]["roofline"]}, '
      + (
          f'MFU {p["settings"]["mfu"]:.0%} for every program'
          if p['settings']['mfu']
          else 'calibrated fractions of peak (sim/hardware.py CALIBRATIONS):'
      )
  ]
  lines += [f'  {c}' for c in p['calibration']]
  head = (
      f'{"mode":18}{"samples/s":>10}{"util":>6}{"busy t/r":>10}{"x coloc":>8}'
      f'{"x disagg":>9}{"M":>4}{"step s":>8}  split'
  )
  lines += ['', head]
  for k in search.MODES + search.EXTRA_MODES:
    m = p['modes'][k]
    if m['samples_per_s'] is None:
      lines.append(f'{k:18}{"-":>10}  {m["why"]}')
      continue
    xc = f'{m["x_colocated"]:.2f}' if m['x_colocated'] else '-'
    xd = f'{m["x_disagg"]:.2f}' if m['x_disagg'] else '-'
    busy = f'{m["trainer_busy"]:.2f}/{m["rollout_busy"]:.2f}'
    lines.append(
        f'{k:18}{m["samples_per_s"]:10.4g}{m["utilization"]:6.2f}{busy:>10}{xc:>8}{xd:>9}'
        f'{m["fragments"]:4d}{m["wall_s"]:8.3g}  {m["split"]}'
        + ('  (TSP off: not a ladder rung)' if k in search.EXTRA_MODES else '')
    )
  lines.append(
      'busy t/r: the share of a step the trainer / the rollout runs a program '
      '(colocated: the same devices)'
  )
  lines += [
      '',
      'memory per device (GiB; usable '
      f'{p["settings"]["memory_fraction"]:.0%} of the device), the option each role takes:',
  ]
  shown = set()
  for k in ('colocated', p['best']):
    m = p['modes'].get(k) or {}
    for what in ('rollout', 'grad', 'tag'):
      o = m.get(f'{what}_option')
      if not o or (k, what) in shown:
        continue
      shown.add((k, what))
      role = {'rollout': 'rollout', 'grad': 'trainer', 'tag': 'trainer (TAG sampling)'}[what]
      where = (
          m['rollout'] if what == 'rollout' and m.get('rollout') else (m['trainer'] or m['split'])
      )
      parts = ', '.join(f'{a} {v:.1f}' for a, v in o['memory_gib'].items() if a != 'total')
      lines.append(
          f'  {k:10} {role:22} {where}: {o["memory_gib"]["total"]:.1f} '
          f'({parts}) {"fits" if o["fits"] else "DOES NOT FIT"}; {o["label"]}'
          + (' [batch padded to the devices]' if o.get('padded') else '')
      )
  lines += [
      '',
      f'best: {p["best"]} ({p["modes"][p["best"]]["samples_per_s"]:.3f} samples/s); '
      f'best on-policy: {p["best_on_policy"]}; split: {p["best_split"]}',
  ]
  for n in p['notes']:
    lines.append(f'note: {n}')
  return '\n'.join(lines)


def write(p: dict, directory: str, *, max_rows: int = 32, every_mode: bool = True) -> list[str]:
  """plan.json, timeline.png and trace.json (the best mode), timelines/<mode>.png (every mode,
  or none)."""
  os.makedirs(os.path.join(directory, 'timelines') if every_mode else directory, exist_ok=True)
  results = p.get('_results', {})
  doc = {k: v for k, v in p.items() if not k.startswith('_')}
  paths = [os.path.join(directory, 'plan.json')]
  with open(paths[0], 'w') as f:
    json.dump(doc, f, indent=1, default=str)
  for mode, res in results.items():
    if not every_mode and mode != p['best']:
      continue
    m = p['modes'][mode]
    title = (
        f'simulated {mode}: {p["model"]} on {p["cluster"]}, {m["split"]}, M={m["fragments"]}'
        f', {m["samples_per_s"]:.3f} samples/s'
    )
    spans = _rows(res.spans, max_rows)
    if every_mode:
      path = os.path.join(directory, 'timelines', f'{mode}.png')
      trace_lib.write_timeline(path, spans, title=title)
      paths.append(path)
    if mode == p['best']:
      top = os.path.join(directory, 'timeline.png')
      trace_lib.write_timeline(top, spans, title=title)
      tr = os.path.join(directory, 'trace.json')
      trace_lib.write_chrome_trace(tr, res.spans, res.decisions)
      paths += [top, tr]
  return paths


def _rows(spans, max_rows: int):
  """Spans with at most `max_rows` device rows: a role's devices run the same programs in
  lockstep, so a large role keeps its first devices' rows only."""
  devs = sorted({d for s in spans for d in s.devices})
  if len(devs) <= max_rows:
    return spans
  by_role: dict[str, list[int]] = {}
  for s in spans:
    by_role.setdefault(s.role, sorted(s.devices))
  keep = set()
  for ids in by_role.values():
    keep |= set(ids[: max(1, max_rows // max(1, len(by_role)))])
  return [
      dataclasses.replace(s, devices=tuple(d for d in s.devices if d in keep))
      for s in spans
      if any(d in keep for d in s.devices)
  ]
