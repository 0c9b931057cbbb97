"""The scheduling ladder: one config under colocated, naive disagg, +GAP, +TSP,
+TAG/BTS and +TCSS, real runs in one session on this machine, one table of samples/s, ratio to
colocated and to naive disagg (measured in the same session), utilization and eval accuracy.

    python benchmarks/ladder.py                                   # configs/qwenimage.py:tiny_disagg
    python benchmarks/ladder.py --steps 8 --out /tmp/ladder --variants mp2 --rungs colocated,disagg,tag
    python benchmarks/ladder.py --config configs/shapes.py:pixel --set --config.rl.prompts_per_step=4

Rungs (override sets; each adds to the one before; built on launch/sweep.py):
  colocated   --config.runtime.mode=colocated (one process, one mesh over all 2*D devices)
  disagg      the disagg config as is (schedule.fragments=1: the naive full-batch schedule)
  +GAP        --config.schedule.fragments=F            (--fragments, default 4)
              --config.schedule.fragment_unit=U        (--fragment_unit, default sample: the tiny
                                                        configs have 2 prompts, too few for 4
                                                        whole-group fragments)
  +TSP        ... --config.schedule.tsp=True
  +TAG/BTS    ... --config.schedule.tag=True
  +TCSS       ... --config.schedule.tcss_fraction=PHI  (--tcss_fraction, default 0.5; off-policy)
Where the config has a schedule field that a rung leaves off, the rung sets it off explicitly, so
the ladder does not depend on the config's defaults; `schedule.trace=True` is added to every rung
when the config has it. A rung whose fields the config does not have is reported 'invalid' (not
run), any other failure as 'failed' with its log tail: the table is always printed.

Variants of every disagg rung (colocated runs once and is the baseline of both):
  mp2  two processes via launch/local.py --num_processes=2 --cpu_pinning (process 0 trains, process
       1 rolls out, one core each), D devices each (--devices_per_process, default 1)
  sp   one process with 2*D forced host-platform devices (first half train, second half roll out)
  mp2u mp2 without --cpu_pinning (not run unless asked): both processes may use both cores. On
       this 2-core VM a pinned process serves its transfer-server pulls only between its own
       programs, so fragments reach the trainer a fragment late (benchmarks/RESULTS.md)

Figures: samples/s is the median over the steps after the first (it compiles), utilization the
mean over the same steps (both from metrics.jsonl); eval accuracy is eval/strict_accuracy of the
evaluation at the last step (--eval_prompts prompts x 2 samples; 0 turns eval off). Every rung starts
from an empty workdir under OUT/runs/. Each rung's timeline.png (and trace.json) is copied to
OUT/timelines/<run>.png; the table goes to OUT/ladder.{json,csv} unless --json/--csv (with
`--out FILE.json`, as docs/design.md#measuring writes it, the JSON is FILE.json and OUT is FILE).
The JSON has docs/design.md#measuring's shape: 'machine', 'command', and 'modes' {colocated, disagg,
gap, gap_tsp, gap_tsp_tag, gap_tsp_tag_tcss} of the first --variants entry ('modes_by_variant' has
each), next to every run's full row in 'rows'.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'launch'))
import sweep  # noqa: E402  (launch/ is not a package)

DEFAULT_CONFIG = 'configs/qwenimage.py:tiny_disagg'
RUNG_NAMES = ('colocated', 'disagg', 'gap', 'tsp', 'tag', 'tcss')
LABELS = {
    'colocated': 'colocated',
    'disagg': 'disagg',
    'gap': '+GAP',
    'tsp': '+TSP',
    'tag': '+TAG/BTS',
    'tcss': '+TCSS',
}
VARIANTS = ('mp2', 'sp', 'mp2u')
DEFAULT_VARIANTS = ('mp2', 'sp')
# docs/design.md#measuring: the ladder's JSON names each rung by the techniques it has on (the
# simulator's --json uses the same keys, so predicted and measured figures compare line by line).
MODE_KEYS = {
    'colocated': 'colocated',
    'disagg': 'disagg',
    'gap': 'gap',
    'tsp': 'gap_tsp',
    'tag': 'gap_tsp_tag',
    'tcss': 'gap_tsp_tag_tcss',
}
SCHEDULE_FIELDS = ('fragments', 'tsp', 'tag', 'tcss_fraction')


def rung_schedule(rung: str, fragments: int, tcss_fraction: float) -> dict[str, Any]:
  """The schedule.* settings of a rung: each rung turns on one more technique."""
  level = RUNG_NAMES.index(rung)
  return {
      'fragments': fragments if level >= 2 else 1,
      'tsp': level >= 3,
      'tag': level >= 4,
      'tcss_fraction': tcss_fraction if level >= 5 else 0.0,
  }


def rung_overrides(
    rung: str,
    has_field,
    *,
    fragments: int = 4,
    fragment_unit: str = 'sample',
    tcss_fraction: float = 0.5,
) -> tuple[str, ...]:
  """The rung's `--config.x=v` words. A technique that is on is always set (an unknown key then
  marks the rung invalid); one that is off only where the config has the field."""
  words = ['--config.runtime.mode=colocated'] if rung == 'colocated' else []
  off = {'fragments': 1, 'tsp': False, 'tag': False, 'tcss_fraction': 0.0}
  for field, value in rung_schedule(rung, fragments, tcss_fraction).items():
    if value != off[field] or has_field(f'schedule.{field}'):
      words.append(f'--config.schedule.{field}={value}')
    if field == 'fragments' and value != 1:
      words.append(f'--config.schedule.fragment_unit={fragment_unit}')
  if has_field('schedule.trace'):
    words.append('--config.schedule.trace=True')
  return tuple(words)


def build_runs(
    rungs: Sequence[str],
    variants: Sequence[str],
    has_field,
    *,
    devices: int = 1,
    common: Sequence[str] = (),
    **schedule: Any,
) -> list[tuple[sweep.Run, str, str]]:
  """[(Run, rung, variant)]: colocated once (variant '-'), then every other rung per variant.
  schedule: rung_overrides' fragments / fragment_unit / tcss_fraction."""
  out = []
  for rung in rungs:
    if rung != 'colocated':
      continue
    words = sweep.merge(common, rung_overrides(rung, has_field, **schedule))
    out.append((sweep.Run('colocated', words, 1, 2 * devices, pin=True), rung, '-'))
  for variant in variants:
    for rung in rungs:
      if rung == 'colocated':
        continue
      words = sweep.merge(common, rung_overrides(rung, has_field, **schedule))
      if variant in ('mp2', 'mp2u'):
        run = sweep.Run(f'{variant}-{rung}', words, 2, devices, pin=variant == 'mp2')
      else:
        run = sweep.Run(f'sp-{rung}', words, 1, 2 * devices, pin=True)
      out.append((run, rung, variant))
  return out


