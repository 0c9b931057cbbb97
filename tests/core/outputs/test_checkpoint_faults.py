"""Storage faults: a corrupt latest checkpoint is detected and the previous one
used; a full disk during a save leaves the previous checkpoint readable and the next run able to
save again."""

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.outputs import faults
from tests.helpers import tb_events
from tests.helpers.paths import REPO

W = np.random.RandomState(0).randn(128, 128).astype(np.float32)  # incompressible: ~64 KB


def _state(v: float):
  return {
      'params': {'w': jnp.asarray(W + v), 'b': jnp.arange(5.0) + v},
      'rng': jnp.zeros(2, jnp.uint32),
  }


def _saved(directory, steps=(1, 2), keep=3):
  ck = ckpt_lib.Checkpointer(str(directory), max_to_keep=keep)
  for s in steps:
    ck.save(s, _state(float(s)), {'step': s, 'data_position': 2 * s})
  ck.close()
  return str(directory)


def _biggest(step_dir):
  files = [
      f
      for f in glob.glob(os.path.join(step_dir, '**'), recursive=True)
      if os.path.isfile(f) and not f.endswith(ckpt_lib.DIGEST_FILE)
  ]
  return max(files, key=os.path.getsize)


def _truncate(step_dir):
  f = _biggest(step_dir)
  with open(f, 'r+b') as fh:
    fh.truncate(os.path.getsize(f) // 2)


def _flip_byte(step_dir):
  # orbax restores such a chunk without complaint (wrong values): only the digest sees it.
  f = _biggest(step_dir)
  with open(f, 'r+b') as fh:
    fh.seek(os.path.getsize(f) // 2)
    b = fh.read(1)
    fh.seek(-1, 1)
    fh.write(bytes([b[0] ^ 0x10]))


def _delete_file(step_dir):
  os.remove(_biggest(step_dir))


def _garble_meta(step_dir):
  with open(os.path.join(step_dir, 'meta', 'metadata'), 'w') as fh:
    fh.write('{"step": ')


def _flip_byte_without_digest(step_dir):
  # Once, with its digest gone, a flipped byte restored silently (an optimizer entry of 5e25
  # was trained on); a step without a digest is now not trusted.
  os.remove(os.path.join(step_dir, ckpt_lib.DIGEST_FILE))
  _flip_byte(step_dir)


@pytest.mark.parametrize(
    'corrupt', [_truncate, _flip_byte, _delete_file, _garble_meta, _flip_byte_without_digest]
)
def test_corrupt_latest_falls_back_to_the_previous_with_a_warning(tmp_path, corrupt, caplog):
  d = _saved(tmp_path / 'ck')
  assert os.path.exists(os.path.join(d, '2', ckpt_lib.DIGEST_FILE))
  corrupt(os.path.join(d, '2'))
  ck = ckpt_lib.Checkpointer(d, max_to_keep=3)
  with caplog.at_level(logging.WARNING):
    step, state, meta = ck.restore_latest(_state(0.0))
  assert step == 1 and meta['data_position'] == 2
  np.testing.assert_array_equal(np.asarray(state['params']['w']), W + 1)
  assert any(
      'checkpoint step 2' in r.getMessage() and 'corrupt' in r.getMessage() for r in caplog.records
  ), [r.getMessage() for r in caplog.records]
  if corrupt is _flip_byte_without_digest:
    assert any('has no digest.json' in r.getMessage() for r in caplog.records)
  # The corrupt step is set aside (kept for inspection), so the run can save step 2 again.
  assert ck.all_steps() == [1]
  assert len(os.listdir(d + '.corrupt')) == 1
  ck.save(2, _state(2.5), {'step': 2, 'data_position': 4})
  ck.close()
  step, state, _ = ckpt_lib.Checkpointer(d).restore_latest(_state(0.0))
  assert step == 2
  np.testing.assert_array_equal(np.asarray(state['params']['w']), W + 2.5)


def test_no_readable_checkpoint_is_one_clear_error(tmp_path):
  d = _saved(tmp_path / 'ck')
  _truncate(os.path.join(d, '1'))
  _flip_byte(os.path.join(d, '2'))
  ck = ckpt_lib.Checkpointer(d)
  with pytest.raises(faults.CheckpointError) as e:
    ck.restore_latest(_state(0.0))
  msg = str(e.value)
  assert 'no readable checkpoint' in msg and 'step 2:' in msg and 'step 1:' in msg
  assert 'move that directory away' in msg and '\n' not in msg
  assert ck.all_steps() == [1, 2]  # nothing is moved when nothing restores


def test_intact_checkpoint_of_another_model_is_not_taken_for_corruption(tmp_path):
  d = _saved(tmp_path / 'ck')
  other = {
      'params': {'w': jnp.zeros((64, 128)), 'b': jnp.zeros(5)},
      'rng': jnp.zeros(2, jnp.uint32),
  }
  ck = ckpt_lib.Checkpointer(d)
  with pytest.raises(faults.CheckpointError, match='intact but does not fit this run'):
    ck.restore_latest(other)
  assert ck.all_steps() == [1, 2] and not os.path.exists(d + '.corrupt')


def test_empty_directory_restores_nothing(tmp_path):
  assert ckpt_lib.Checkpointer(str(tmp_path / 'ck')).restore_latest(_state(0.0)) is None


def _can_mount_tmpfs(path) -> bool:
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or shutil.which('mount') is None:
    return False
  r = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=512k', 'tmpfs', str(path)], capture_output=True
  )
  return r.returncode == 0


def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
  """A real ENOSPC: a 512 KB tmpfs (needs root; else the RLIMIT_FSIZE test below covers it)."""
  mnt = tmp_path / 'mnt'
  if not _can_mount_tmpfs(mnt):
    pytest.fail(
        'cannot mount a 512 KB tmpfs here (needs root and mount): run the suite as root, as CI does; the RLIMIT_FSIZE variant below needs neither'
    )
  try:
    d = str(mnt / 'ck')
    ck = ckpt_lib.Checkpointer(d, max_to_keep=1)  # keep 1: step 1 is the only copy
    ck.save(1, _state(1.0), {'step': 1, 'data_position': 2})
    ck.wait()
    st = os.statvfs(mnt)
    with open(mnt / 'filler', 'wb') as f:  # leave less than one checkpoint free
      f.write(b'\0' * (st.f_bavail * st.f_frsize - 16_000))
    with pytest.raises(faults.CheckpointError) as e:
      ck.save(2, _state(2.0), {'step': 2, 'data_position': 4})
      ck.wait()
    msg = str(e.value)
    assert 'disk is full' in msg and 'previous checkpoint (step 1) is intact' in msg, msg
    ck.close()  # reported once; closing does not hang
    os.remove(mnt / 'filler')
    # The next run: step 1 restores exactly, the half-written step is cleaned up, saving works.
    ck = ckpt_lib.Checkpointer(d, max_to_keep=1)
    step, state, _ = ck.restore_latest(_state(0.0))
    assert step == 1
    np.testing.assert_array_equal(np.asarray(state['params']['w']), W + 1)
    assert sorted(os.listdir(d)) == ['1'], os.listdir(d)
    ck.save(2, _state(2.0), {'step': 2, 'data_position': 4})
    ck.close()
    assert ckpt_lib.Checkpointer(d).restore_latest(_state(0.0))[0] == 2
  finally:
    subprocess.run(['umount', str(mnt)], check=False)


_FSIZE_SCRIPT = textwrap.dedent("""
    import os, resource, signal, sys
    import jax.numpy as jnp, numpy as np
    from digen_jax.outputs import checkpoint as ckpt_lib, faults
    W = np.random.RandomState(0).randn(128, 128).astype(np.float32)
    st = lambda v: {'params': {'w': jnp.asarray(W + v), 'b': jnp.arange(5.0) + v},
                    'rng': jnp.zeros(2, jnp.uint32)}
    ck = ckpt_lib.Checkpointer(sys.argv[1], max_to_keep=1)
    ck.save(1, st(1.0), {'step': 1, 'data_position': 2}); ck.wait()
    # Any file write past 16 KB now fails (EFBIG) instead of killing us with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, hard))
    try:
      ck.save(2, st(2.0), {'step': 2, 'data_position': 4}); ck.close()
    except faults.CheckpointError as e:
      print('ERROR:', e); sys.exit(3)
""")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
  """A size limit on the saving process (RLIMIT_FSIZE: writes fail with EFBIG), no root needed."""
  d = str(tmp_path / 'ck')
  r = subprocess.run(
      [sys.executable, '-c', _FSIZE_SCRIPT, d],
      capture_output=True,
      text=True,
      cwd=REPO,
      env={**os.environ, 'PYTHONPATH': REPO},
      timeout=300,
  )
  assert r.returncode == 3, r.stderr[-3000:]
  line = [l for l in r.stdout.splitlines() if l.startswith('ERROR:')][0]
  assert 'saving checkpoint step 2' in line and 'previous checkpoint (step 1) is intact' in line
  ck = ckpt_lib.Checkpointer(d, max_to_keep=1)
  step, state, meta = ck.restore_latest(_state(0.0))
  assert step == 1 and meta['data_position'] == 2
  np.testing.assert_array_equal(np.asarray(state['params']['w']), W + 1)
  assert sorted(os.listdir(d)) == ['1']  # the partial step 2 is gone
  ck.save(2, _state(2.0), {'step': 2, 'data_position': 4})
  ck.close()
  assert ckpt_lib.Checkpointer(d).restore_latest(_state(0.0))[0] == 2


@pytest.mark.slow
def test_training_resumes_past_a_corrupt_latest_checkpoint(tmp_path):
  """A run whose newest checkpoint rotted resumes from the one before and redoes the lost step
  exactly (one step lost, same parameters)."""
  from configs import qwenimage
  from digen_jax.experiment import config as configlib
  from digen_jax.experiment import build as experiment
  from digen_jax.runtime import cluster as cluster_lib
  from digen_jax.runtime import loop

  def run(workdir):
    config = configlib.apply_overrides(qwenimage.get_config('tiny'), {'total_steps': 2})
    exp = experiment.build(config, str(workdir), 2)
    return loop.train(exp, str(workdir), cluster_lib.colocated(jax.local_devices()[:2]))

  wd = tmp_path / 'run'
  first = jax.device_get(run(wd)['params'])
  rows_before = _train_rows(wd / 'metrics.jsonl')
  _flip_byte(os.path.join(wd, 'checkpoints', '2'))
  again = jax.device_get(run(wd)['params'])  # resumes from step 1, redoes step 2
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)
  assert len(os.listdir(str(wd / 'checkpoints') + '.corrupt')) == 1
  # Step 2 appears once: the first run's row moved aside, the redone step's row in its place
  # (metrics.jsonl used to hold steps [1, 2, 2]).
  rows = _train_rows(wd / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2], rows
  assert rows[0] == rows_before[0] and rows[1]['time'] > rows_before[1]['time']
  assert [r['step'] for r in _train_rows(wd / 'metrics.superseded.jsonl')] == [2]


