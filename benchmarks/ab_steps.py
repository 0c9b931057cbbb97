"""A/B of a run's step time between this checkout and a git revision, alternating on one host.

    python benchmarks/ab_steps.py --rev 5de0aec --rounds 3 -- \
        --config=configs/shapes.py --config.total_steps=12 --config.eval.every=0

Each round runs `python -m digen_jax.main ARGS` once in this checkout (A) and once in a worktree
of --rev (B), A and B in turn (alternating, so a drift of the machine's speed hits both), each on
a fresh workdir, and reads metrics.jsonl: the median wall_s of the steps after the first (which
compiles). Prints per round both medians and their ratio A/B, then the median ratio; --json
writes them. Both sides run from their own tree with the same Python and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_seconds(tree: str, args: list[str], workdir: str) -> float:
  """Median wall_s of the steps after the first of one run of `tree`'s main entry point."""
  env = dict(os.environ, PYTHONPATH=tree, DIGEN_PLOTS='0')
  cmd = [sys.executable, '-m', 'digen_jax.main', f'--workdir={workdir}', *args]
  done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f'{tree}: exit {done.returncode}\n{done.stderr[-3000:]}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  walls = [r['wall_s'] for r in rows if 'reward_mean' in r and r['step'] > 1]
  if not walls:
    raise RuntimeError(f'{tree}: no step after the first in {workdir}')
  return statistics.median(walls)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--rev', required=True, help='the git revision B runs (a worktree of it)')
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--json', default='')
  p.add_argument('args', nargs='*', help='digen_jax.main arguments (after --)')
  a = p.parse_args(argv)
  out = {'command': ' '.join(['python benchmarks/ab_steps.py', *sys.argv[1:]]), 'rounds': []}
  with tempfile.TemporaryDirectory(prefix='digen_ab_') as tmp:
    tree_b = os.path.join(tmp, 'b')
    subprocess.run(['git', 'worktree', 'add', '--detach', tree_b, a.rev], cwd=REPO, check=True)
    try:
      for r in range(a.rounds):
        t_a = step_seconds(REPO, a.args, os.path.join(tmp, f'a{r}'))
        t_b = step_seconds(tree_b, a.args, os.path.join(tmp, f'b{r}'))
        out['rounds'].append({'a_step_s': t_a, 'b_step_s': t_b, 'ratio': t_a / t_b})
        print(f'round {r + 1}: A {t_a:.4f}s  B {t_b:.4f}s  A/B {t_a / t_b:.3f}', flush=True)
    finally:
      subprocess.run(['git', 'worktree', 'remove', '--force', tree_b], cwd=REPO, check=False)
  out['median_ratio'] = statistics.median(x['ratio'] for x in out['rounds'])
  out['date'] = time.strftime('%Y-%m-%d %H:%M %Z')
  print(f'median A/B step time: {out["median_ratio"]:.3f}')
  if a.json:
    with open(a.json, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  main()
