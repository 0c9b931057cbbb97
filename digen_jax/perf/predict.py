"""The ladder predicted: a profile of this machine's programs (perf/profile.py) -> per rung the
costs, layout and schedule the simulator (perf/engine.py) runs, and the ladder's JSON figures.

Rungs and variants are benchmarks/ladder.py's: colocated (one process, 2D devices, one mesh),
then per variant (mp2: two pinned processes; sp: one process, both roles' devices) naive
disaggregation, +GAP (M fragments), +TSP, +TAG/BTS, +TCSS. How a profile's seconds become a
rung's StepCosts (what the runtime's one loop does between its programs; colocated and naive
disaggregation are one fragment of the whole batch, n = B, the others n = B / M):
  rollout = a fragment's sampling span; deliver = its scoring + hand-over; gap = scoring +
  hand-over (the rollout hands each fragment over before the next one) + the next fragment's
  encode; with M > 1 fragments, when the profile has them, the span and the host time between
  two spans as the runtime samples them (the scoring beside the next span) + the hand-over;
  grad = advantages + gradient (TSP: its program; one fragment without TSP: the fused update,
  apply then 0); apply; tag_rollout = encode + span + scoring on the trainer;
  trainer_host = the step's encodes + selection + the checkpoint save's blocking part;
  checkpoint = the save's asynchronous rest, beside the trainer's next programs (each /
  checkpoint_every); publish (+ pull, mp2).
"""

from __future__ import annotations

import dataclasses
import statistics

from digen_jax.perf import engine

RUNGS = ('colocated', 'disagg', 'gap', 'tsp', 'tag', 'tcss')
MODE_KEYS = {
    'colocated': 'colocated',
    'disagg': 'disagg',
    'gap': 'gap',
    'tsp': 'gap_tsp',
    'tag': 'gap_tsp_tag',
    'tcss': 'gap_tsp_tag_tcss',
}
VARIANTS = ('mp2', 'sp')


def rung_schedule(rung: str, fragments: int, unit: str, tcss_fraction: float) -> engine.Modes:
  """The schedule of a rung: each rung turns on one more technique (benchmarks/ladder.py)."""
  if rung not in RUNGS:
    raise ValueError(f'rung {rung!r} is not one of {RUNGS}')
  level = RUNGS.index(rung)
  return engine.Modes(
      fragments=fragments if level >= 2 else 1,
      unit=unit if level >= 2 else 'group',
      tsp=level >= 3,
      tag=level >= 4,
      tcss_fraction=tcss_fraction if level >= 5 else 0.0,
  )


def _get(seconds: dict, key: str, layout: str) -> float:
  if key not in seconds:
    raise ValueError(
        f'the profile of layout {layout!r} has no {key!r}; profile this config '
        'with the same --fragments (python -m digen_jax.perf.profile)'
    )
  return float(seconds[key])


def step_costs(
    prof: dict, layout_name: str, schedule: engine.Modes, single_core: dict | None = None
) -> engine.StepCosts:
  """A profiled layout's seconds -> the StepCosts of `schedule` (see the module docstring).

  single_core: the seconds of the same programs on one core (the mp2 profile), which give
  each program's core use on a shared layout (seconds on one core / seconds alone there)."""
  s = prof['seconds']
  B, n = prof['batch'], prof['fragment']
  g = lambda key: _get(s, key, layout_name)
  if 'checkpoint_every' not in prof:
    raise ValueError(
        f'the profile of layout {layout_name!r} has no checkpoint_every; profile again '
        '(python -m digen_jax.perf.profile)'
    )
  per_step = 1.0 / prof['checkpoint_every']  # saves per step, on average
  save_block, save_rest = per_step * g('checkpoint_block'), per_step * g('checkpoint')

  def cores(pairs):
    if not single_core or not prof.get('shared') or prof.get('colocated'):
      return {}
    return {
        prog: max(1.0, single_core[key] / s[key])
        for prog, key in pairs
        if key in single_core and key in s
    }

  M = schedule.fragments
  if M > 1 and M != prof['fragments']:
    raise ValueError(
        f'the profile holds M={prof["fragments"]} fragment programs, the rung asks for M={M}'
    )
  n = B // M
  hand = g(f'reward/{n}') + g(f'handover/{n}')
  grad = f'update/{n}' if schedule.fused else f'grad_tsp/{n}' if schedule.tsp else f'grad/{n}'
  tag = None
  if schedule.tag:
    tag = g(f'encode/{n}') + g(f'tag_rollout/{n}') + g(f'tag_reward/{n}')
  # Fragments as the runtime's rollout samples them, each scored beside the next one's span
  # (perf/profile.py): the span and the host time between two, plus the send.
  rollout, gap = g(f'rollout/{n}'), hand + g(f'encode/{n}')
  if M > 1 and f'rollout_piped/{n}' in s:
    rollout, gap = g(f'rollout_piped/{n}'), g(f'rollout_host/{n}') + g(f'handover/{n}')
  return engine.StepCosts(
      rollout=rollout,
      grad=g(f'adv/{n}') + g(grad),
      apply=0.0 if schedule.fused else g('apply'),
      tag_rollout=tag,
      publish=g('publish'),
      pull=g('pull'),
      deliver=hand,
      gap=gap,
      trainer_host=M * g(f'encode/{n}') + g('begin') + save_block,
      checkpoint=save_rest,
      cores=cores(
          [
              ('rollout', f'rollout/{n}'),
              ('update' if schedule.fused else 'grad', grad),
              ('apply', 'apply'),
              ('tag_rollout', f'tag_rollout/{n}'),
          ]
      ),
  )