def _train_rows(path):
  return [json.loads(l) for l in open(path) if '"loss"' in l]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_resume_redoes_the_lost_step(tmp_path):
  """Before: a real ENOSPC during a run ended after ~800 lines and ~80 tracebacks, reported at
  the save after next (two more steps logged), and the resumed run left steps [1, 2, 2, ...] in
  metrics.jsonl. Now: one line, before step 3's row; the resume redoes step 2 in its place."""
  mnt = tmp_path / 'mnt'
  if not _can_mount_tmpfs(mnt):
    pytest.fail(
        'cannot mount a tmpfs here (needs root and mount): run the suite as root, as CI does'
    )
  try:
    # 6 MB: a checkpoint of configs/qwenimage.py:tiny (params + Adam state) is 3.5 MB, so step 1
    # fits and step 2 does not.
    subprocess.run(['mount', '-o', 'remount,size=6m', str(mnt)], check=True)
    wd = str(mnt / 'run')
    cmd = [
        sys.executable,
        '-m',
        'digen_jax.main',
        '--config=configs/qwenimage.py:tiny',
        f'--workdir={wd}',
        '--config.total_steps=4',
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    said = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith(('I1', 'W1'))]
    assert r.returncode == 1 and len(said) == 1, r.stderr[-5000:]
    assert said[0].startswith(f'digen_jax: saving checkpoint step 2 in {wd}/checkpoints failed: ')
    assert 'the disk is full' in said[0] and 'previous checkpoint (step 1) is intact' in said[0]
    assert 'step 3/4' not in r.stderr  # stopped before step 3's row
    assert [x['step'] for x in _train_rows(os.path.join(wd, 'metrics.jsonl'))] == [1, 2]

    subprocess.run(['mount', '-o', 'remount,size=64m', str(mnt)], check=True)  # space freed
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    assert 'resumed from' in r.stderr and 'at step 1' in r.stderr, r.stderr[-3000:]
    rows = _train_rows(os.path.join(wd, 'metrics.jsonl'))
    assert [x['step'] for x in rows] == [1, 2, 3, 4]  # step 2 once: the redone one
    lost = _train_rows(os.path.join(wd, 'metrics.superseded.jsonl'))
    assert [x['step'] for x in lost] == [2] and lost[0]['time'] < rows[1]['time']
  finally:
    subprocess.run(['umount', str(mnt)], check=False)


