"""Resuming a workdir under a changed config (experiment/resume_guard.py): settings that change
the run are refused in one line naming each; logging and cadence changes pass and are logged;
an accepted change is recorded."""

import json
import os
import subprocess
import sys

import pytest

from digen_jax.experiment import config as configlib
from digen_jax.experiment import resume_guard
from tests.helpers.paths import REPO


def _saved(tmp_path):
  """A workdir holding config.json of the base config and a checkpoint."""
  c = configlib.base_config()
  os.makedirs(tmp_path / 'checkpoints' / '3')
  (tmp_path / 'config.json').write_text(c.to_json_best_effort())
  return str(tmp_path), c


def _json(c, **changes):
  """config.json text of `c` with the dotted `changes` applied."""
  d = json.loads(c.to_json_best_effort())
  for dotted, v in changes.items():
    node = d
    *head, leaf = dotted.split('.')
    for h in head:
      node = node[h]
    node[leaf] = v
  return json.dumps(d)


def test_a_change_of_what_the_run_trains_is_refused_naming_each_field(tmp_path):
  wd, c = _saved(tmp_path)
  new = _json(c, **{'optim.lr': 3e-4, 'rl.group_size': 2 * c.rl.group_size, 'total_steps': 900})
  with pytest.raises(ValueError) as e:
    resume_guard.check(wd, new, '')
  said = str(e.value)
  assert 'optim.lr 0.0001 -> 0.0003' in said
  assert f'rl.group_size {c.rl.group_size} -> {2 * c.rl.group_size}' in said
  assert 'total_steps' not in said  # benign: not among the refused
  assert '--config.runtime.resume_changed=optim.lr,rl.group_size' in said
  assert not os.path.exists(os.path.join(wd, resume_guard.HISTORY))  # nothing written


def test_benign_changes_pass_and_are_logged(tmp_path):
  wd, c = _saved(tmp_path)
  lines = resume_guard.check(wd, _json(c, **{'total_steps': 900, 'eval.every': 5}), '')
  assert lines == [
      'resume: eval.every changed 0 -> 5',
      f'resume: total_steps changed {c.total_steps!r} -> 900',
  ]
  assert resume_guard.check(wd, _json(c), '') == []


def test_an_accepted_change_is_recorded_and_a_stray_acceptance_refused(tmp_path):
  wd, c = _saved(tmp_path)
  new = _json(c, **{'optim.lr': 3e-4})
  lines = resume_guard.check(wd, new, 'optim.lr')
  assert lines == ['resume: optim.lr changed 0.0001 -> 0.0003 (accepted, config_history.jsonl)']
  (row,) = [json.loads(l) for l in open(os.path.join(wd, resume_guard.HISTORY))]
  assert row['accepted'] == {'optim.lr': [0.0001, 0.0003]} and row['time']
  with pytest.raises(ValueError, match='names rl.seed, which this resume does not change'):
    resume_guard.check(wd, new, 'optim.lr,rl.seed')


def test_no_checkpoint_no_check_and_new_default_fields_are_no_change(tmp_path):
  wd, c = _saved(tmp_path)
  old = json.loads((tmp_path / 'config.json').read_text())
  del old['data']['max_prompt_chars']  # a field newer code added, at its default
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert resume_guard.check(wd, _json(c), '') == []
  os.rmdir(tmp_path / 'checkpoints' / '3')
  assert resume_guard.check(wd, _json(c, **{'optim.lr': 1.0}), '') == []  # a fresh start
  (tmp_path / 'checkpoints' / '4').mkdir()
  (tmp_path / 'config.json').write_text('{"optim": ')
  with pytest.raises(ValueError, match='config.json is unreadable'):
    resume_guard.check(wd, _json(c), '')


@pytest.mark.slow
def test_main_refuses_a_changed_resume_in_one_line_before_compiling(tmp_path):
  """A tiny run checkpoints step 1; the same command with another learning rate is refused in
  one line within seconds; with resume_changed it resumes."""
  wd = str(tmp_path / 'run')
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.main',
      '--config=configs/qwenimage.py:tiny',
      f'--workdir={wd}',
      '--config.total_steps=1',
  ]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  r = subprocess.run(
      cmd + ['--config.optim.lr=0.5', '--config.total_steps=2'],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  said = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith(('I1', 'W1'))]
  assert r.returncode == 1 and len(said) == 1, r.stderr[-3000:]
  assert said[0].startswith(f'digen_jax: {wd} holds a run saved with other settings')
  assert 'optim.lr' in said[0] and '-> 0.5' in said[0]
  assert 'compil' not in r.stderr.lower()
  r = subprocess.run(
      cmd
      + [
          '--config.optim.lr=0.5',
          '--config.total_steps=2',
          '--config.runtime.resume_changed=optim.lr',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'resume: optim.lr changed' in r.stderr and 'resume: total_steps changed 1 -> 2' in r.stderr
