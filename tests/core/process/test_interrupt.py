"""Preemption: SIGTERM/SIGINT stop every process within a bound after checkpointing the
last completed step; a restart resumes it exactly in every mode; a process killed with -9 stops
the others and a relaunch resumes."""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.process import interrupt
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.experiment import run as run_lib
from tests.mp_scripts import launcher_util as util
from tests.helpers.paths import REPO

STEPS = 3


# ------------------------------------------------------------------------- the signal itself


def _python(code: str, timeout_s: float = 60):
  t0 = time.monotonic()
  r = subprocess.run(
      [sys.executable, '-c', textwrap.dedent(code)],
      cwd=REPO,
      env={**os.environ, 'PYTHONPATH': REPO},
      capture_output=True,
      text=True,
      timeout=timeout_s,
  )
  return r, time.monotonic() - t0


def test_a_process_stuck_after_sigterm_exits_at_the_bound():
  """The main thread never reaches a safe point (here: a blocking read); the watchdog, woken by
  the C-level handler through the wakeup pipe, exits 143 after runtime.shutdown_timeout_s."""
  r, seconds = _python("""
      import os, signal, threading, time
      from digen_jax.process import interrupt
      interrupt.install(1.5)
      threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
      r, w = os.pipe()
      os.read(r, 1)  # blocks for ever: no Python bytecode runs in the main thread
      """)
  assert r.returncode == 143, r.stderr
  assert 'SIGTERM received' in r.stderr and 'did not finish within' in r.stderr, r.stderr
  assert 'runtime.shutdown_timeout_s=1.5' in r.stderr
  # One line; the stuck thread's stack, which names where it hangs, in the file it names.
  assert 'Thread' not in r.stderr and len(r.stderr.strip().splitlines()) == 2, r.stderr
  stacks = re.search(r"the threads' stacks: (\S+)\)", r.stderr).group(1)
  with open(stacks) as f:
    assert 'File "<string>", line 7 in <module>' in f.read()  # the os.read line
  os.remove(stacks)
  assert seconds < 20


def test_a_signal_while_nothing_is_to_save_exits_at_once_in_one_line():
  """A run's start (restoring, compiling for minutes inside XLA, where no Python handler
  runs): the watchdog exits at once, one line, no stacks."""
  r, seconds = _python("""
      import os, signal, threading
      from digen_jax.process import interrupt
      interrupt.install(300)
      interrupt.nothing_to_save('while compiling')
      threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
      r, w = os.pipe()
      os.read(r, 1)  # blocks for ever, like a compile
      """)
  assert r.returncode == 143, r.stderr
  (line,) = r.stderr.strip().splitlines()
  assert line == (
      'digen_jax: interrupted by SIGTERM while compiling: nothing to save (the last checkpoint '
      'is intact; rerun the same command to resume)'
  )
  assert seconds < 20


@pytest.mark.slow
def test_sigterm_during_the_first_compile_exits_at_once(tmp_path):
  """python -m digen_jax.main stopped while it starts and compiles: 143 within seconds, one
  line, nothing of a run left but its config (a watchdog dump of 64 lines after 60 s before)."""
  wd = str(tmp_path / 'run')
  proc = subprocess.Popen(
      [
          sys.executable,
          '-m',
          'digen_jax.main',
          '--config=configs/qwenimage.py:tiny',
          f'--workdir={wd}',
      ],
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  try:
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(wd, 'config.json')):  # restored: compiling next
      assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
      time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
  finally:
    proc.kill()
  said = [l for l in err.splitlines() if l.strip() and not l.startswith(('I1', 'W1'))]
  assert proc.returncode == 143, err[-3000:]
  assert len(said) == 1 and said[0].startswith('digen_jax: interrupted by SIGTERM '), said
  assert 'nothing to save' in said[0] and 'Thread' not in err
  assert stop_s < 10, stop_s
  assert not os.path.exists(os.path.join(wd, 'checkpoints')) or not os.listdir(
      os.path.join(wd, 'checkpoints')
  )


