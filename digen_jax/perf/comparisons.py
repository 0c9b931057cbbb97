"""What a plan compares against, and what it priced with: the three baselines every plan reports
(veRL-Omni as config.baseline configures it, our own colocated mode, naive disaggregation), and
the fractions of peak and assumptions behind its figures."""

from __future__ import annotations

import dataclasses

from digen_jax.perf import baseline
from digen_jax.perf import calibrations
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search


def baseline_row(run, parts, knobs, recipe: baseline.Recipe, terms: frozenset) -> dict:
  """The compared colocated system on all the devices and, on a mixed cluster, on its fastest
  part alone (a colocated run need not use the slow devices): samples/s and seconds by term."""
  out = {'recipe': dataclasses.asdict(recipe), 'terms': sorted(terms)}
  groups = {'all': roles.Group(parts)}
  if len(parts) > 1:
    fast = max(parts, key=lambda p: p.accelerator.peak_bf16_flops)
    if fast.count % run.sequence == 0:  # the split must divide the devices
      groups['fast_part'] = roles.Group((fast,))
  for key, g in groups.items():
    sec = baseline.step_seconds(run, g, knobs, recipe, terms)
    out[key] = {
        'devices': g.label,
        'samples_per_s': run.batch / sec['total'],
        'seconds': sec,
        'source': baseline.term_sources(run, g, knobs, recipe, terms),
    }
  out['samples_per_s'] = max(v['samples_per_s'] for k, v in out.items() if k in groups)
  return out


def mode_baseline(c: search.Candidate | None, what: str, devices: str) -> dict | None:
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
      'seconds': seconds,
      'source': {
          k: f'{what}: one {k} of its {c.fragments}-fragment step, priced as the plan prices '
          'its modes (program costs at perf/calibrations.py fractions; the wall time simulated)'
          for k in seconds
      },
  }


def baselines_of(base: dict, modes: dict, devices: str) -> dict:
  """The three baselines every plan reports: veRL-Omni as configured (config.baseline), our own
  colocated mode, naive disaggregation (at its best split)."""
  out = {
      'verl_omni': {
          **{k: v for k, v in base.items() if k not in ('all', 'fast_part')},
          **max(
              (base[k] for k in ('all', 'fast_part') if k in base),
              key=lambda b: b['samples_per_s'],
          ),
      },
      'ours_colocated': mode_baseline(modes['colocated'], 'our colocated mode', devices),
      'naive_disagg': mode_baseline(
          modes['disagg'], 'naive disaggregation, its best split', devices
      ),
  }
  return out


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
