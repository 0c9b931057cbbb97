"""The simulator against measured runs: per scenario, profile this machine's
programs (python -m digen_jax.perf.profile), run the real ladder (benchmarks/ladder.py), predict
the same rungs with the simulator (python -m digen_jax.perf) and compare samples/s and
utilization line by line. Nothing is fitted to the ladder's figures: the simulator sees only
the profile.

    python benchmarks/sim_validation.py --out /tmp/simval                    # every scenario
    python benchmarks/sim_validation.py --out /tmp/simval --scenarios small  # the CI-size one
    python benchmarks/sim_validation.py --out /tmp/simval --scenarios balanced --variants mp2

Scenarios (configs/shapes.py:pixel,disagg, B = prompts x 8 samples):
  balanced       the ladder headline: 16 prompts, M = 16 groups, 11 sampler steps, 1/4 of the
                 steps trained; colocated, mp2 and sp, every rung
  rollout_bound  1/8 of the steps trained (the trainer waits for fragments), mp2
  trainer_bound  1/2 of the steps trained (the rollout waits for the policy), mp2
  hetero         balanced, with the rollout's core shared with a CPU hog started first (the
                 rollout process gets about half a core: a slower rollout device), mp2
  small          8 prompts, M = 8, 8 sampler steps, mp2 disagg and GAP+TSP+TAG (the CI test;
                 8 steps: the first steps after compiling run slower, and BTS is still
                 profiling its costs)

The programs are profiled twice, just before and just after the ladder, and the simulator sees
each program's mean of the two (a drift of the machine's speed over the ladder cancels to first
order; the comparison's 'drift' holds each program's after / before).

Output: OUT/<scenario>/{profile_before.json, profile_after.json, profile.json (their mean),
ladder.json, sim.json} and OUT/validation.json with every line, the mean absolute and largest
relative error of samples/s per scenario and overall.
Each rung whose roles do not share cores is also simulated at its measured spans (the programs'
mean times in the run's trace instead of the profile's, python -m digen_jax.perf --measured):
what is left of the error then is the schedule's and the host work's, not the programs' times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from digen_jax.perf import predict  # noqa: E402

CONFIG = 'configs/shapes.py:pixel,disagg'


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  sets: tuple[str, ...]  # --config.k=v of every run
  fragments: int
  rungs: tuple[str, ...]
  variants: tuple[str, ...]
  steps: int = 6
  hog_rollout_core: bool = False


BALANCED = (
    '--config.rl.timestep_fraction=0.25',
    '--config.sampler.num_steps=11',
    '--config.rl.prompts_per_step=16',
)
SCENARIOS = {
    'balanced': Scenario('balanced', BALANCED, 16, predict.RUNGS, ('mp2', 'sp')),
    'rollout_bound': Scenario(
        'rollout_bound',
        (
            '--config.rl.timestep_fraction=0.12',
            '--config.sampler.num_steps=11',
            '--config.rl.prompts_per_step=16',
        ),
        16,
        predict.RUNGS[1:],
        ('mp2',),
    ),
    'trainer_bound': Scenario(
        'trainer_bound',
        (
            '--config.rl.timestep_fraction=0.5',
            '--config.sampler.num_steps=11',
            '--config.rl.prompts_per_step=16',
        ),
        16,
        predict.RUNGS[1:],
        ('mp2',),
    ),
    'hetero': Scenario('hetero', BALANCED, 16, predict.RUNGS[1:], ('mp2',), hog_rollout_core=True),
    'small': Scenario(
        'small',
        (
            '--config.rl.timestep_fraction=0.25',
            '--config.sampler.num_steps=8',
            '--config.rl.prompts_per_step=8',
        ),
        8,
        ('colocated', 'disagg', 'tag'),
        ('mp2',),
        steps=8,
    ),
}


@contextlib.contextmanager
def cpu_hog(core: int | None):
  """A busy loop pinned to `core` for the duration (None: nothing)."""
  if core is None:
    yield
    return
  proc = subprocess.Popen(
      [sys.executable, '-c', 'while True: pass'], preexec_fn=lambda: os.sched_setaffinity(0, {core})
  )
  try:
    yield
  finally:
    proc.kill()
    proc.wait()


def _run(cmd: list[str], log: str) -> None:
  env = dict(
      os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get('PYTHONPATH')) if p)
  )
  with open(log, 'w') as f:
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
  if done.returncode:
    with open(log) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f'{" ".join(cmd[:4])} ... failed (exit {done.returncode}):\n{tail}')


def layouts_of(s: Scenario) -> list[str]:
  return (['colocated'] if 'colocated' in s.rungs else []) + list(s.variants)


def fragment_grads_of(s: Scenario) -> list[str]:
  """The fragment gradients the scenario's rungs train with (perf/profile.py --fragment_grads):
  plain for gap, TSP's for the rungs above it; TSP's alone when no rung trains fragments (the
  flag takes at least one)."""
  levels = {predict.RUNGS.index(r) for r in s.rungs}
  gap, tsp = predict.RUNGS.index('gap'), predict.RUNGS.index('tsp')
  grads = (['plain'] if gap in levels else []) + (['tsp'] if max(levels) >= tsp else [])
  return grads or ['tsp']


def run_scenario(
    s: Scenario,
    out: str,
    *,
    python: str = sys.executable,
    predict_only: bool = False,
    before: str | None = None,
) -> dict:
  """Profile, ladder, profile again and prediction of one scenario. Returns its comparison.
  predict_only: reuse OUT/<scenario>'s profile and ladder (e.g. after a change to the
  simulator). before: a profile just taken (a previous attempt's profile_after.json) serves as
  this one's profile before the ladder."""
  d = os.path.join(out, s.name)
  os.makedirs(d, exist_ok=True)
  if predict_only:
    return _predict(s, d, python, 0.0, 0.0)
  cores = sorted(os.sched_getaffinity(0))
  hog = cores[1 % len(cores)] if s.hog_rollout_core else None  # mp2 pins the rollout there
  t0 = time.time()
  with cpu_hog(hog):
    # The programs are profiled before and after the ladder and the simulator sees their mean:
    # the machine's speed drifts by 10-20 % over minutes (RESULTS.md), and a drift over the
    # ladder then cancels to first order.
    if before is None:
      _run(_profile_command(s, d, python, 'before'), f'{d}/profile_before.log')
    else:
      shutil.copyfile(before, f'{d}/profile_before.json')
    t_profile = time.time() - t0
    ladder = [
        python,
        'benchmarks/ladder.py',
        '--config',
        CONFIG,
        '--out',
        f'{d}/ladder.json',
        '--steps',
        str(s.steps),
        '--fragments',
        str(s.fragments),
        '--fragment_unit',
        'group',
        '--rungs',
        ','.join(s.rungs),
        '--variants',
        ','.join(s.variants),
        '--eval_prompts',
        '0',
    ]
    for word in s.sets:
      ladder += ['--set', word]
    _run(ladder, f'{d}/ladder.log')
    t_ladder = time.time() - t0 - t_profile
    _run(_profile_command(s, d, python, 'after'), f'{d}/profile_after.log')
    t_profile = time.time() - t0 - t_ladder
  profiles = []
  for when in ('before', 'after'):
    with open(f'{d}/profile_{when}.json') as f:
      profiles.append(json.load(f))
  with open(f'{d}/profile.json', 'w') as f:
    json.dump(mean_profile(*profiles), f, indent=1)
  cmp = _predict(s, d, python, t_profile, t_ladder)
  cmp['drift'] = profile_drift(*profiles)
  return cmp


def _profile_command(s: Scenario, d: str, python: str, when: str) -> list[str]:
  return [
      python,
      '-m',
      'digen_jax.perf.profile',
      f'--config={CONFIG}',
      *s.sets,
      # The runs' step count: the learning-rate schedule is part of the update and apply
      # programs, so the ladder's runs then load them from the compilation cache.
      f'--config.total_steps={s.steps}',
      f'--out={d}/profile_{when}.json',
      f'--layouts={",".join(layouts_of(s))}',
      f'--fragment_grads={",".join(fragment_grads_of(s))}',
      f'--fragments={s.fragments}',
      '--fragment_unit=group',
  ]


def mean_profile(before: dict, after: dict) -> dict:
  """One profile (perf/profile.py's JSON) from two of the same programs: each key's mean
  seconds; `after`'s machine as machine_after."""
  if before['layouts'].keys() != after['layouts'].keys():
    raise ValueError(
        f'profiles of other layouts: {sorted(before["layouts"])} vs {sorted(after["layouts"])}'
    )
  layouts = {}
  for name, b in before['layouts'].items():
    a = after['layouts'][name]
    if b['seconds'].keys() != a['seconds'].keys():
      raise ValueError(f'layout {name!r}: the two profiles timed other programs')
    seconds = {k: (v + a['seconds'][k]) / 2 for k, v in b['seconds'].items()}
    layouts[name] = dict(b, seconds=seconds)
  return dict(before, layouts=layouts, machine_after=after.get('machine'))


def profile_drift(before: dict, after: dict) -> dict[str, float]:
  """after / before seconds of each layout's sampling and training programs (layout/key)."""
  main = ('rollout/', 'grad', 'update/', 'tag_rollout/')
  return {
      f'{name}/{k}': after['layouts'][name]['seconds'][k] / v
      for name, b in before['layouts'].items()
      for k, v in b['seconds'].items()
      if k.startswith(main) and v > 0
  }


def _predict(s: Scenario, d: str, python: str, t_profile: float, t_ladder: float) -> dict:
  _run(
      [
          python,
          '-m',
          'digen_jax.perf',
          f'--profile={d}/profile.json',
          f'--json={d}/sim.json',
          '--steps',
          str(s.steps),
          '--rungs',
          ','.join(s.rungs),
          '--variants',
          ','.join(s.variants),
          '--fragments',
          str(s.fragments),
          '--measured',
          f'{d}/ladder.json',
          '--timelines',
          f'{d}/timelines',
      ],
      f'{d}/sim.log',
  )
  with open(f'{d}/sim.json') as f:
    cmp = json.load(f)['comparison']
  cmp.update(scenario=s.name, profile_s=t_profile, ladder_s=t_ladder)
  return cmp


def summarize(results: list[dict]) -> dict:
  lines = [dict(x, scenario=r['scenario']) for r in results for x in r['lines']]
  errs = [abs(x['sps_error']) for x in lines]
  return {
      'lines': lines,
      'sps_mae': sum(errs) / len(errs),
      'sps_max': max(errs),
      'scenarios': {
          r['scenario']: {
              k: r[k] for k in ('sps_mae', 'sps_max', 'util_mae', 'profile_s', 'ladder_s')
          }
          for r in results
      },
  }


def markdown(summary: dict) -> str:
  out = [
      '| scenario | variant | mode | measured samples/s | predicted | error | util measured '
      '| util predicted | at measured spans | error | spans / profile |',
      '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for x in summary['lines']:
    at = '| - | - | - |'
    if 'sps_at_spans' in x:
      ratios = ', '.join(f'{k} {v:.2f}' for k, v in x['spans_vs_profile'].items())
      at = f'| {x["sps_at_spans"]:.2f} | {100 * x["sps_error_at_spans"]:+.1f}% | {ratios} |'
    out.append(
        f'| {x["scenario"]} | {x["variant"]} | {x["mode"]} | {x["measured_sps"]:.2f} | '
        f'{x["predicted_sps"]:.2f} | {100 * x["sps_error"]:+.1f}% | '
        f'{x["measured_util"]:.3f} | {x["predicted_util"]:.3f} {at}'
    )
  out.append(
      f'\nsamples/s: mean |error| {100 * summary["sps_mae"]:.1f}%, largest '
      f'{100 * summary["sps_max"]:.1f}%'
  )
  at = [abs(x['sps_error_at_spans']) for x in summary['lines'] if 'sps_error_at_spans' in x]
  if at:
    out.append(
        f'at the measured spans ({len(at)} rungs): mean |error| '
        f'{100 * sum(at) / len(at):.1f}%, largest {100 * max(at):.1f}%'
    )
  return '\n'.join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', required=True)
  p.add_argument('--scenarios', default='balanced,rollout_bound,trainer_bound,hetero')
  p.add_argument(
      '--predict_only',
      action='store_true',
      help="re-predict from OUT/<scenario>'s profile and ladder (runs nothing)",
  )
  p.add_argument(
      '--variants',
      default='',
      help="only these of each scenario's variants, e.g. mp2 ('': all of them)",
  )
  a = p.parse_args(argv)
  names = [n for n in a.scenarios.split(',') if n]
  bad = [n for n in names if n not in SCENARIOS]
  if bad or not names:
    p.error(f'--scenarios: unknown {bad}; use a subset of {",".join(SCENARIOS)}')
  only = [v for v in a.variants.split(',') if v]
  if [v for v in only if v not in predict.VARIANTS]:
    p.error(f'--variants={a.variants}: use a subset of {",".join(predict.VARIANTS)}')
  scenarios = {n: SCENARIOS[n] for n in names}
  if only:
    scenarios = {
        n: dataclasses.replace(s, variants=tuple(v for v in s.variants if v in only))
        for n, s in scenarios.items()
    }
    empty = [n for n, s in scenarios.items() if not s.variants]
    if empty:
      p.error(f'--variants={a.variants}: scenario(s) {empty} have none of them')
  os.makedirs(a.out, exist_ok=True)
  results = []
  for n in names:
    print(f'[validation] {n} ...', flush=True)
    results.append(run_scenario(scenarios[n], a.out, predict_only=a.predict_only))
    r = results[-1]
    print(
        f'[validation] {n}: mean |error| {100 * r["sps_mae"]:.1f}%, largest '
        f'{100 * r["sps_max"]:.1f}% (profile {r["profile_s"]:.0f}s, ladder '
        f'{r["ladder_s"]:.0f}s)',
        flush=True,
    )
  summary = summarize(results)
  summary['command'] = ' '.join(
      ['python benchmarks/sim_validation.py'] + (sys.argv[1:] if argv is None else list(argv))
  )
  summary['date'] = time.strftime('%Y-%m-%d %H:%M:%S %Z')
  with open(os.path.join(a.out, 'validation.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  print(markdown(summary))
  return 0


if __name__ == '__main__':
  sys.exit(main())