def add_ratios(rows: list[dict]) -> None:
  """x_colocated and x_disagg (samples/s over the colocated run's and the variant's naive disagg's)."""

  def sps(name):
    r = next((r for r in rows if r['name'] == name), None)
    return r['samples_per_s'] if r and r['status'] == 'ok' else None

  base = sps('colocated')
  for r in rows:
    disagg = sps(f'{r["variant"]}-disagg') if r['variant'] != '-' else None
    s = r['samples_per_s'] if r['status'] == 'ok' else None
    r['x_colocated'] = s / base if s is not None and base else None
    r['x_disagg'] = s / disagg if s is not None and disagg else None


def modes(rows: list[dict], variant: str) -> dict[str, dict]:
  """docs/design.md#measuring 'modes': {mode key: {samples_per_s, utilization, eval_strict_accuracy,
  ...}} of `variant`'s rungs (and the colocated baseline), for the rungs that ran."""
  out = {}
  for r in rows:
    if r['variant'] in ('-', variant) and r['status'] == 'ok':
      out[MODE_KEYS[r['rung']]] = {
          k: r.get(k)
          for k in (
              'samples_per_s',
              'utilization',
              'eval_strict_accuracy',
              'x_colocated',
              'x_disagg',
              'reward_mean',
              'layout',
          )
      }
  return out


