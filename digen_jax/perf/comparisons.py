"""What a plan compares against, and what it priced with: the three baselines every plan reports
(veRL-Omni as config.baseline configures it, our own colocated mode, naive disaggregation), and
the fractions of peak and assumptions behind its figures."""

from __future__ import annotations

import dataclasses

from digen_jax.perf import baseline
from digen_jax.perf import calibrations
from digen_jax.perf import prices
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search


def per_usd(samples_per_s: float | None, usd_per_hour: float | None) -> float | None:
  """Samples per USD at that rate on devices costing usd_per_hour (None: no price)."""
  if not samples_per_s or not usd_per_hour:
    return None
  return samples_per_s * 3600 / usd_per_hour


def baseline_row(
    run, parts, knobs, recipe: baseline.Recipe, terms: frozenset, price_list=None
) -> dict:
  """The compared colocated system on all the devices and, on a mixed cluster, on its fastest
  part alone (a colocated run need not use the slow devices): samples/s and seconds by term;
  with `price_list`, what its devices cost an hour and its samples per USD."""
  out = {'recipe': dataclasses.asdict(recipe), 'terms': sorted(terms)}
  groups = {'all': roles.Group(parts)}
  if len(parts) > 1:
    fast = max(parts, key=lambda p: p.accelerator.peak_bf16_flops)
    if fast.count % run.sequence == 0:  # the split must divide the devices
      groups['fast_part'] = roles.Group((fast,))
  for key, g in groups.items():
    sec = baseline.step_seconds(run, g, knobs, recipe, terms)
    usd = prices.usd_per_hour(g.parts, price_list)[0] if price_list else None
    out[key] = {
        'devices': g.label,
        'samples_per_s': run.batch / sec['total'],
        'seconds': sec,
        'source': baseline.term_sources(run, g, knobs, recipe, terms),
        'usd_per_hour': usd,
        'samples_per_usd': per_usd(run.batch / sec['total'], usd),
    }
  out['samples_per_s'] = max(v['samples_per_s'] for k, v in out.items() if k in groups)
  return out


def mode_baseline(
    c: search.Candidate | None, what: str, devices: str, usd: float | None
) -> dict | None:
  """One of our own modes as a baseline: samples/s and its step's program seconds (StepCosts:
  each program once, as it runs alone; the step's wall time is the simulation's)."""
  if c is None:
    return None
  costs = dataclasses.asdict(c.costs)
  seconds = {k: v for k, v in costs.items() if isinstance(v, float) and v}
  return {
      'devices': c.split.label if c.split else devices,
      'samples_per_s': c.samples_per_s,
      'step_s': c.result['wall_s'],
      'fragments': c.fragments,
      'usd_per_hour': usd,
      'samples_per_usd': per_usd(c.samples_per_s, usd),
      'seconds': seconds,
      'source': {
          k: f'{what}: one {k} of its {c.fragments}-fragment step, priced as the plan prices '
          'its modes (program costs at perf/calibrations.py fractions; the wall time simulated)'
          for k in seconds
      },
  }


def baselines_of(
    base: dict, modes: dict, parts, price_list: dict, fast_colocated=None, fast_part=None
) -> dict:
  """The three baselines every plan reports: veRL-Omni as configured (config.baseline), our own
  colocated mode (on all the devices or, on a mixed cluster, on its fastest part alone:
  whichever is faster, as a user would run it), naive disaggregation (at its best split)."""
  label = roles.Group(parts).label
  usd = prices.usd_per_hour(parts, price_list)[0]
  ours = mode_baseline(modes['colocated'], 'our colocated mode', label, usd)
  if fast_colocated is not None and (
      ours is None or fast_colocated.samples_per_s > ours['samples_per_s']
  ):
    ours = mode_baseline(
        fast_colocated,
        'our colocated mode on the fastest part alone',
        roles.Group((fast_part,)).label,
        prices.usd_per_hour((fast_part,), price_list)[0],
    )
  return {
      'verl_omni': {
          **{k: v for k, v in base.items() if k not in ('all', 'fast_part')},
          **max(
              (base[k] for k in ('all', 'fast_part') if k in base),
              key=lambda b: b['samples_per_s'],
          ),
      },
      'ours_colocated': ours,
      'naive_disagg': mode_baseline(
          modes['disagg'], 'naive disaggregation, its best split', label, usd
      ),
  }


def efficiency_report(parts, knobs: rm.Knobs, recipe: baseline.Recipe, terms) -> dict:
  """The fractions of peak a plan priced its programs at, their sources, and every assumption
  it used: for our engine (unless --mfu) and the baseline's own (when its engine term is on)."""
  kinds = list({p.accelerator.name: p.accelerator for p in parts}.values())
  uniform = knobs.engine == 'uniform'
  engines = [] if uniform else [knobs.engine]
  if 'engine' in terms:
    engines.append(recipe.engine)
  engines = list(dict.fromkeys(e for e in engines if e != 'uniform'))
  return {
      'calibration': [line for e in engines for line in calibrations.describe(e, kinds)],
      'calibration_sources': [
          line for e in engines for line in calibrations.describe(e, kinds, sources=True)
      ],
      'assumed': calibrations.assumptions(engines, kinds, knobs.eff, uniform=uniform),
  }


def verdict(out_modes: dict, compared: dict, best_on: str | None) -> dict:
  """'Should I disaggregate?': the best on-policy mode against each baseline, by samples/s and,
  where the cluster has prices, by samples per USD (the same devices: the same price)."""
  if best_on is None:
    return {'best_on_policy': None, 'disaggregate': False, 'against': {}}
  row = out_modes[best_on]
  against = {}
  for name, b in compared.items():
    if b is None:
      against[name] = None
      continue
    usd_ratio = None
    if row.get('samples_per_usd') and b.get('samples_per_usd'):
      usd_ratio = row['samples_per_usd'] / b['samples_per_usd']
    against[name] = {
        'x_samples_per_s': float(row['samples_per_s'] / b['samples_per_s']),
        'x_per_usd': None if usd_ratio is None else float(usd_ratio),
    }
  ours = against.get('ours_colocated')
  return {
      'best_on_policy': best_on,
      # Disaggregating pays when a split mode beats our own colocated mode at its best placement.
      'disaggregate': bool(best_on != 'colocated' and ours and ours['x_samples_per_s'] > 1),
      'against': against,
  }


def add_ratios(out_modes: dict, base: dict, compared: dict, usd: float | None) -> None:
  """Each mode row's speed-ups in place: over veRL-Omni (x_baseline), over each baseline
  (x_baselines; x_colocated: our colocated mode at its best placement), and samples per USD."""
  for row in out_modes.values():
    sps = row['samples_per_s']
    row['x_baseline'] = sps / base['samples_per_s'] if sps else None
    row['samples_per_usd'] = per_usd(sps, usd)
    row['x_baselines'] = {
        k: (sps / b['samples_per_s'] if sps and b else None) for k, b in compared.items()
    }
    row['x_colocated'] = row['x_baselines']['ours_colocated']
