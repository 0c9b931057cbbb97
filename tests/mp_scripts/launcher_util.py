"""Runs launch/local.py from tests with a hard timeout and no leftovers, whatever happens."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tests.helpers.paths import REPO

LAUNCHER = os.path.join(REPO, 'launch', 'local.py')
SCRIPTS = os.path.join(REPO, 'tests', 'mp_scripts')


def start(launcher_flags: list[str], cmd: list[str]) -> subprocess.Popen:
  """Starts the launcher in its own session (so it and everything under it can be killed)."""
  return subprocess.Popen(
      [sys.executable, LAUNCHER, *launcher_flags, '--', *cmd],
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
  )


def descendants(pid: int) -> list[int]:
  """Every live process below `pid` (children, grandchildren, ...), from /proc."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir('/proc'):
    if not entry.isdigit():
      continue
    try:
      with open(f'/proc/{entry}/stat') as f:
        ppid = int(f.read().rsplit(')', 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      out.append(c)
      todo.append(c)
  return out


def kill_tree(proc: subprocess.Popen) -> None:
  """If the launcher still runs (the test failed or timed out), SIGKILLs it and everything it
  started, grandchildren included (those are in other process groups and would not die with it)."""
  if proc.poll() is None:
    below = descendants(proc.pid)
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    for pid in below:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.wait(timeout=10)


# After timeout_s, how long the launcher gets to stop its copies (it SIGTERMs them; a copy stuck
# past its runtime.shutdown_timeout_s, 60 s by default, prints its threads' stacks and exits).
STOP_GRACE_S = 75.0


def run(launcher_flags: list[str], cmd: list[str], timeout_s: float = 60) -> tuple[int, str]:
  """Runs the launcher to completion; returns (exit code, merged output). Past timeout_s the
  launcher is stopped (SIGTERM, then SIGKILL to everything) and the code is -1, with every line
  printed until then, a hung copy's stacks included, so a failing test shows where it hung."""
  proc = start(launcher_flags, cmd)
  try:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGTERM)  # the launcher forwards it to every copy
    try:
      out, _ = proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
      kill_tree(proc)
      out, _ = proc.communicate()
    return -1, f'{out}\nlauncher_util: timed out after {timeout_s:g} s; stopped the launcher\n'
  finally:
    kill_tree(proc)


def script(name: str) -> list[str]:
  return [sys.executable, os.path.join(SCRIPTS, name)]


def procs_mentioning(text: str) -> list[int]:
  """Pids of the live processes whose command line contains `text` (from /proc)."""
  pids = []
  for d in os.listdir('/proc'):
    try:
      if d.isdigit() and text in open(f'/proc/{d}/cmdline', 'rb').read().decode(errors='replace'):
        pids.append(int(d))
    except OSError:
      pass
  return pids


@contextlib.contextmanager
def signal_after_first_fork(signum: int):
  """Sends `signum` to this process inside the next subprocess.Popen, once the child is forked:
  as Popen waits for the child's exec (its os.read in _execute_child). The handler runs there."""
  code = subprocess.Popen._execute_child.__code__

  def hook(frame, event, arg):
    if event == 'c_call' and arg is os.read and frame.f_code is code:
      sys.setprofile(None)
      os.kill(os.getpid(), signum)

  sys.setprofile(hook)
  try:
    yield
  finally:
    sys.setprofile(None)
