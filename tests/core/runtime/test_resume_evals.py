"""A resume at a step whose eval was due but not recorded (its row is written with the next
step's, so a stop in between loses it) evaluates that step again before training on."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


def _rows(wd):
  with open(os.path.join(wd, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f if l.strip()]


def _main(wd, steps):
  r = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.main',
          '--config=configs/qwenimage.py:tiny',
          f'--workdir={wd}',
          f'--config.total_steps={steps}',
          '--config.eval.every=2',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return r


@pytest.mark.slow
def test_a_resume_evaluates_the_step_whose_eval_row_was_lost(tmp_path):
  wd = str(tmp_path / 'run')
  _main(wd, 2)  # evals at 0 and (the final one) 2; checkpoint at 2
  evals = lambda: [r['step'] for r in _rows(wd) if 'eval/reward_mean' in r]
  assert evals() == [0, 2]
  kept = [r for r in _rows(wd) if not ('eval/reward_mean' in r and r['step'] == 2)]
  with open(os.path.join(wd, 'metrics.jsonl'), 'w') as f:  # as if it stopped before the row
    f.writelines(json.dumps(r) + '\n' for r in kept)
  _main(wd, 4)
  assert evals() == [0, 2, 4]  # 2 evaluated again at the resume, 4 at the end
  _main(wd, 6)
  assert evals() == [0, 2, 4, 6]  # recorded: not evaluated twice
