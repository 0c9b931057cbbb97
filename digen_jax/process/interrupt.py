"""SIGTERM / SIGINT: stop at the next safe point, checkpoint, and exit within a bound.

`install(timeout_s)` (the entry points, once, in the main thread) turns both signals into a
process-wide request. The runtime polls it where stopping is safe (`check`: the end of a step,
every wait for the peer, between rollout fragments): the trainer abandons its in-flight step,
saves its last completed step (orbax, atomic) and the process exits with 128 + the signal's
number (143 for SIGTERM, 130 for SIGINT) after one line saying so.

A watchdog thread bounds the whole shutdown: it reads the signal from a wakeup pipe, which the
C-level handler writes at once even while the main thread is inside a long XLA program (where
Python's own handler would not run), and if the process is still alive timeout_s after the
signal it exits anyway (the last committed checkpoint stays intact; an uncommitted save is
discarded at the next start), after printing every thread's stack to stderr: a shutdown that
does not finish is a hang somewhere, and the stacks say where. A second signal exits at once.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import tempfile
import threading
import time

from digen_jax.outputs import faults
from digen_jax.process import peers

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(faults.RunError):
  """The run stopped because it was asked to (SIGTERM/SIGINT); `exit_code` is 128 + signum."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum = signum

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


_lock = threading.Lock()
# nothing_to_save: why this process holds nothing a stop must save (its start: restoring,
# compiling, the first step before its update), or None once it does.
_state = {'signum': None, 'generation': 0, 'nothing_to_save': None}
_installed = {'timeout_s': None}


def name(signum: int) -> str:
  return signal.Signals(signum).name


def requested() -> int | None:
  """The first signal received since install()/reset(), or None."""
  return _state['signum']


def check(where: str) -> None:
  """Raises Interrupted if a stop was requested; `where` says what was abandoned. When the
  launcher stopped this process because a peer died, the message names that peer instead."""
  signum = _state['signum']
  if signum is not None:
    dead = peers.dead_peer()
    why = f'{dead}: stopped' if dead else f'interrupted by {name(signum)}'
    raise Interrupted(signum, f'{why} {where}')


def nothing_to_save(why: str | None) -> None:
  """Marks the process as holding nothing a stop must save (`why`, e.g. 'before its first
  update') or, with None, as holding progress again. While marked, a signal exits at once with
  one line: the main thread may be inside a compile of minutes that no Python handler
  interrupts, and the last checkpoint already holds everything."""
  _state['nothing_to_save'] = why


def _note(signum: int) -> bool:
  """Records the request; True for the first signal of this generation."""
  with _lock:
    if _state['signum'] is not None:
      return False
    _state['signum'] = signum
    return True


def _on_signal(signum, frame):  # Python-level handler: runs when the main thread is in Python
  del frame
  _note(signum)


def _say(text: str) -> None:
  sys.stderr.write(f'digen_jax: {text}\n')
  sys.stderr.flush()


def _watch(read_fd: int, timeout_s: float) -> None:
  deadline, generation, first = None, None, None
  while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([read_fd], [], [], wait)
    if not ready:  # the deadline passed
      if _state['generation'] == generation and _state['signum'] is not None:
        # A shutdown that does not finish is a hang somewhere: the stacks say where, in a file
        # (the log keeps its one line).
        stacks = os.path.join(tempfile.gettempdir(), f'digen_jax_stacks_{os.getpid()}.txt')
        with open(stacks, 'w') as f:
          faulthandler.dump_traceback(file=f, all_threads=True)
        _say(
            f'interrupted by {name(first)}: shutdown did not finish within '
            f'runtime.shutdown_timeout_s={timeout_s:g} s; exiting now (the last committed '
            "checkpoint is intact; rerun the same command to resume; the threads' stacks: "
            f'{stacks})'
        )
        os._exit(128 + first)
      deadline = None  # reset() in between: a test, not a shutdown
      continue
    for signum in os.read(read_fd, 64):
      if signum not in SIGNALS:
        continue
      if deadline is not None and _state['generation'] == generation:
        _say(f'second signal ({name(signum)}): exiting now')
        os._exit(128 + signum)
      _note(signum)
      deadline, generation, first = time.monotonic() + timeout_s, _state['generation'], signum
      if peers.dead_peer() is not None:
        continue  # a peer died: the process's last line says so (one line, peers.py)
      idle = _state['nothing_to_save']
      if idle:
        _say(
            f'interrupted by {name(signum)} {idle}: nothing to save (the last checkpoint is '
            'intact; rerun the same command to resume)'
        )
        os._exit(128 + signum)
      _say(
          f'{name(signum)} received: stopping at the next safe point, checkpointing the last '
          f'completed step, exiting within {timeout_s:g} s (a second signal exits at once)'
      )


def install(timeout_s: float) -> None:
  """SIGTERM/SIGINT -> a stop request and a watchdog that exits timeout_s later. Main thread
  only; a second call does nothing (the first timeout stays)."""
  if _installed['timeout_s'] is not None:
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  for s in SIGNALS:
    signal.signal(s, _on_signal)
  threading.Thread(
      target=_watch, args=(read_fd, float(timeout_s)), name='interrupt-watchdog', daemon=True
  ).start()
  _installed['timeout_s'] = float(timeout_s)


def uninstall() -> None:
  """Back to Python's default SIGTERM/SIGINT behaviour (tests that installed in-process)."""
  if _installed['timeout_s'] is None:
    return
  signal.set_wakeup_fd(-1)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  _installed['timeout_s'] = None
  reset()


def reset() -> None:
  """Forgets a request (and cancels its watchdog deadline): for in-process tests that stop a
  run by signal and then resume it in the same process."""
  with _lock:
    _state['signum'] = None
    _state['generation'] += 1
