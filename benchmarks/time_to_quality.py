"""Time to quality on ShapesBench: each objective's runs (seeds), then one table of the wall
seconds and samples each needs to reach given eval strict accuracies, and its accuracy at the
baseline's wall budget and at a step count.

  python benchmarks/time_to_quality.py --out DIR \
      --runs grpo=configs/shapes.py,nft=configs/shapes.py:nft,awm=configs/shapes.py:awm \
      --seeds 0,1,2 [--split eval] [--steps 300] [--every 50] [--baseline grpo] [--only_table]
      [--config.k=v ...]                  # for every run; a run's own: NAME=CONFIG|--config.k=v

Each run is `python -m digen_jax.main --config=CONFIG --workdir=DIR/NAME_sSEED` with
--config.seed, --config.total_steps, --config.eval.every and --config.eval.split set, one at a
time (their wall times are comparable only when nothing else runs beside them). A workdir that
already holds a finished run is read, not rerun (the same command resumes an unfinished one).
Settings are chosen with --split val; the table to report is --split eval.

Wall seconds are the training steps' own (metrics.jsonl wall_s: sample, score, update; the first
step's compilation included), summed up to the eval that first reaches the accuracy; evals are
not counted. Samples: steps x the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

THRESHOLDS = (0.35, 0.40, 0.45)


def _run(name: str, config: str, seed: int, args) -> str:
  workdir = os.path.join(args.out, f'{name}_s{seed}')
  if _finished(workdir, args.steps):
    return workdir
  config, *own = config.split('|')  # a run's own flags: name=CONFIG|--config.k=v|...
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.main',
      f'--config={config}',
      *own,
      f'--workdir={workdir}',
      f'--config.seed={seed}',
      f'--config.total_steps={args.steps}',
      f'--config.eval.every={args.every}',
      f'--config.eval.split={args.split}',
      '--config.sample_grid_every=0',
      *args.extra,
  ]
  print(' '.join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  return workdir


def _rows(workdir: str) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _finished(workdir: str, steps: int) -> bool:
  return any(r.get('step') == steps and 'eval/strict_accuracy' in r for r in _rows(workdir))


def curve(workdir: str) -> dict:
  """{'evals': [(step, accuracy, wall seconds before it, samples)], 'wall': total, 'batch'}."""
  rows = _rows(workdir)
  train = {r['step']: r for r in rows if 'reward_mean' in r}  # a resume's rows supersede
  evals = {r['step']: r['eval/strict_accuracy'] for r in rows if 'eval/strict_accuracy' in r}
  batch = next(iter(train.values()))['samples'] if train else 0
  out = []
  for step in sorted(evals):
    wall = sum(train[s]['wall_s'] for s in train if s <= step)
    out.append((step, evals[step], wall, step * batch))
  return {'evals': out, 'wall': sum(r['wall_s'] for r in train.values()), 'batch': batch}


def _first(c: dict, threshold: float):
  return next(((w, n) for _, a, w, n in c['evals'] if a >= threshold), None)


def _at_wall(c: dict, budget: float):
  """The accuracy of the last eval reached within `budget` wall seconds."""
  done = [a for _, a, w, _ in c['evals'] if w <= budget]
  return done[-1] if done else None


def targets(curves: dict, baseline: str, steps: int) -> str:
  """The issue's two targets per objective: (1) it reaches the baseline's mean final accuracy
  within a third of the baseline's wall time on every seed; (2) its accuracy at the baseline's
  wall budget is at least 35 points over the base (step 0) on every seed."""
  base_runs = {seed: c for (name, seed), c in curves.items() if name == baseline}
  finals = [next((a for s, a, _, _ in c['evals'] if s == steps), None) for c in base_runs.values()]
  if not base_runs or None in finals:
    return f'(targets need every {baseline} run finished at step {steps})'
  mean_final = sum(finals) / len(finals)
  walls = ', '.join(f'{c["wall"]:.0f}' for c in base_runs.values())
  lines = [
      f'{baseline} mean final accuracy {100 * mean_final:.2f} % over seeds '
      f'{sorted(base_runs)}; its wall {walls} s',
      '',
      f'| run | s to {100 * mean_final:.2f} % (/ {baseline} wall) | <= 1/3? | at {baseline} wall: '
      'points over base | >= +35? |',
      '|---|---|---|---|---|',
  ]
  for (name, seed), c in sorted(curves.items()):
    if name == baseline or seed not in base_runs:
      continue
    wall = base_runs[seed]['wall']
    hit = _first(c, mean_final)
    base_acc = c['evals'][0][1] if c['evals'] and c['evals'][0][0] == 0 else None
    at = _at_wall(c, wall)
    gain = None if at is None or base_acc is None else 100 * (at - base_acc)
    frac = None if hit is None else hit[0] / wall
    lines.append(
        f'| {name} s{seed} | '
        + ('-' if hit is None else f'{hit[0]:.0f} ({frac:.2f})')
        + f' | {"yes" if frac is not None and frac <= 1 / 3 else "no"} | '
        + ('-' if gain is None else f'{gain:+.2f}')
        + f' | {"yes" if gain is not None and gain >= 35 else "no"} |'
    )
  return '\n'.join(lines)


def table(curves: dict, baseline: str, steps: int) -> str:
  """Markdown: one row per (objective, seed)."""
  head = (
      '| run | '
      + ' | '.join(f'to {int(t * 100)} %: s / samples' for t in THRESHOLDS)
      + f' | at {baseline} wall | at step {steps} | curve (step: %) |'
  )
  lines = [head, '|' + '---|' * (len(THRESHOLDS) + 4)]
  for (name, seed), c in sorted(curves.items()):
    base = curves.get((baseline, seed))
    cells = []
    for t in THRESHOLDS:
      hit = _first(c, t)
      cells.append('-' if hit is None else f'{hit[0]:.0f} / {hit[1]}')
    at_base = _at_wall(c, base['wall']) if base else None
    final = next((a for s, a, _, _ in c['evals'] if s == steps), None)
    fmt = lambda a: '-' if a is None else f'{100 * a:.2f}'
    pts = ', '.join(f'{s}: {100 * a:.1f}' for s, a, _, _ in c['evals'])
    lines.append(
        f'| {name} s{seed} | ' + ' | '.join(cells) + f' | {fmt(at_base)} | {fmt(final)} | {pts} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--out', required=True)
  p.add_argument('--runs', required=True, help='name=config,... (configs/shapes.py:nft etc.)')
  p.add_argument('--seeds', default='0')
  p.add_argument('--split', default='eval', choices=('eval', 'val'))
  p.add_argument('--steps', type=int, default=300)
  p.add_argument('--every', type=int, default=50)
  p.add_argument('--baseline', default='grpo')
  p.add_argument('--only_table', action='store_true', help='read the workdirs, run nothing')
  args, args.extra = p.parse_known_args(argv)  # further --config.k=v flags: every run's
  runs = dict(item.split('=', 1) for item in args.runs.split(','))
  seeds = [int(s) for s in args.seeds.split(',')]
  curves = {}
  for seed in seeds:
    for name, config in runs.items():
      workdir = os.path.join(args.out, f'{name}_s{seed}')
      if not args.only_table:
        _run(name, config, seed, args)
      if _rows(workdir):
        curves[(name, seed)] = curve(workdir)
  text = (
      table(curves, args.baseline, args.steps) + '\n\n' + targets(curves, args.baseline, args.steps)
  )
  print(text)
  with open(os.path.join(args.out, 'time_to_quality.md'), 'w') as f:
    f.write(text + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
