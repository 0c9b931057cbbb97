"""Runs launch/local.py from tests with a hard timeout and no leftovers, whatever happens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def run(launcher_flags: list[str], cmd: list[str], timeout_s: float = 60) -> tuple[int, str]:
  """Runs the launcher to completion; returns (exit code, merged output)."""
  proc = start(launcher_flags, cmd)
  try:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out
  finally:
    kill_tree(proc)


def script(name: str) -> list[str]:
  return [sys.executable, os.path.join(SCRIPTS, name)]