def test_a_second_signal_exits_at_once():
  r, seconds = _python("""
      import os, signal, time
      from digen_jax.process import interrupt
      interrupt.install(300)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.5)
      assert interrupt.requested() == signal.SIGINT
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(60)
      """)
  assert r.returncode == 128 + signal.SIGTERM, r.stderr
  assert 'second signal' in r.stderr
  assert seconds < 30


def test_check_raises_with_the_exit_code_and_reset_cancels():
  interrupt.install(2.0)
  try:
    interrupt.check('nowhere')  # nothing requested
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(interrupt.Interrupted, match='interrupted by SIGTERM in a test') as e:
      interrupt.check('in a test')
    assert e.value.exit_code == 143
    interrupt.reset()
    time.sleep(2.5)  # past the watchdog's deadline: reset() cancelled it (we are alive)
    interrupt.check('after reset')
  finally:
    interrupt.uninstall()


# ------------------------------------------------------------ exact resume, one process, every mode

MODES = {
    'colocated': {},
    'disagg': {'runtime.mode': 'disagg'},
    'gap': {'schedule.fragments': 2},
    'gap_tsp': {'schedule.fragments': 2, 'schedule.tsp': True},
    'gap_tsp_tag': {'schedule.fragments': 2, 'schedule.tsp': True, 'schedule.tag': True},
    'tcss': {'schedule.fragments': 2, 'schedule.tcss_fraction': 0.5},
}
# Bitwise today: the same programs on the same inputs. TAG lets either role sample a fragment
# (different meshes, so reductions round differently: 1e-5, as test_schedule_modes); TCSS's mix
# of policy versions depends on timing, and a resume regenerates the stale fragments with the
# restored policy, so its updates differ from an uninterrupted run's by design.
BITWISE = ('colocated', 'disagg', 'gap', 'gap_tsp')


def _config(mode, steps=STEPS):
  c = configlib.apply_overrides(
      qwenimage.get_config('tiny'),
      {
          'total_steps': steps,
          **MODES[mode],
      },
  )
  if mode != 'colocated':
    c = configlib.set_disagg(c, trainer=(0, 1), rollout=(2, 3))
  return c


def _train(mode, workdir, signal_after_rewards=None, steps=STEPS):
  """One run to `steps` (resuming from workdir); with signal_after_rewards=k, SIGTERM arrives
  right after the k-th reward call (the rollout's k-th fragment or batch)."""
  c = _config(mode, steps)
  exp = experiment.build(c, workdir, 2)
  if signal_after_rewards is not None:
    fn, calls = exp.reward_fn, []

    def reward(images, prompts):
      out = fn(images, prompts)
      calls.append(1)
      if len(calls) == signal_after_rewards:
        os.kill(os.getpid(), signal.SIGTERM)
      return out

    exp = dataclasses.replace(exp, reward_fn=reward)
  if mode == 'colocated':
    return loop.train(exp, workdir, cluster_lib.colocated(jax.devices()[:2]))
  return loop.train(exp, workdir, cluster_lib.resolve(run_lib.cluster_spec(c)))