def span_seconds(events: list[dict], skip_steps: int = 1) -> dict[str, float]:
  """Mean seconds of each program's spans in a run's trace (runtime/trace.py's Chrome 'X'
  events: name, dur in microseconds, args.step), the steps below `skip_steps` left out (they
  compile and warm up). The mean, not the median: a span slowed by the checkpoint's
  background work beside it counts as often as it happens. Also 'rollout_gap': the mean host
  time from one rollout span's end to the next's start on a device (an event per span and
  device) within a step, where a step has two or more: StepCosts.gap as it ran (the runtime's
  claims, hand-over and encode, with its scoring beside them)."""
  durations: dict[str, list[float]] = {}
  rollouts: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (step, device) -> spans
  for e in events:
    step = e.get('args', {}).get('step', 0)
    if e.get('ph') == 'X' and step >= skip_steps:
      durations.setdefault(e['name'], []).append(e['dur'] / 1e6)
      if e['name'] == 'rollout':
        on = rollouts.setdefault((step, e.get('tid', 0)), [])
        on.append((e['ts'] / 1e6, (e['ts'] + e['dur']) / 1e6))
  out = {name: statistics.fmean(d) for name, d in durations.items()}
  gaps = []
  for spans in rollouts.values():
    spans.sort()
    gaps += [b[0] - a[1] for a, b in zip(spans, spans[1:])]
  if gaps:
    out['rollout_gap'] = statistics.fmean(gaps)
  return out


def at_measured_spans(
    prof: dict, layout_name: str, schedule: engine.Modes, spans: dict[str, float]
) -> engine.StepCosts:
  """step_costs with each program's seconds replaced by its mean span in a measured run of the
  same rung (span_seconds), and the rollout's host time between fragments by the run's: the
  programs as they ran there, beside each other. The checkpoint's background job is dropped,
  since the spans it slowed already hold it. Simulating these costs
  separates a prediction's error into the programs' times (profile vs run) and the rest (the
  schedule, host work no span covers). Not for a layout whose roles share cores at once (sp):
  there the engine would slow the measured spans a second time."""
  if prof['shared'] and not prof['colocated']:
    raise ValueError(f'layout {layout_name!r} shares cores between roles: its spans are slowed')
  costs = step_costs(prof, layout_name, schedule)
  s, n = prof['seconds'], prof['batch'] // schedule.fragments
  span = lambda name, default: spans.get(name, default)
  tag_rollout = costs.tag_rollout
  if (
      tag_rollout is not None and 'tag_rollout' in spans
  ):  # the span is the sampling; encode and scoring are around it
    tag_rollout += spans['tag_rollout'] - _get(s, f'tag_rollout/{n}', layout_name)
  return dataclasses.replace(
      costs,
      rollout=span('rollout', costs.rollout),
      # The span holds the advantages and the gradient (and, fused, the optimizer step).
      grad=span('update' if schedule.fused else 'grad', costs.grad),
      apply=span('apply', costs.apply),
      tag_rollout=tag_rollout,
      publish=span('publish', costs.publish),
      gap=span('rollout_gap', costs.gap),
      checkpoint=0.0,
  )


def layout_of(prof: dict, cores: int = 0) -> engine.Layout:
  """The profiled layout; a shared one with the host's `cores` when the programs' core use is
  known (0: each program fills the host)."""
  shared = prof['shared'] and not prof['colocated']
  return engine.Layout(
      trainer_devices=prof['trainer_devices'],
      rollout_devices=prof['rollout_devices'],
      shared=prof['shared'],
      colocated=prof['colocated'],
      cores=cores if shared else 0,
  )