def test_a_resume_supersedes_the_rows_after_its_step(tmp_path):
  """A run that resumes at step 2 after one that logged steps 1-4 (a fallback, or lost saves):
  rows 3 and 4 move to metrics.superseded.jsonl (with the eval at step 4 and a torn last line),
  TensorBoard purges from step 3 on, and the steps redone are written once."""
  from digen_jax.outputs import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  wd = str(tmp_path)
  w = metrics_lib.MetricsWriter(wd)
  for s in (1, 2, 3, 4):
    w.write({'step': s, 'loss': float(s)})
  w.write({'step': 2, 'eval/strict_accuracy': 0.5})  # eval rows carry their policy's step
  w.write({'step': 4, 'eval/strict_accuracy': 0.7})
  w.close()
  with open(os.path.join(wd, 'metrics.jsonl'), 'a') as f:
    f.write('{"step": 5, "lo')  # killed mid-row
  time.sleep(1.1)  # TensorBoard event files are named by the second they were opened in
  w = metrics_lib.MetricsWriter(wd, resume_step=2)
  for s in (3, 4):
    w.write({'step': s, 'loss': 10.0 + s})
  w.close()
  rows = metrics_lib.read_metrics(wd)
  assert [(r['step'], r.get('loss')) for r in rows] == [
      (1, 1.0),
      (2, 2.0),
      (2, None),  # the eval at step 2 is not redone after a resume there: it stays
      (3, 13.0),
      (4, 14.0),
  ]
  with open(os.path.join(wd, metrics_lib.SUPERSEDED)) as f:
    moved = f.read().splitlines()
  assert [json.loads(l)['step'] for l in moved[:3]] == [3, 4, 4] and moved[3] == '{"step": 5, "lo'
  events = tb_events.events(os.path.join(wd, 'tensorboard'))
  second = sorted({p for p, _ in events})[1]
  starts = [e for p, e in events if p == second and e.HasField('session_log')]
  assert [(e.step, e.session_log.status) for e in starts] == [(3, 1)]  # START at 3: purge >= 3
  # A run that starts over (step 0) supersedes everything, its base eval included.
  metrics_lib.MetricsWriter(wd, resume_step=0, tensorboard=False).close()
  assert metrics_lib.read_metrics(wd) == []


