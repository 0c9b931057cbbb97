"""python -m digen_jax.perf: the ladder (benchmarks/ladder.py) predicted by the simulator.

    python -m digen_jax.perf --config=configs/shapes.py --json=OUT.json [--repeats 5] \
        [--config.k=v ...]
    python -m digen_jax.perf --profile=PROFILE.json --json=OUT.json
        [--steps 8] [--rungs ...] [--variants mp2,sp] [--fragments 16] [--fragment_unit group]
        [--tcss_fraction 0.5] [--measured=LADDER.json] [--timelines=DIR]

--config profiles the config's programs on this machine first (python -m digen_jax.perf.profile
in the layouts the variants need, same --config.k=v overrides, --repeats timed calls of each
program; the profile is kept beside OUT as OUT.profile.json), then predicts; --profile predicts
from a profile taken before (same config and overrides as the ladder run it predicts). OUT.json
has the ladder's keys (docs/design.md#measuring: 'modes', 'modes_by_variant', 'rows'), so
predicted and measured rungs compare line by line; --measured prints that comparison (relative
error of samples/s, absolute error of utilization) and stores it under 'comparison'.
--timelines writes each simulated rung's timeline.png in a real run's format. For accelerator
clusters see python -m digen_jax.plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from digen_jax.perf import predict


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m digen_jax.perf', description=__doc__.split('\n')[0])
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument('--profile', help='sim.profile JSON of this machine')
  source.add_argument('--config', help='a config file[:variant]: profile it here first')
  p.add_argument('--json', required=True, help='where the predicted ladder JSON goes')
  p.add_argument('--steps', type=int, default=8, help='optimizer steps per rung (>= 2)')
  p.add_argument('--rungs', default=','.join(predict.RUNGS))
  p.add_argument('--variants', default=','.join(predict.VARIANTS))
  p.add_argument(
      '--fragments',
      type=int,
      default=0,
      help="M of the GAP rungs; 0: the profile's (with --config: the largest of 16, 8, 4, 2 "
      "dividing the config's batch in --fragment_unit units)",
  )
  p.add_argument('--fragment_unit', default='group', choices=('group', 'sample'))
  p.add_argument('--tcss_fraction', type=float, default=0.5)
  p.add_argument(
      '--repeats',
      type=int,
      default=None,
      help="with --config: timed calls per program in the profile (perf/profile.py's default)",
  )
  p.add_argument('--measured', default=None, help='a ladder JSON to compare with')
  p.add_argument('--timelines', default=None, help='directory for <run>.png timelines')
  a, rest = p.parse_known_args(argv)
  a.overrides = [x for x in rest if x.startswith('--config.')]
  unknown = [x for x in rest if not x.startswith('--config.')]
  if unknown:
    p.error(f'unrecognized arguments: {" ".join(unknown)}')
  if a.overrides and not a.config:
    p.error('--config.k=v overrides need --config (a profile was taken with its own)')
  a.rungs = [r for r in a.rungs.split(',') if r]
  a.variants = [v for v in a.variants.split(',') if v]
  for r in a.rungs:
    if r not in predict.RUNGS:
      p.error(f'--rungs: unknown rung {r!r}; use a subset of {",".join(predict.RUNGS)}')
  for v in a.variants:
    if v not in predict.VARIANTS:
      p.error(f'--variants: unknown variant {v!r}; use a subset of {",".join(predict.VARIANTS)}')
  if a.steps < 2:
    p.error(f'--steps={a.steps}: need >= 2 (the first step fills the pipeline)')
  if a.repeats is not None and (a.repeats < 1 or not a.config):
    p.error(f'--repeats={a.repeats}: needs --config and a value >= 1')
  if not 0 < a.tcss_fraction <= 1:
    p.error(f'--tcss_fraction={a.tcss_fraction} must be in (0, 1]')
  for path in (a.profile, a.measured, a.config and a.config.partition(':')[0]):
    if path and not os.path.isfile(path):
      p.error(f'{path}: no such file')
  return a


def take_profile(a) -> str:
  """Profiles a.config (python -m digen_jax.perf.profile, in a child: it fixes the device count)
  in the layouts the asked rungs and variants run in; returns the profile's path."""
  out = a.json + '.profile.json'
  layouts = (['colocated'] if 'colocated' in a.rungs else []) + list(a.variants)
  grads = (['plain'] if 'gap' in a.rungs else []) + (
      ['tsp'] if {'tsp', 'tag', 'tcss'} & set(a.rungs) else []
  )
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.perf.profile',
      f'--config={a.config}',
      f'--out={out}',
      f'--layouts={",".join(layouts)}',
      f'--fragments={a.fragments}',
      f'--fragment_unit={a.fragment_unit}',
      *([f'--fragment_grads={",".join(grads)}'] if grads else []),
      *([f'--repeats={a.repeats}'] if a.repeats is not None else []),
      *a.overrides,
  ]
  print(f'[sim] profiling: {" ".join(cmd[1:])}', flush=True)
  if subprocess.run(cmd, check=False).returncode:
    raise ValueError(f'profiling {a.config} failed (its error is above)')
  return out


