"""What python -m digen_jax.plan does, as functions: input validation, the search, the report
and the files (the run's cost model: perf/run_models.py).

Every input error is a PlanError with one line saying what is wrong and what would fix it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

from digen_jax.perf import baseline
from digen_jax.perf import comparisons
from digen_jax.perf import prices
from digen_jax.perf import hardware
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search
from digen_jax.perf import splits
from digen_jax.perf import timing

PlanError = search.PlanError
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Settings:
  roofline: str = 'compute'  # 'compute' | 'bytes'
  mfu: float = 0.0  # 0: the calibrated fractions (perf/calibrations.py); else one for all
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
  colocated_terms: str = 'all'  # the baseline's terms: all, none or a subset (perf/baseline.py)
  costs: str = 'xla'  # 'xla': the compiled programs (cache); 'analytic': perf/analytic.py
  overlap: bool = True  # FSDP collectives behind compute (runmodel.Knobs.overlap)
  trace_devices: int = 32  # up to this many devices the best candidates' traces hold
  # every device; above, one row per role
  prices: str = ''  # kind=USD an hour over perf/prices.py's list ('H20=1.2,...')

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
        overlap=self.overlap,
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
  if settings.costs not in ('xla', 'analytic'):
    raise PlanError(f"--costs={settings.costs}: use 'xla' or 'analytic'")
  try:
    baseline.parse_terms(settings.colocated_terms)
  except ValueError as e:
    raise PlanError(f'--colocated_terms={settings.colocated_terms}: {e}') from None
  try:
    prices.parse(settings.prices)
  except ValueError as e:
    raise PlanError(f'--prices={settings.prices}: {e}') from None
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


# ---------------------------------------------------------------------------------------------
# The plan.


def plan(
    run: rm.RunModel,
    parts,
    settings: Settings,
    *,
    trainer: search.Split | None = None,
    cluster: str = '',
    recipe: baseline.Recipe | None = None,
    sequence: int = 1,
    split_memory: Callable[[int], rm.SplitMemory] | None = None,
) -> dict:
  """Searches every mode and returns the report (a JSON-able dict; simulation results under
  '_results' for the timelines). `recipe`: the compared colocated system (config.baseline;
  default veRL-Omni's), priced with settings.colocated_terms. `sequence`: the config's
  config.parallel.sequence (> 1: plan that split only; 1: the smallest split under which a
  mode fits, splits.search_splits); `split_memory`: computes a split's memory the cache lacks."""
  run = dataclasses.replace(run, sequence=sequence, notes=list(run.notes))
  knobs = settings.knobs()
  run, planner, found = splits.search_splits(
      run,
      parts,
      knobs,
      split_memory,
      steps=settings.steps,
      simulate_top=settings.simulate_top,
      grid=settings.grid,
      tcss_fraction=settings.tcss_fraction or None,
      fixed=trainer,
  )
  modes = found['modes']
  if all(c is None for c in modes.values()):
    raise PlanError(diagnose(run, parts, knobs, cluster))
  recipe = recipe or baseline.Recipe()
  terms = baseline.parse_terms(settings.colocated_terms)
  price_list = prices.parse(settings.prices)
  usd, unpriced = prices.usd_per_hour(parts, price_list)
  base = comparisons.baseline_row(run, parts, knobs, recipe, terms, price_list)
  out_modes, results = _mode_rows(planner, modes, settings)
  fast_part, fast_colocated = _colocated_on_fast_part(run, parts, knobs, settings)
  compared = comparisons.baselines_of(base, modes, parts, price_list, fast_colocated, fast_part)
  comparisons.add_ratios(out_modes, base, compared, usd)
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
  cost = {'usd_per_hour': usd, 'unpriced': unpriced}
  cost['prices'] = {k: dataclasses.asdict(v) for k, v in price_list.items()}
  return {
      'model': run.name,
      'cluster': cluster,
      **comparisons.efficiency_report(parts, knobs, recipe, terms),
      'devices': sum(p.count for p in parts),
      'source': run.source,
      'run': run_json(run),
      'settings': dataclasses.asdict(settings),
      'modes': out_modes,
      'baseline': base,
      'baselines': compared,
      'cost': cost,
      'verdict': comparisons.verdict(out_modes, compared, best_on),
      'best': best,
      'best_on_policy': best_on,
      'best_split': out_modes[best_on or best].get('split'),
      'sequence': run.sequence,
      'tried': tried,
      'notes': list(run.notes) + _reward_worker_notes(run, parts) + planner.notes(modes),
      '_results': results,
  }


def _colocated_on_fast_part(run: rm.RunModel, parts, knobs: rm.Knobs, settings: Settings):
  """(the fastest part, our colocated mode on it alone) on a mixed cluster, else (None, None):
  a colocated run need not use the slow devices, so the fair colocated baseline may not."""
  if len(parts) < 2:
    return None, None
  fast = max(parts, key=lambda p: p.accelerator.peak_bf16_flops)
  if fast.count % run.sequence:
    return fast, None
  planner = search.Planner(
      run,
      (fast,),
      knobs,
      steps=settings.steps,
      simulate_top=settings.simulate_top,
      grid=settings.grid,
      tcss_fraction=settings.tcss_fraction or None,
  )
  col = planner.colocated()
  if col is not None:
    planner.simulate(col)
  return fast, col


def _reward_worker_notes(run: rm.RunModel, parts) -> list[str]:
  """Where the reward workers' devices are: beside the cluster, not among its devices."""
  if not run.reward_workers:
    return []
  devices = sum(p.count for p in parts)
  return [
      f'the reward scores on config.reward.workers={run.reward_workers} devices of their own '
      f'({run.reward_accelerator}, {run.reward_device_s:g} s a sample each) beside the '
      f"cluster's {devices}, not among them: a disaggregated plan's fragments are scored there "
      'while the rollout samples on; colocated modes score on their own devices'
  ]


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
  return 'does not fit in memory'


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
