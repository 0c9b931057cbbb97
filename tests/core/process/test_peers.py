"""A dead peer is one line from each survivor: after kill -9 of the trainer, the
rollout process was aborted by the jax.distributed client with a ~40-line C++ and Python stack
dump; after kill -9 of the rollout, the trainer printed two lines. digen_jax/process/peers.py's
stderr watcher and launch/local.py's status file, on a recorded dump and on real runs."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from digen_jax.process import peers
from tests.mp_scripts import launcher_util as util
from tests.helpers.paths import REPO

# What the rollout process printed when the trainer (process 0) was killed (jax 0.10.2).
ABORT_DUMP = """\
W1128 21:21:37.040848   29078 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}. This is only expected if one of the tasks is unhealthy. Check the logs for the actual root cause.
E1128 21:21:37.040904   29078 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1128 21:21:37.040948   29078 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1128 21:21:37.040952   29078 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
*** Check failure stack trace: ***
    @     0x7f9e99840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f9e959040ee  xla::CoordinationServiceAgent::SetError()
Fatal Python error: Aborted

Thread 0x00007f9ea901fb80 (most recent call first):
  File "/work/main/digen_jax/runtime/distributed.py", line 199 in kv_get
  File "/work/main/digen_jax/main.py", line 159 in <module>

Extension modules: yaml._yaml, numpy._core._multiarray_umath (total: 35)
"""
ROLES = '\x1edigen-roles {"0": "trainer", "1": "rollout"}\n'


def _watch(text: str, status: dict | None, tmp_path, chunks=None) -> str:
  """The watcher of process 1 fed `text` (or `chunks`: (delay_s, text) pairs), returns what it
  printed."""
  env = dict(os.environ)
  env.pop(peers.ENV_STATUS, None)
  if status is not None:
    path = tmp_path / 'status.json'
    path.write_text(json.dumps(status))
    env[peers.ENV_STATUS] = str(path)
  p = subprocess.Popen(
      [sys.executable, os.path.join(REPO, 'digen_jax', 'process', 'peers.py'), '1'],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      env=env,
  )
  for delay, part in chunks or [(0.0, text)]:
    time.sleep(delay)
    p.stdin.write(part.encode())
    p.stdin.flush()
  p.stdin.close()
  out = p.stdout.read().decode()
  assert p.wait(timeout=30) == 0
  return out


def test_the_abort_dump_becomes_one_line_naming_the_peer_and_its_exit_code(tmp_path):
  before = 'I1128 21:21:36.9 rollout.py:232] rollout: step 2 fragment 1/1 sampled\n'
  out = _watch(ROLES + before + ABORT_DUMP, {'process': 0, 'exit_code': 137}, tmp_path)
  assert out.splitlines() == [
      before.strip(),
      'digen_jax: process 0 (trainer) exited with 137 (SIGKILL); process 1 (rollout) stops too '
      '(rerun the same command to resume from the last checkpoint)',
  ], out


def test_without_the_launcher_the_line_names_the_service_host(tmp_path):
  out = _watch(ABORT_DUMP, None, tmp_path)
  (line,) = out.splitlines()
  assert line.startswith('digen_jax: the jax.distributed service is gone: process 0, which hosts')


def test_other_output_passes_and_a_last_line_is_not_repeated(tmp_path):
  # Coordination warnings that no abort follows are passed on (after the hold), in order.
  warn = ABORT_DUMP.splitlines(keepends=True)[:3]
  out = _watch('', None, tmp_path, chunks=[(0, 'a\n'), (0, ''.join(warn)), (1.5, 'b\npartial')])
  assert out == 'a\n' + ''.join(warn) + 'b\npartial\n', out
  # A process that printed its last line (then aborted as its peer exited too) adds none.
  final = 'digen_jax: --workdir=/x is in use by another run (...)\n\x1edigen-final\n'
  out = _watch(final + ABORT_DUMP, {'process': 0, 'exit_code': 1}, tmp_path)
  assert out == final.splitlines(keepends=True)[0], out
  # ... also when it came while the client's errors before the abort were being held back, or
  # once the abort had begun (its stack trace takes a while; the main thread ends first).
  dump = ABORT_DUMP.splitlines(keepends=True)
  for cut in (5, 7):
    out = _watch(''.join(dump[:cut]) + final + ''.join(dump[cut:]), None, tmp_path)
    assert out == final.splitlines(keepends=True)[0], (cut, out)


def _rows(wd):
  path = os.path.join(wd, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  return [json.loads(l) for l in open(path) if '"loss"' in l]


class _Output:
  """The launcher's merged output, read on a thread."""

  def __init__(self, proc):
    self.lines: list[str] = []
    self._t = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
    self._t.start()

  def pid_of(self, role: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      for line in list(self.lines):
        if f'({role})  pid ' in line:
          return int(line.split(f'({role})  pid ')[1].split()[0])
      time.sleep(0.1)
    raise AssertionError('no pid line; output:\n' + ''.join(self.lines)[-4000:])

  def text(self) -> str:
    self._t.join(timeout=30)
    return ''.join(self.lines)


@pytest.mark.slow
@pytest.mark.parametrize('victim, survivor', [('trainer', 'rollout'), ('rollout', 'trainer')])
def test_kill9_of_one_process_is_one_line_from_the_other(tmp_path, victim, survivor):
  wd = str(tmp_path / 'run')
  rank = {'trainer': 0, 'rollout': 1}
  proc = util.start(
      ['--num_processes=2', '--devices_per_process=2', '--timeout_s=400'],
      [
          sys.executable,
          '-m',
          'digen_jax.main',
          '--config=configs/qwenimage.py:tiny_disagg',
          f'--workdir={wd}',
          '--config.total_steps=50',
      ],
  )
  out = _Output(proc)
  try:
    pid = out.pid_of(victim, 300)
    deadline = time.monotonic() + 300
    while not _rows(wd):
      assert proc.poll() is None and time.monotonic() < deadline, out.text()[-4000:]
      time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    code = proc.wait(timeout=120)
  finally:
    util.kill_tree(proc)
  text = out.text()
  assert code == 137, text[-4000:]
  mine = [l for l in text.splitlines() if l.startswith(f'[{rank[survivor]}] ')]
  after = mine[[i for i, l in enumerate(mine) if 'main.py' in l and ' pid ' in l][0] + 1 :]
  # What the survivor says besides its INFO log and gloo's connection notes (printed by two
  # threads at once, they may interleave) at the first collective.
  said = [l for l in after if not l.split('] ', 1)[1].startswith('I1') and 'peer ranks' not in l]
  assert len(said) == 1, text[-4000:]
  line = said[0]
  assert f'digen_jax: process {rank[victim]} ({victim}) exited with 137 (SIGKILL)' in line, line
  assert 'rerun the same command to resume' in line, line
  assert 'Traceback' not in text and 'Fatal Python error' not in text, text[-4000:]