def _rows(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  return [json.loads(l) for l in open(path) if '"loss"' in l]


@pytest.fixture
def signals():
  interrupt.install(120.0)
  interrupt.reset()
  yield
  interrupt.uninstall()


@pytest.mark.slow
@pytest.mark.parametrize('mode', list(MODES))
def test_sigterm_at_a_random_point_then_resume_is_exact(signals, tmp_path, mode):
  del signals
  # TCSS is compared with its own invariants, not with an uninterrupted run (see BITWISE).
  straight = None if mode == 'tcss' else _train(mode, str(tmp_path / 'straight'))
  # The k-th reward call (a batch, or one of 2 fragments): one of step 2's, so step 1 is on
  # disk and the run cannot end first.
  k = 2 if mode in ('colocated', 'disagg') else random.Random(f'18-{mode}').choice((3, 4))
  wd = str(tmp_path / 'resumed')
  with pytest.raises(interrupt.Interrupted) as e:
    _train(mode, wd, signal_after_rewards=k)
  assert e.value.exit_code == 143
  msg = str(e.value)
  assert msg.startswith('interrupted by SIGTERM') and 'rerun the same command' in msg, msg
  done = [r['step'] for r in _rows(wd)]
  assert done in ([1], [1, 2]), (k, done)  # stopped in step 2, or right after it
  interrupt.reset()
  resumed = _train(mode, wd)
  steps = [r['step'] for r in _rows(wd)]
  assert steps == list(range(1, STEPS + 1)), steps  # nothing lost, nothing written twice
  b = jax.tree.leaves(jax.device_get(resumed['params']))
  if mode != 'tcss':
    a = jax.tree.leaves(jax.device_get(straight['params']))
    assert len(a) == len(b)
  if mode in BITWISE:
    # Same prompts and samples per step (prompt-stream position and RNG restored), same weights
    # and optimizer state.
    assert [r['reward_mean'] for r in _rows(wd)] == [
        r['reward_mean'] for r in _rows(str(tmp_path / 'straight'))
    ]
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
    for x, y in zip(
        jax.tree.leaves(jax.device_get(straight['opt_state'])),
        jax.tree.leaves(jax.device_get(resumed['opt_state'])),
    ):
      np.testing.assert_array_equal(x, y)
    if mode == 'colocated':
      # The parameters moved (a no-op update would pass the above), and a clean stop resumed
      # with a larger total_steps continues exactly as well.
      init = jax.tree.leaves(experiment.build_model(_config(mode))[2])
      assert any(np.abs(np.asarray(x) - np.asarray(i)).max() > 0 for x, i in zip(a, init))
      clean = str(tmp_path / 'clean')
      _train(mode, clean, steps=2)
      again = _train(mode, clean)
      assert [r['step'] for r in _rows(clean)] == list(range(1, STEPS + 1))
      for x, y in zip(a, jax.tree.leaves(jax.device_get(again['params']))):
        np.testing.assert_array_equal(x, y)
  elif mode == 'gap_tsp_tag':
    for x, y in zip(a, b):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
  else:  # tcss: the resumed step starts fresh (no stale fragment survives a restart)
    rows = _rows(wd)
    first = rows[len(done)]
    assert first['staleness_mix']['1'] == 0.0, first
    assert all(r['policy_version'] >= r['step'] - 2 for r in rows)
    assert all(np.isfinite(x).all() for x in b)


# ---------------------------------------------------- two processes: SIGTERM, kill -9, relaunch


# Two-process run: a step takes ~1.2 s here and each fault waits up to 1 s after a row, so 5
# steps keep every fault inside the run (SIGTERM after row 1 stops by row 2; the kill after the
# relaunch's first row lands by row 4).
STEPS_2P = 5


def _launch(wd, steps=STEPS_2P):
  main = [
      sys.executable,
      '-m',
      'digen_jax.main',
      '--config=configs/qwenimage.py:tiny_disagg',
      f'--workdir={wd}',
      f'--config.total_steps={steps}',
      '--config.schedule.fragments=2',
      '--config.runtime.shutdown_timeout_s=30',
  ]
  return util.start(['--num_processes=2', '--devices_per_process=2', '--timeout_s=400'], main)


class _Output:
  """The launcher's merged output, read on a thread (so the pipe never fills)."""

  def __init__(self, proc):
    self.lines: list[str] = []
    self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
    self._t.start()

  def _read(self, proc):
    for line in proc.stdout:
      self.lines.append(line)

  def wait_for(self, pred, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      for line in list(self.lines):
        if pred(line):
          return line
      time.sleep(0.1)
    raise AssertionError('not seen in time; output:\n' + ''.join(self.lines)[-4000:])

  def text(self) -> str:
    self._t.join(timeout=30)
    return ''.join(self.lines)


def _rows_seen(wd) -> int:
  return len(_rows(wd))


def _wait_rows(wd, n, proc, timeout_s=300):
  deadline = time.monotonic() + timeout_s
  while _rows_seen(wd) < n:
    assert proc.poll() is None and time.monotonic() < deadline, 'the run ended early'
    time.sleep(0.05)


@pytest.mark.slow
def test_two_processes_sigterm_kill9_and_relaunch(tmp_path):
  """GAP (M=2) over launch/local.py: (1) SIGTERM to the launcher at a random time in step 2:
  both processes stop, the trainer checkpoints, the launcher exits 143 within the bound;
  (2) relaunched, the rollout process is killed with -9 at a random time in the next step: the
  launcher exits non-zero naming it, the trainer does not hang; (3) relaunched, the run finishes
  every step once, with the parameters of an uninterrupted one-process GAP run."""
  rng = random.Random(18)
  wd = str(tmp_path / 'run')

  proc = _launch(wd)
  out = _Output(proc)
  try:
    _wait_rows(wd, 1, proc)
    time.sleep(rng.uniform(0.0, 1.0))
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=120)
    stop_s = time.monotonic() - t0
  finally:
    util.kill_tree(proc)
  text = out.text()
  assert code == 143, text[-4000:]
  assert 'interrupted by SIGTERM' in text and 'rerun the same command to resume' in text, text[
      -4000:
  ]
  assert '(exit codes 0: 143, 1: 143)' in text, text[-4000:]
  assert stop_s < 45, stop_s
  print(f'SIGTERM to the launcher: both processes stopped in {stop_s:.1f} s')
  first = _rows_seen(wd)
  assert 1 <= first <= 2, first

  proc = _launch(wd)
  out = _Output(proc)
  try:
    line = out.wait_for(lambda l: l.startswith('[1]') and '(rollout)  pid ' in l, 300)
    rollout_pid = int(line.split('(rollout)  pid ')[1].split()[0])
    _wait_rows(wd, first + 1, proc)  # the resumed run made a step; kill during the next one
    time.sleep(rng.uniform(0.0, 1.0))
    t0 = time.monotonic()
    os.kill(rollout_pid, signal.SIGKILL)
    code = proc.wait(timeout=120)
    stop_s = time.monotonic() - t0
  finally:
    util.kill_tree(proc)
  text = out.text()
  assert code == 137, text[-4000:]
  assert 'process 1 exited with 137' in text, text[-4000:]
  assert stop_s < 45, stop_s
  print(f'kill -9 of the rollout: the launcher exited in {stop_s:.1f} s')
  t0 = time.monotonic()

  proc = _launch(wd)
  out = _Output(proc)
  try:
    code = proc.wait(timeout=400)
  finally:
    util.kill_tree(proc)
  assert code == 0, out.text()[-4000:]
  print(f'relaunch to the end: {time.monotonic() - t0:.1f} s')
  steps = [r['step'] for r in _rows(wd)]
  assert steps == list(range(1, STEPS_2P + 1)), steps

  ref_wd = str(tmp_path / 'reference')
  c = configlib.set_disagg(
      configlib.apply_overrides(
          qwenimage.get_config('tiny'),
          {
              'total_steps': STEPS_2P,
              'schedule.fragments': 2,
          },
      ),
      trainer=(0, 1),
      rollout=(2, 3),
  )
  ref = loop.train(
      experiment.build(c, ref_wd, 2), ref_wd, cluster_lib.resolve(run_lib.cluster_spec(c))
  )
  from digen_jax.outputs import checkpoint as ckpt_lib

  ck = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  state, _ = ck.restore(
      STEPS_2P,
      {
          'params': ref['params'],
          'opt_state': ref['opt_state'],
          'rng': ckpt_lib.key_to_data(jax.random.key(0)),
      },
  )
  ck.close()
  for x, y in zip(jax.tree.leaves(state['params']), jax.tree.leaves(ref['params'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
