"""Strict accuracy of a ShapesBench run's evals, broken down by prompt kind and count.

  python benchmarks/shapes_eval_breakdown.py RUN_DIR [--json OUT.json]

Reads every RUN_DIR/eval/eval_<step>.json (written by each eval of a run; `per_prompt` holds each
prompt's strict pass rate) and prints, per eval step, the pass rate over all prompts, over the
single-object prompts (and per count 1/2/3) and over the relation prompts; then the same per
held-out (colour, shape) pair: the pass rate of the prompts that hold it. On the eval split every
prompt holds a (colour, shape) pair the base never saw; the single-object ones, counts 2-3 above
all, are also absent from the 'rl' split RL draws from, so they show whether a gain carries over to
compositions RL never trained on. The per-pair table shows which pairs RL learnt to draw (a pair
the base almost never draws, e.g. a red circle, may stay near 0 while the others rise).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from digen_jax.tasks.shapes import grammar  # noqa: E402


def group_of(p: grammar.ShapesPrompt) -> str:
  return 'relation' if p.is_relation else f'single_count{p.objects[0].count}'


def pair_name(pair: tuple[str, str]) -> str:
  return f'{pair[0]}_{pair[1]}'


PAIR_COLUMNS = [pair_name(p) for p in sorted(grammar.HELD_OUT_PAIRS)]


def breakdown(per_prompt: dict[str, dict[str, float]]) -> dict[str, float]:
  """{'all', 'single', 'single_count1..3', 'relation', '<colour>_<shape>' for each held-out pair
  a prompt holds} -> mean strict pass rate (each prompt has the same number of samples, so the
  mean of per-prompt rates is the sample pass rate), plus 'n_<group>' prompt counts."""
  groups: dict[str, list[float]] = {}
  for prompt, d in per_prompt.items():
    parsed = grammar.parse(prompt)
    g = group_of(parsed)
    keys = ['all', g] + (['single'] if g.startswith('single') else [])
    keys += [pair_name(p) for p in sorted(parsed.pairs() & grammar.HELD_OUT_PAIRS)]
    for key in keys:
      groups.setdefault(key, []).append(float(d['pass_rate']))
  out = {k: sum(v) / len(v) for k, v in sorted(groups.items())}
  out.update({f'n_{k}': len(v) for k, v in sorted(groups.items())})
  return out


def print_table(table: dict[int, dict[str, float]], cols: list[str]) -> None:
  """One row per eval step, one column per group, pass rates in percent."""
  width = max(13, *(len(c) for c in cols))
  print('step  ' + '  '.join(f'{c:>{width}}' for c in cols))
  for step, row in table.items():
    print(
        f'{step:>4}  '
        + '  '.join(f'{100 * row.get(c, float("nan")):{width - 1}.2f}%' for c in cols)
    )


def main(argv=None) -> dict[int, dict[str, float]]:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('run_dir')
  ap.add_argument('--json', default='', help='also write the table here')
  args = ap.parse_args(argv)
  files = sorted(glob.glob(os.path.join(args.run_dir, 'eval', 'eval_*.json')))
  if not files:
    raise SystemExit(f'no eval/eval_*.json under {args.run_dir}: is it a run directory?')
  table = {}
  for f in files:
    d = json.load(open(f))
    if 'per_prompt' not in d:
      raise SystemExit(f'{f} has no per_prompt field (written by digen_jax.experiment.evaluation)')
    table[int(d['step'])] = breakdown(d['per_prompt'])
  cols = ['all', 'single', 'single_count1', 'single_count2', 'single_count3', 'relation']
  print_table(table, cols)
  print('\nby held-out pair (prompts that hold it)')
  print_table(table, PAIR_COLUMNS)
  if args.json:
    with open(args.json, 'w') as fh:
      json.dump(table, fh, indent=1)
  return table


if __name__ == '__main__':
  main()
