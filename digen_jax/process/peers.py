"""A dead peer of a multi-process run, reported by each surviving process in one line.

launch/local.py writes which copy died and its exit code to the file named by
$DIGEN_LAUNCH_STATUS before it stops the others (SIGTERM). A survivor then ends one of two ways:

- it stops at its next safe point (the trainer when the rollout died: it checkpoints first), and
  its one last line, built by digen_jax.process.interrupt, names the peer and its exit code;
- it is aborted by the jax.distributed client (the rollout when the trainer died: the trainer,
  process 0, hosts the coordination service, and a client that loses it ends its process at once
  from C++, with a stack dump). `watch_stderr` routes stderr through a small child process (this
  file run as a script) that outlives that abort: it drops the dump and writes the one line.

Without the launcher (launch/slurm.sh) the peer's exit code is not known here; the line says the
service is gone and which process hosted it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

ENV_STATUS = 'DIGEN_LAUNCH_STATUS'
# Lines on stderr that only the watcher reads: the processes' roles, and "this process has
# printed its last line" (an abort after it, e.g. its peer exiting too, adds no line of its own).
_ROLES_MARK = '\x1edigen-roles '
_FINAL_MARK = '\x1edigen-final'
_roles: dict[int, str] = {}
_watched = {'on': False, 'rank': None, 'said': False}


def exit_text(code: int) -> str:
  """137 -> '137 (SIGKILL)'."""
  try:
    return f'{code} ({signal.Signals(code - 128).name})' if code > 128 else str(code)
  except ValueError:
    return str(code)


def name(rank: int, roles: dict[int, str] | None = None) -> str:
  role = (_roles if roles is None else roles).get(rank)
  return f'process {rank} ({role})' if role else f'process {rank}'


def set_roles(roles: dict[int, str]) -> None:
  """Each process's role (trainer, rollout), for the lines that name a process."""
  _roles.update(roles)
  if _watched['on']:
    sys.stderr.write(_ROLES_MARK + json.dumps(roles) + '\n')
    sys.stderr.flush()


def last_line(text: str | None = None) -> None:
  """Prints this process's last line (if given) to stderr, and tells the watcher it was the
  last: the process is about to exit. Only the first call prints: a process has one last line
  (a peer failing while it exits is not a second cause)."""
  if _watched['said']:
    return
  _watched['said'] = True
  text = '' if text is None else text + '\n'
  # One write: nothing another thread prints comes between the line and the mark.
  sys.stderr.write(text + (_FINAL_MARK + '\n' if _watched['on'] else ''))
  sys.stderr.flush()


def _read_status(path: str | None, wait_s: float) -> dict | None:
  deadline = time.monotonic() + wait_s
  while path:
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError):
      pass
    if time.monotonic() >= deadline:
      return None
    time.sleep(0.02)
  return None


def dead_peer(
    wait_s: float = 0.0, roles: dict[int, str] | None = None, me: int | None = None
) -> str | None:
  """'process 1 (rollout) exited with 137 (SIGKILL)' once the launcher reported another copy
  that ended with an error, else None."""
  status = _read_status(os.environ.get(ENV_STATUS), wait_s)
  me = _watched['rank'] if me is None else me
  if not status or status['process'] == me:
    return None
  return f"{name(status['process'], roles)} exited with {exit_text(status['exit_code'])}"


def stop_line(dead: str, me: int, roles: dict[int, str] | None = None) -> str:
  return (
      f'digen_jax: {dead}; {name(me, roles)} stops too (rerun the same command to resume from '
      'the last checkpoint)'
  )


def watch_stderr(process_id: int) -> None:
  """Routes this process's stderr (fd 2) through the watcher (a child in its own process group,
  so the launcher's signals to this process's group never reach it, not even while it starts,
  and that ignores SIGTERM and SIGINT; it ends when every writer of its pipe has closed it, i.e.
  after this process)."""
  if _watched['on']:
    return
  _watched['rank'] = process_id
  read_fd, write_fd = os.pipe()
  out = os.dup(2)
  try:
    subprocess.Popen(
        [sys.executable, '-u', os.path.abspath(__file__), str(process_id)],
        stdin=read_fd,
        stdout=out,
        stderr=out,
        close_fds=True,
        process_group=0,
    )
  except OSError as e:  # no watcher: a peer's death may then show the client's stack dump
    sys.stderr.write(f'digen_jax: warning: no stderr watcher ({e}); continuing without it\n')
    os.close(write_fd)
    return
  finally:
    os.close(read_fd)
    os.close(out)
  sys.stderr.flush()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  _watched['on'] = True


# ------------------------------------------------------------------ the watcher (a child process)

# The jax.distributed client's last words when it loses the coordination service (xla's
# client.h), and what may come just before them, held back for a second (dropped if the abort
# follows, passed on if not): the client's logged errors, and a traceback of the main thread's
# call to the peer failing at the same moment.
_ABORT = b'Terminating process because the JAX distributed service detected fatal errors'
_PRELUDE = (
    b'coordination_service_agent.cc',
    b'preemption_sync_manager.cc',
    b'coordination_service.cc',
    b'Additional GRPC error information',
    b':UNKNOWN:Error received from peer',
    b'Traceback (most recent call last):',
    b'Exception in thread ',
)
_HOLD_S = 1.0


def _abort_line(me: int, roles: dict[int, str]) -> str:
  # The launcher writes the status within its poll interval of the death.
  dead = dead_peer(wait_s=2.0, roles=roles, me=me)
  if dead is None:
    host = 'another process of this job' if me == 0 else f'{name(0, roles)}, which hosts it,'
    dead = f'the jax.distributed service is gone: {host} died or is unreachable'
  return stop_line(dead, me, roles) + '\n'


def _watch(me: int) -> None:
  for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # the launcher stops the process group: outlive the rest
  out, fd = sys.stdout.buffer, sys.stdin.fileno()
  roles: dict[int, str] = {}
  buf, held, until, aborted, final = b'', [], None, False, False
  # The process's last line (last_line()) if it was held back or came after the abort began:
  # it is written whatever follows, instead of the abort's line.
  last, prev, prev_out = None, None, False

  def emit(lines):
    out.write(b''.join(l + b'\n' for l in lines))
    out.flush()

  while True:
    wait = None if until is None else max(0.0, until - time.monotonic())
    if not select.select([fd], [], [], wait)[0]:  # held lines that no abort followed
      if not aborted:
        emit(held + ([last] if last is not None else []))
      held, until, last = [], None, None
      continue
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      break
    *lines, buf = (buf + chunk).split(b'\n')
    for line in lines:
      if line.startswith(_ROLES_MARK.encode()):
        roles.update({int(k): v for k, v in json.loads(line[len(_ROLES_MARK) :]).items()})
        continue
      if line == _FINAL_MARK.encode():  # last_line() wrote its text just before the mark
        final = True
        if prev is not None and not prev_out:
          last = prev
          if held and held[-1] is prev:
            held.pop()
        continue
      prev, prev_out = line, False
      if aborted:
        continue
      if _ABORT in line:
        aborted, held = True, []
      elif held or any(p in line for p in _PRELUDE):
        held.append(line)
        until = until or time.monotonic() + _HOLD_S
      else:
        emit([line])
        prev_out = True
  if not aborted:
    emit(held + ([last] if last is not None else []) + ([buf] if buf else []))
  elif last is not None:
    emit([last])
  elif not final:
    out.write(_abort_line(me, roles).encode())
    out.flush()


if __name__ == '__main__':
  _watch(int(sys.argv[1]))