def predict_ladder(
    profile: dict,
    *,
    rungs=RUNGS,
    variants=VARIANTS,
    steps: int = 8,
    fragments: int = 16,
    unit: str = 'group',
    tcss_fraction: float = 0.5,
    measured_spans: dict[str, dict[str, float]] | None = None,
) -> dict:
  """Simulates every (rung, variant) the ladder runs. Returns {'rows': [...], 'modes': ...,
  'modes_by_variant': ...} with the ladder's keys (docs/design.md#measuring).

  measured_spans: run name ('mp2-tag', ...) -> span_seconds of its measured run; each such
  row of a layout that does not share cores is simulated a second time at_measured_spans
  ('samples_per_s_at_spans', 'spans_vs_profile': each program's measured / profiled seconds)."""
  layouts = profile['layouts']
  rows = []
  for rung in rungs:
    for variant in (['-'] if rung == 'colocated' else variants):
      name = 'colocated' if rung == 'colocated' else variant
      if name not in layouts:
        raise ValueError(f'the profile has no {name!r} layout (it has {sorted(layouts)})')
      prof = layouts[name]
      schedule = rung_schedule(rung, fragments, unit, tcss_fraction)
      B, gs = prof['batch'], prof['group_size']
      # Core use on a shared host: from the same programs timed on one core (mp2's profile).
      single = layouts['mp2']['seconds'] if 'mp2' in layouts and name == 'sp' else None
      cores = len(profile.get('machine', {}).get('cores', ())) if single else 0
      result = engine.simulate(
          step_costs(prof, name, schedule, single),
          layout_of(prof, cores),
          schedule,
          groups=B // gs,
          group_size=gs,
          steps=steps,
      )
      row = {
          'name': rung if rung == 'colocated' else f'{variant}-{rung}',
          'rung': rung,
          'variant': variant,
          'status': 'ok',
          **result.summary(),
          'result': result,
      }
      spans = (measured_spans or {}).get(row['name'])
      if spans and (prof['colocated'] or not prof['shared']):
        costs = step_costs(prof, name, schedule)
        measured = at_measured_spans(prof, name, schedule, spans)
        again = engine.simulate(
            measured, layout_of(prof), schedule, groups=B // gs, group_size=gs, steps=steps
        )
        row['samples_per_s_at_spans'] = again.summary()['samples_per_s']
        row['spans_vs_profile'] = {
            f: getattr(measured, f) / getattr(costs, f)
            for f in ('rollout', 'gap', 'grad', 'apply', 'tag_rollout', 'publish')
            if getattr(costs, f) and getattr(measured, f) is not None
        }
      rows.append(row)
  _add_ratios(rows)
  out = {'rows': rows, 'modes_by_variant': {v: _modes(rows, v) for v in variants}}
  out['modes'] = out['modes_by_variant'][variants[0]] if variants else _modes(rows, '-')
  return out


def _add_ratios(rows: list[dict]) -> None:
  sps = {r['name']: r['samples_per_s'] for r in rows}
  for r in rows:
    r['x_colocated'] = r['samples_per_s'] / sps['colocated'] if 'colocated' in sps else None
    d = sps.get(f'{r["variant"]}-disagg')
    r['x_disagg'] = r['samples_per_s'] / d if d else None


def _modes(rows: list[dict], variant: str) -> dict:
  return {
      MODE_KEYS[r['rung']]: {
          k: r.get(k)
          for k in (
              'samples_per_s',
              'utilization',
              'x_colocated',
              'x_disagg',
              'bts_inserts',
              'samples_per_s_at_spans',
              'spans_vs_profile',
          )
      }
      for r in rows
      if r['variant'] in ('-', variant)
  }


def compare(predicted: dict, measured: dict, variants=VARIANTS) -> dict:
  """Predicted vs measured ladder JSON: per (variant, mode) the relative error of samples/s
  and the absolute error of utilization; the mean absolute and the largest relative error."""
  lines = []
  for v in variants:
    p_modes = predicted['modes_by_variant'].get(v, {})
    m_modes = measured.get('modes_by_variant', {}).get(v, {})
    for key, m in m_modes.items():
      p = p_modes.get(key)
      if p is None or m.get('samples_per_s') is None:
        continue
      if key == 'colocated' and any(x['mode'] == 'colocated' for x in lines):
        continue  # one colocated run is every variant's baseline
      lines.append(
          {
              'variant': v,
              'mode': key,
              'measured_sps': m['samples_per_s'],
              'predicted_sps': p['samples_per_s'],
              'sps_error': p['samples_per_s'] / m['samples_per_s'] - 1,
              'measured_util': m.get('utilization'),
              'predicted_util': p['utilization'],
              'util_error': (
                  p['utilization'] - m['utilization'] if m.get('utilization') is not None else None
              ),
          }
      )
      if p.get('samples_per_s_at_spans') is not None:
        lines[-1]['sps_at_spans'] = p['samples_per_s_at_spans']
        lines[-1]['sps_error_at_spans'] = p['samples_per_s_at_spans'] / m['samples_per_s'] - 1
        lines[-1]['spans_vs_profile'] = p['spans_vs_profile']
  if not lines:
    raise ValueError('no (variant, mode) is in both the prediction and the measurement')
  errs = [abs(x['sps_error']) for x in lines]
  uerrs = [abs(x['util_error']) for x in lines if x['util_error'] is not None]
  return {
      'lines': lines,
      'sps_mae': sum(errs) / len(errs),
      'sps_max': max(errs),
      'util_mae': sum(uerrs) / len(uerrs) if uerrs else None,
      'util_max': max(uerrs) if uerrs else None,
  }
