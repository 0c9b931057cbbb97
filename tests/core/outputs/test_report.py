"""Eval reports and the end-of-run report: JSON, grids, before/after, summary."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from digen_jax.outputs import eval_report
from tests.helpers.paths import REPO
from digen_jax.outputs import figures
from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import report
from digen_jax.tasks.shapes import grammar
from digen_jax.tasks.shapes import render
from digen_jax.tasks.shapes import checker as shapes_checker


def _result(prompts, images, n_per):
  texts = [p for p in prompts for _ in range(n_per)]
  rewards = shapes_checker.shapes_reward(images, texts)
  passed = shapes_checker.shapes_strict(images, texts)
  return {
      'metrics': {
          'eval/strict_accuracy': float(passed.mean()),
          'eval/reward_mean': float(rewards.mean()),
          'eval/num_prompts': len(prompts),
          'eval/samples_per_prompt': n_per,
      },
      'images': images,
      'prompts': texts,
      'rewards': rewards,
      'passed': passed,
  }


def test_reports_and_before_after(tmp_path, plots):
  prompts = [p.to_text() for p in grammar.split_prompts()['eval'][:6]]
  n_per = 2
  truth = render.render_batch([grammar.parse(p) for p in prompts for _ in range(n_per)], 16, seed=0)
  noise = np.random.default_rng(0).uniform(-1, 1, truth.shape).astype(np.float32)
  out = tmp_path / 'eval'
  eval_report.write_report(_result(prompts, noise, n_per), str(out), 0)
  eval_report.write_report(_result(prompts, truth, n_per), str(out), 10)
  rep = json.load(open(out / 'eval_000010.json'))
  assert rep['eval/strict_accuracy'] > 0.9 and set(rep['per_prompt']) == set(prompts)
  saved = np.load(out / 'eval_000000.npz')
  assert saved['images'].dtype == np.uint8 and not saved['passed'].any()

  # The end-of-run report finds the first and last eval and draws them side by side.
  writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  for step, r in ((0, 0.0), (10, 1.0)):
    writer.write({'step': step, 'eval/strict_accuracy': r, 'eval/reward_mean': r})
    writer.write({'step': step + 1, 'reward_mean': r, 'wall_s': 1.0})
  writer.close()
  summary = report.finish(str(tmp_path))
  assert summary['base_strict_accuracy'] == 0.0 and summary['final_strict_accuracy'] == 1.0
  grid = Image.open(summary['before_after'])
  assert grid.size[1] > 6 * 16 * 4  # one row per prompt, upscaled tiles
  assert os.path.exists(tmp_path / 'reward.png')

  eval_report.write_report(_result(prompts[::-1], truth, n_per), str(tmp_path / 'other'), 10)
  with pytest.raises(ValueError, match='different prompts'):
    eval_report.before_after_grid(
        str(out / 'eval_000000.npz'),
        str(tmp_path / 'other' / 'eval_000010.npz'),
        str(tmp_path / 'x.png'),
    )


def test_digen_plots_0_skips_the_figures_and_a_bad_value_is_one_line(tmp_path, monkeypatch):
  writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write({'step': 1, 'reward_mean': 0.5, 'wall_s': 1.0})
  writer.close()
  monkeypatch.setenv('DIGEN_PLOTS', '0')
  assert report.finish(str(tmp_path))['last_reward_mean'] == 0.5
  assert os.path.isfile(tmp_path / 'summary.json') and not os.path.exists(tmp_path / 'reward.png')
  monkeypatch.setenv('DIGEN_PLOTS', 'no')
  with pytest.raises(ValueError, match="DIGEN_PLOTS='no': use 1"):
    figures.enabled()
  # The CLI refuses it before it builds anything.
  wd = tmp_path / 'run'
  r = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.main',
          '--config=configs/qwenimage.py:tiny',
          f'--workdir={wd}',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode != 0 and "DIGEN_PLOTS='no'" in r.stderr, r.stderr[-2000:]
  assert not wd.exists()