def copy_timelines(rows: list[dict], out: str) -> None:
  """OUT/timelines/<run>.png and <run>.trace.json from each workdir, where the run wrote them."""
  dest = os.path.join(out, 'timelines')
  os.makedirs(dest, exist_ok=True)
  for r in rows:
    r['timeline'] = None
    for src, suffix, key in (
        ('timeline.png', '.png', 'timeline'),
        ('trace.json', '.trace.json', 'trace'),
    ):
      path = os.path.join(r['workdir'], src)
      if os.path.isfile(path):
        shutil.copyfile(path, os.path.join(dest, r['name'] + suffix))
        r[key] = os.path.join(dest, r['name'] + suffix)


TABLE = (
    ('label', 'rung'),
    ('variant', 'variant'),
    ('layout', 'procs x dev'),
    ('status', 'status'),
    ('steps', 'steps'),
    ('samples_per_s', 'samples/s'),
    ('x_colocated', 'x coloc'),
    ('x_disagg', 'x disagg'),
    ('utilization', 'util'),
    ('eval_strict_accuracy', 'eval acc'),
    ('reward_mean', 'reward'),
    ('wall_s', 'wall s'),
)
CSV_COLUMNS = (
    'name',
    'label',
    'variant',
    'layout',
    'status',
    'exit_code',
    'steps',
    'samples_per_s',
    'x_colocated',
    'x_disagg',
    'utilization',
    'eval_strict_accuracy',
    'eval_reward_mean',
    'reward_mean',
    'wall_s',
    'timeline',
    'overrides',
    'workdir',
    'log_tail',
)