def measured_spans(ladder: dict) -> dict[str, dict[str, float]]:
  """Run name -> predict.span_seconds of its trace, for the ladder's runs whose workdir still
  holds one (schedule.trace; benchmarks/ladder.py turns it on)."""
  out = {}
  for row in ladder.get('rows', []):
    path = os.path.join(row.get('workdir') or '', 'trace.json')
    if row.get('status') == 'ok' and os.path.isfile(path):
      with open(path) as f:
        out[row['name']] = predict.span_seconds(json.load(f)['traceEvents'])
  return out


def format_comparison(cmp: dict) -> str:
  out = [
      f'{"variant":8} {"mode":18} {"measured":>9} {"predicted":>9} {"error":>7} '
      f'{"util m":>7} {"util p":>7}  at measured spans (error; spans / profile)'
  ]
  for x in cmp['lines']:
    mu = x['measured_util']
    at = ''
    if 'sps_at_spans' in x:
      ratios = ' '.join(f'{k} {v:.2f}' for k, v in x['spans_vs_profile'].items())
      at = f'  {x["sps_at_spans"]:.2f} ({100 * x["sps_error_at_spans"]:+.1f}%; {ratios})'
    out.append(
        f'{x["variant"]:8} {x["mode"]:18} {x["measured_sps"]:9.2f} '
        f'{x["predicted_sps"]:9.2f} {100 * x["sps_error"]:+6.1f}% '
        f'{mu if mu is None else round(mu, 3)!s:>7} {x["predicted_util"]:7.3f}{at}'
    )
  out.append(
      f'samples/s: mean |error| {100 * cmp["sps_mae"]:.1f}%, largest '
      f'{100 * cmp["sps_max"]:.1f}%; utilization: mean |error| '
      f'{cmp["util_mae"] if cmp["util_mae"] is None else round(cmp["util_mae"], 3)}'
  )
  return '\n'.join(out)


def main(argv=None) -> int:
  a = parse_args(sys.argv[1:] if argv is None else argv)
  if a.config:
    try:
      a.profile = take_profile(a)
    except ValueError as e:
      print(f'digen_jax.perf: {e}', file=sys.stderr)
      return 2
  with open(a.profile) as f:
    profile = json.load(f)
  if not a.fragments:  # the profile's M (its fragment programs are compiled for it)
    a.fragments = max(lay.get('fragments', 1) for lay in profile['layouts'].values())
  measured, spans = None, {}
  if a.measured:
    with open(a.measured) as f:
      measured = json.load(f)
    spans = measured_spans(measured)
  try:
    pred = predict.predict_ladder(
        profile,
        rungs=a.rungs,
        variants=a.variants,
        steps=a.steps,
        fragments=a.fragments,
        unit=a.fragment_unit,
        tcss_fraction=a.tcss_fraction,
        measured_spans=spans,
    )
  except ValueError as e:
    print(f'digen_jax.perf: {e}', file=sys.stderr)
    return 2
  if a.timelines:
    from digen_jax.runtime import trace as trace_lib  # pylint: disable=g-import-not-at-top

    os.makedirs(a.timelines, exist_ok=True)
    for r in pred['rows']:
      trace_lib.write_timeline(
          os.path.join(a.timelines, f'sim_{r["name"]}.png'),
          r['result'].spans,
          title=f'simulated {r["name"]}',
      )
  for r in pred['rows']:
    del r['result']
    print(
        f'{r["name"]:12} {r["samples_per_s"]:8.2f} samples/s  util {r["utilization"]:.3f}'
        f'  x coloc {r["x_colocated"] or 0:.2f}  x disagg {r["x_disagg"] or 0:.2f}'
    )
  doc = {
      'source': 'simulator',
      'profile': a.profile,
      'profile_machine': profile.get('machine'),
      'command': ' '.join(
          ['python -m digen_jax.perf'] + (sys.argv[1:] if argv is None else list(argv))
      ),
      'steps': a.steps,
      'variant': a.variants[0] if a.variants else '-',
      **pred,
  }
  if measured is not None:
    doc['comparison'] = predict.compare(pred, measured, a.variants)
    print(format_comparison(doc['comparison']))
  with open(a.json, 'w') as f:
    json.dump(doc, f, indent=1)
  print(f'[sim] {a.json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
