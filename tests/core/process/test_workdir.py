"""One run per workdir: the lock of digen_jax/process/workdir.py, and two real runs
started on one workdir (two independent mains; a two-process job): the second one refuses in
one line naming the first, before it writes anything; a killed run's lock is taken over."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from digen_jax.process import workdir as workdir_lib
from tests.helpers import xla_env
from tests.mp_scripts import launcher_util as util
from tests.helpers.paths import REPO

TINY = '--config=configs/qwenimage.py:tiny'
LOG_LINE = ('I1', 'W1', 'E1')  # absl's INFO/WARNING/ERROR lines (the month of the date follows)


def _record(path) -> dict:
  with open(path) as f:
    return json.load(f)


def _spawn_sleeper():
  return subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])


def _fake_holder(wd, **fields):
  """A run.lock written by some other process (no flock held: a killed run, or a file system
  whose locks do not reach here)."""
  os.makedirs(wd, exist_ok=True)
  me = workdir_lib.holder_record(1)
  with open(os.path.join(wd, workdir_lib.LOCK_FILE), 'w') as f:
    json.dump({**me, 'command': 'python -m digen_jax.main --workdir=elsewhere', **fields}, f)


def test_a_second_holder_is_refused_and_release_cleans_up(tmp_path):
  wd = str(tmp_path / 'run')
  lock = workdir_lib.acquire(wd)
  rec = _record(os.path.join(wd, 'run.lock'))
  assert rec['pid'] == os.getpid() and rec['host'] == socket.gethostname()
  with pytest.raises(workdir_lib.WorkdirError) as e:
    workdir_lib.acquire(wd)  # another open file of the same process: flock refuses it too
  msg = str(e.value)
  assert msg.startswith(f'--workdir={wd} is in use by another run (pid {os.getpid()} on ')
  assert 'give this run another --workdir' in msg and '\n' not in msg
  lock.release()
  lock.release()  # idempotent
  assert not os.path.exists(wd)  # created by the lock, empty: gone with it
  os.makedirs(wd)
  open(os.path.join(wd, 'metrics.jsonl'), 'w').close()
  workdir_lib.acquire(wd).release()
  assert os.listdir(wd) == ['metrics.jsonl']  # a workdir it did not create stays


def test_stale_records_are_taken_over_and_live_ones_refuse(tmp_path, caplog):
  wd = str(tmp_path / 'run')
  gone = subprocess.Popen(['true'])
  gone.wait()
  # A run killed on this host (its pid no longer runs), and one from before a reboot.
  for fields in ({'pid': gone.pid}, {'boot_id': 'another-boot', 'pid': 1}):
    _fake_holder(wd, **fields)
    with caplog.at_level(logging.WARNING):
      lock = workdir_lib.acquire(wd)
    assert any(
        'the run that held it is gone' in r.getMessage()
        and f"pid {fields['pid']} on" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert _record(lock.path)['pid'] == os.getpid()
    lock.release()
    caplog.clear()
  # A pid that was reused: same number, another process (its start time differs).
  sleeper = _spawn_sleeper()
  try:
    _fake_holder(wd, pid=sleeper.pid, start_time=1)
    workdir_lib.acquire(wd).release()
    # A live process on this host that holds no flock: a file system that accepts flock without
    # enforcing it. The record refuses.
    started = workdir_lib.start_time(sleeper.pid)
    _fake_holder(wd, pid=sleeper.pid, start_time=started)
    with pytest.raises(
        workdir_lib.WorkdirError, match=f'in use by another run \\(pid {sleeper.pid}'
    ):
      workdir_lib.acquire(wd)
  finally:
    sleeper.kill()
    sleeper.wait()
  # Another host: its run holds no flock on this shared file, so it is gone (flock is trusted).
  _fake_holder(wd, host='elsewhere', pid=1)
  workdir_lib.acquire(wd).release()


def test_a_workdir_that_cannot_be_one_is_one_line(tmp_path):
  f = tmp_path / 'file'
  f.write_text('x')
  with pytest.raises(workdir_lib.WorkdirError, match='is a file, not a directory'):
    workdir_lib.acquire(str(f))
  with pytest.raises(workdir_lib.WorkdirError, match='sub cannot be created: Not a directory'):
    workdir_lib.acquire(str(f / 'sub'))
  assert f.read_text() == 'x'


def _main(wd, *flags):
  return [sys.executable, '-m', 'digen_jax.main', TINY, f'--workdir={wd}', *flags]


def _last_lines(stderr: str) -> list[str]:
  """The lines that are not absl log lines (what a person reads as the outcome)."""
  return [l for l in stderr.splitlines() if l.strip() and not l.startswith(LOG_LINE)]


def _rows(wd):
  with open(os.path.join(wd, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f if '"loss"' in l]


@pytest.mark.slow
def test_a_second_run_on_a_workdir_refuses_and_a_killed_runs_lock_is_taken_over(tmp_path, caplog):
  """Two real mains (unlocked, both ran; the second failed at its first save after 1,115 lines,
  config.json described the other run, metrics.jsonl mixed both)."""
  wd = str(tmp_path / 'run')
  env = xla_env.env_with_devices(2)
  first = subprocess.Popen(
      _main(wd, '--config.total_steps=1000'),
      cwd=REPO,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.monotonic() + 300
    while not (os.path.exists(os.path.join(wd, 'metrics.jsonl')) and _rows(wd)):
      assert first.poll() is None and time.monotonic() < deadline, 'the first run ended early'
      time.sleep(0.1)
    before = sorted(os.listdir(wd)), open(os.path.join(wd, 'config.json')).read()
    t0 = time.monotonic()
    second = subprocess.run(
        _main(wd, '--config.total_steps=3', '--config.seed=1'),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - t0
    assert second.returncode == 1, second.stderr[-3000:]
    (line,) = _last_lines(second.stderr)  # one line, no traceback
    assert line.startswith(f'digen_jax: --workdir={wd} is in use by another run (pid {first.pid} ')
    assert f'--workdir={wd} --config.total_steps=1000' in line, line
    # Refused at its start: before JAX's backend (39.6 s beside a training run when the lock came
    # after it), let alone a compile.
    assert seconds < 5, seconds
    assert first.poll() is None  # the first run goes on, its outputs untouched
    assert (sorted(os.listdir(wd)), open(os.path.join(wd, 'config.json')).read()) == before
    assert json.loads(before[1])['seed'] == 0
    n = len(_rows(wd))
    while len(_rows(wd)) < n + 1:  # still training, alone
      assert first.poll() is None and time.monotonic() < deadline
      time.sleep(0.1)
  finally:
    first.send_signal(signal.SIGKILL)  # killed: its run.lock stays behind, unlocked
    first.wait()
  assert _record(os.path.join(wd, 'run.lock'))['pid'] == first.pid
  with caplog.at_level(logging.WARNING):
    lock = workdir_lib.acquire(wd)
  lock.release()
  assert any(f'pid {first.pid} on' in r.getMessage() for r in caplog.records)
  assert [r['step'] for r in _rows(wd)] == list(range(1, len(_rows(wd)) + 1))


def test_a_two_process_run_shares_one_lock_and_refuses_together(tmp_path):
  """A two-process job on a workdir another run holds: both processes refuse with its line
  (process 0 holds a job's lock; the others take its outcome from the key-value store)."""
  wd = str(tmp_path / 'run')
  holder = subprocess.Popen(
      [
          sys.executable,
          '-c',
          'import sys, time; from digen_jax.process import workdir; '
          'workdir.acquire(sys.argv[1]); print("held", flush=True); time.sleep(600)',
          wd,
      ],
      cwd=REPO,
      env={**os.environ, 'PYTHONPATH': REPO},
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'held'
    code, out = util.run(
        ['--num_processes=2', '--devices_per_process=2'],
        [sys.executable, '-m', 'digen_jax.main', f'{TINY}_disagg', f'--workdir={wd}'],
        timeout_s=180,
    )
  finally:
    holder.kill()
    holder.wait()
  assert code == 1, out[-3000:]
  for rank in (0, 1):
    lines = [l for l in out.splitlines() if l.startswith(f'[{rank}] digen_jax:')]
    assert len(lines) == 1 and f'is in use by another run (pid {holder.pid} ' in lines[0], out
  assert 'Traceback' not in out
  assert os.listdir(wd) == ['run.lock']  # the holder's: the job wrote nothing
