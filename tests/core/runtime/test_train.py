"""End-to-end checks of the CLI: metrics, sample grids, the periodic eval and the eval CLI. Exact
resume is tests/core/process/test_interrupt.py's (a signal, and a clean stop resumed with more steps); bad
input to the CLIs is tests/core/process/test_fuzz_cli.py's."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


def _cli(workdir, *flags):
  cmd = [sys.executable, '-m', 'digen_jax.main', f'--workdir={workdir}', *flags]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_writes_metrics_samples_and_evals_and_the_eval_cli_agrees(tmp_path, plots):
  """One CLI run checks the training rows, the sample grid, TensorBoard, the progress line, the
  periodic eval and its report; then the eval CLI reproduces the in-training eval."""
  wd = tmp_path / 'run'
  small_eval = [
      '--config.eval.num_prompts=4',
      '--config.eval.samples_per_prompt=2',
      '--config.eval.batch_size=8',
  ]
  r = _cli(
      wd,
      '--config=configs/qwenimage.py:tiny',
      '--config.total_steps=2',
      '--config.sample_grid_every=2',
      '--config.eval.every=2',
      *small_eval,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'ETA' in r.stderr
  rows = [json.loads(l) for l in open(wd / 'metrics.jsonl')]
  train = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2]
  for key in (
      'step',
      'policy_version',
      'reward_mean',
      'reward_std',
      'loss',
      'approx_kl',
      'clip_frac',
      'ratio_mean',
      'samples',
      'samples_per_s',
      'wall_s',
      'utilization',
  ):
    assert key in train[0], key
  # On-policy first epoch: the importance ratio is 1 to float32 rounding.
  assert all(abs(r['ratio_mean'] - 1.0) < 1e-5 for r in train)
  assert os.path.exists(wd / 'samples' / 'step_000002.png')
  assert os.listdir(wd / 'tensorboard')
  evals = [r for r in rows if 'eval/strict_accuracy' in r]
  assert [e['step'] for e in evals] == [0, 2]
  assert len(rows) == len(train) + len(evals)  # every row is a training step's or an eval's
  assert {e['eval/num_prompts'] for e in evals} == {4}
  for f in ('reward.png', 'summary.json', 'eval/eval_000000.png', 'eval/eval_000002.json'):
    assert os.path.exists(wd / f), f
  summary = json.load(open(wd / 'summary.json'))
  assert summary['steps'] == 2 and summary['final_eval_step'] == 2
  # The standalone eval of the final checkpoint reproduces the in-training eval exactly.
  r = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.eval',
          f'--workdir={wd}',
          '--config=configs/qwenimage.py:tiny',
          *small_eval,
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  last = [json.loads(l) for l in open(wd / 'metrics.jsonl')][-1]
  assert last['step'] == 2
  assert last['eval/reward_mean'] == evals[-1]['eval/reward_mean']