def test_a_metrics_row_that_cannot_be_written_is_one_line(tmp_path):
  from digen_jax.outputs import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  os.symlink('/dev/full', tmp_path / 'metrics.jsonl')  # every write: ENOSPC
  w = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  with pytest.raises(faults.RunError) as e:
    w.write({'step': 1, 'loss': 0.5})
  assert str(e.value).startswith(f'writing {tmp_path}/metrics.jsonl failed: No space left on')
  assert 'rerun the same command to resume' in str(e.value)


def test_tensorboard_events_that_cannot_be_flushed_at_close_are_one_line(tmp_path, monkeypatch):
  """The events' last buffer meets a full disk at close (the slow full-disk run above hits this
  beside a failed save, whose line then stands alone): a RunError naming the folder."""
  import errno  # pylint: disable=g-import-not-at-top

  from digen_jax.outputs import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  w = metrics_lib.MetricsWriter(str(tmp_path))
  w.write({'step': 1, 'loss': 0.5})

  def full(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  import tensorboardX  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tensorboardX.SummaryWriter, 'close', full)
  with pytest.raises(faults.RunError) as e:
    w.close()
  assert str(e.value).startswith(f'writing the TensorBoard events in {tmp_path}/tensorboard failed')
  assert 'No space left on device' in str(e.value)
  w.close()  # closed: a second close does nothing
