"""What metrics.jsonl, TensorBoard and the summary report of a run: each reward's own mean and
std beside the combined reward, and time figures that say what they cover."""

import json
import subprocess
import sys

import numpy as np
import pytest

from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import report
from digen_jax.runtime import bookkeeping
from tests.helpers import tb_events
from tests.helpers.paths import REPO


def test_reward_part_metrics_of_several_rewards_and_none_for_one():
  parts = np.array([[0.0, 1.0, 2.0, np.nan], [1.0, 1.0, 1.0, 1.0]], np.float32)
  got = bookkeeping.reward_part_metrics(['a', 'b'], parts)
  assert got == pytest.approx(
      {
          'reward/a_mean': 1.0,
          'reward/a_std': np.std([0.0, 1.0, 2.0]),
          'reward/b_mean': 1.0,
          'reward/b_std': 0.0,
      }
  )
  assert bookkeeping.reward_part_metrics(['a'], parts[:1]) == {}
  assert bookkeeping.reward_part_metrics([], None) == {}


def test_summary_time_figures_say_what_they_cover(tmp_path, capsys):
  writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  for step, wall in ((1, 40.0), (2, 1.0), (3, 3.0)):
    writer.write({'step': step, 'reward_mean': 0.5, 'wall_s': wall, 'time': 100.0 + step})
  writer.close()
  summary = report.finish(str(tmp_path))
  assert summary['steps_s'] == 44.0 and summary['first_step_s'] == 40.0
  assert summary['later_step_mean_s'] == 2.0 and summary['rows_span_s'] == 2.0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith('digen_jax summary: steps=3, steps_s=44,')
  assert out[1].startswith('digen_jax summary times: steps_s: ')
  for key in ('steps_s', 'first_step_s', 'later_step_mean_s', 'rows_span_s'):
    assert f'{key}: ' in out[1], key
  saved = json.load(open(tmp_path / 'summary.json'))
  assert saved['time_figures'] == report.TIME_FIGURES and saved['steps_s'] == 44.0


@pytest.mark.slow
def test_a_run_with_two_rewards_logs_each(tmp_path):
  """configs/qwenimage.py:tiny rewarded by JPEG compressibility + 0.5 x ShapesBench: every step's
  row holds each reward's mean/std, their weighted sum is reward_mean, TensorBoard has them."""
  wd = tmp_path / 'run'
  r = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.main',
          f'--workdir={wd}',
          '--config=configs/qwenimage.py:tiny',
          '--config.total_steps=2',
          '--config.reward.weights=jpeg_compressibility:1,shapes:0.5',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in open(wd / 'metrics.jsonl') if 'reward_mean' in l]
  assert [x['step'] for x in rows] == [1, 2]
  for row in rows:
    jpeg, shapes = row['reward/jpeg_compressibility_mean'], row['reward/shapes_mean']
    assert row['reward_mean'] == pytest.approx(jpeg + 0.5 * shapes, rel=1e-5, abs=1e-6)
    assert row['reward/jpeg_compressibility_std'] >= 0 and row['reward/shapes_std'] >= 0
  tb = tb_events.scalars(str(wd / 'tensorboard'))
  for tag in ('reward/jpeg_compressibility_mean', 'reward/shapes_std', 'reward_mean'):
    assert sorted(tb[tag]) == [1, 2], tag
  assert tb['reward/shapes_mean'][2] == pytest.approx(rows[1]['reward/shapes_mean'])
  assert 'digen_jax summary times: steps_s: ' in r.stdout