def machine() -> dict:
  info = {
      'platform': platform.platform(),
      'python': platform.python_version(),
      'cpu_count': os.cpu_count(),
      'cores': sorted(os.sched_getaffinity(0)),
      'load_avg_1m': os.getloadavg()[0],
      'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
  }
  try:
    info['git_commit'] = subprocess.run(
        ['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True, timeout=10
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def parse_args(argv):
  p = sweep._Parser(
      prog='benchmarks/ladder.py',
      description=__doc__.split('\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument('--config', default=DEFAULT_CONFIG, help='a disagg config file[:variant]')
  p.add_argument(
      '--out',
      default='/tmp/digen_ladder',
      help='directory for workdirs, timelines and the table; or FILE.json '
      '(docs/design.md#measuring): the JSON goes there, everything else to FILE/ beside it',
  )
  p.add_argument('--steps', type=int, default=6, help='optimizer steps per rung (>= 2)')
  p.add_argument('--rungs', default=','.join(RUNG_NAMES), help=f'subset of {",".join(RUNG_NAMES)}')
  p.add_argument('--variants', default=','.join(DEFAULT_VARIANTS), help='subset of mp2,sp,mp2u')
  p.add_argument('--devices_per_process', type=int, default=1, help='D (sp and colocated get 2*D)')
  p.add_argument('--fragments', type=int, default=4, help='schedule.fragments of +GAP and up')
  p.add_argument(
      '--fragment_unit',
      default='sample',
      choices=('sample', 'group'),
      help='schedule.fragment_unit of +GAP and up (group: F must divide the prompts)',
  )
  p.add_argument('--tcss_fraction', type=float, default=0.5, help='schedule.tcss_fraction of +TCSS')
  p.add_argument(
      '--eval_prompts', type=int, default=8, help='eval prompts at the end (0 = no eval)'
  )
  p.add_argument(
      '--set',
      action='append',
      default=[],
      dest='common',
      help='--config.K=V for every rung (repeatable)',
  )
  p.add_argument('--timeout_s', type=float, default=900.0, help='per rung (0 = none)')
  p.add_argument('--json', default=None, help='default OUT/ladder.json')
  p.add_argument('--csv', default=None, help='default OUT/ladder.csv')
  a = p.parse_args(argv)
  if a.out.endswith('.json'):  # docs/design.md#measuring: `ladder.py --out FILE.json`
    a.json = a.json or a.out
    a.out = a.out[: -len('.json')]
  a.rungs = [r.strip() for r in a.rungs.split(',') if r.strip()]
  a.variants = [v.strip() for v in a.variants.split(',') if v.strip()]
  for r in a.rungs:
    if r not in RUNG_NAMES:
      raise sweep.SweepError(f'--rungs: unknown rung {r!r}; use a subset of {",".join(RUNG_NAMES)}')
  for v in a.variants:
    if v not in VARIANTS:
      raise sweep.SweepError(f'--variants: unknown variant {v!r}; use a subset of mp2,sp,mp2u')
  if not a.rungs or (a.rungs != ['colocated'] and not a.variants):
    raise sweep.SweepError('--rungs/--variants: nothing to run')
  if a.steps < 2:
    raise sweep.SweepError(
        f'--steps={a.steps}: need >= 2 (the first step compiles and is not timed)'
    )
  if a.devices_per_process < 1 or a.fragments < 1 or a.eval_prompts < 0:
    raise sweep.SweepError(
        '--devices_per_process and --fragments must be >= 1, --eval_prompts >= 0'
    )
  if not 0.0 < a.tcss_fraction <= 1.0:
    raise sweep.SweepError(f'--tcss_fraction={a.tcss_fraction} must be in (0, 1]')
  return a


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    a = parse_args(sweep._join_set(argv))
    config = sweep.load_config(a.config)

    def has_field(dotted: str) -> bool:
      return sweep.has_field(config, dotted)

    common = [f'--config.total_steps={a.steps}']
    if a.eval_prompts:
      common += [
          f'--config.eval.every={a.steps}',
          f'--config.eval.num_prompts={a.eval_prompts}',
          '--config.eval.samples_per_prompt=2',
      ]
    else:  # the config's own eval (e.g. shapes' every 50 steps, and the base at step 0) too
      common += ['--config.eval.every=0']
    common = sweep.merge(common, a.common)  # the user's --set wins
    bad = sweep.missing_keys(config, sweep.Run('common', common))
    if bad:
      raise sweep.SweepError(f'{a.config} has no field ' + ', '.join(f'config.{k}' for k in bad))
    plan = build_runs(
        a.rungs,
        a.variants,
        has_field,
        devices=a.devices_per_process,
        common=common,
        fragments=a.fragments,
        fragment_unit=a.fragment_unit,
        tcss_fraction=a.tcss_fraction,
    )
    runs = [run for run, _, _ in plan]
    invalid = sweep.check_keys(a.config, runs)
  except sweep.SweepError as e:
    print(f'ladder: {e}', file=sys.stderr)
    return 2

  root = os.path.join(a.out, 'runs')
  info = machine()
  print(
      f'[ladder] {a.config}, {a.steps} steps per rung, {len(runs)} runs, cores {info["cores"]}, '
      f'load {info["load_avg_1m"]:.2f}',
      flush=True,
  )
  t0 = time.time()
  code = 0
  try:
    rows = sweep.run_sweep(
        runs, a.config, root, parallel=1, fresh=True, timeout_s=a.timeout_s, invalid=invalid
    )
  except sweep.Interrupted as e:
    code, rows = 128 + e.signum, e.rows
  for row, (run, rung, variant) in zip(rows, plan):
    row.update(
        rung=rung,
        label=LABELS[rung],
        variant=variant,
        layout=f'{run.num_processes}x{run.devices_per_process}',
    )
  add_ratios(rows)
  copy_timelines(rows, a.out)
  info['load_avg_1m_after'] = os.getloadavg()[0]
  print(
      f'\nladder: {a.config}, {a.steps} steps, load avg {info["load_avg_1m"]:.2f} -> '
      f'{info["load_avg_1m_after"]:.2f}; x coloc / x disagg = samples/s over colocated / over '
      "the same variant's naive disagg"
  )
  print(sweep.format_table(rows, TABLE), flush=True)
  json_path = a.json or os.path.join(a.out, 'ladder.json')
  csv_path = a.csv or os.path.join(a.out, 'ladder.csv')
  primary = a.variants[0] if a.variants else '-'
  sweep.write_json(
      json_path,
      {
          'config': a.config,
          'steps': a.steps,
          'argv': argv,
          'command': ' '.join(['python', 'benchmarks/ladder.py'] + argv),
          'machine': info,
          'wall_s': time.time() - t0,
          'variant': primary,
          'modes': modes(rows, primary),
          'modes_by_variant': {v: modes(rows, v) for v in a.variants},
          'rows': rows,
      },
  )
  sweep.write_csv(csv_path, rows, CSV_COLUMNS)
  print(f'[ladder] {json_path} {csv_path} {os.path.join(a.out, "timelines")}')
  if code:
    return code
  return 0 if all(r['status'] == 'ok' for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
