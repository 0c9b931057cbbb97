"""One run per workdir: an exclusive lock held for the run's life.

Two runs on one workdir overwrite each other's config.json, interleave their metrics.jsonl rows
and break each other's checkpoint saves. `acquire(workdir)`, called by the entry points before
they write anything there, takes <workdir>/run.lock or refuses in one line naming the run that
holds it:

- the lock is flock(2) on run.lock, which the kernel drops when its process ends however it ends
  (kill -9 included), so a killed run's lock is taken over, with a warning naming that run, by
  the next one; across hosts that share the file system this relies on its locks (NFS, Lustre
  with `-o flock`);
- run.lock holds the holder's pid, host, boot id and process start time: where flock is not
  available on the file system the record alone decides (a holder on this host that is no
  longer running, or one from before a reboot, is stale; one on another host is not known to be
  gone and refuses), and where a live holder's record sits under a lock that succeeded anyway
  (a file system that accepts flock without enforcing it) the record refuses too;
- a run that ends (normally, on an error line, on SIGTERM) deletes run.lock, and the workdir
  itself if the lock created it and nothing else was written.

A multi-process run shares one lock: its process 0 takes it (digen_jax/main.py passes the
outcome to the others through the jax.distributed key-value store).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import time

from absl import logging

from digen_jax.outputs import faults

LOCK_FILE = 'run.lock'
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


class WorkdirError(faults.RunError):
  """The workdir cannot be used: not a directory, not creatable, or in use by another run."""


def _boot_id() -> str | None:
  try:
    with open('/proc/sys/kernel/random/boot_id') as f:
      return f.read().strip()
  except OSError:
    return None


def start_time(pid: int) -> int | None:
  """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22): with the pid,
  it names one process, not whichever process reuses the pid later. None if there is none."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return int(f.read().rsplit(')', 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


def _command() -> str:
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  program = f'python -m {spec.name}' if spec else os.path.basename(sys.argv[0] or 'python')
  return ' '.join([program, *sys.argv[1:]])


def holder_record(processes: int) -> dict:
  argv = _command()
  return {
      'pid': os.getpid(),
      'host': socket.gethostname(),
      'boot_id': _boot_id(),
      'start_time': start_time(os.getpid()),
      'started': time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()),
      'processes': processes,
      'command': argv if len(argv) <= 300 else argv[:297] + '...',
  }


def _describe(holder: dict | None) -> str:
  if not holder:
    return 'its record is not written yet'
  n = holder.get('processes', 1)
  procs = f', process 0 of {n}' if isinstance(n, int) and n > 1 else ''
  return (
      f"pid {holder.get('pid')} on {holder.get('host')}{procs}, started "
      f"{holder.get('started')}: {holder.get('command')}"
  )


def _alive(holder: dict) -> bool | None:
  """Whether the recorded holder still runs: True/False on this host since its boot, None (not
  known) for a holder on another host."""
  if holder.get('host') != socket.gethostname():
    return None
  if holder.get('boot_id') != _boot_id():
    return False  # this host rebooted since
  pid = holder.get('pid')
  if not isinstance(pid, int) or pid == os.getpid():
    return False
  started = start_time(pid)
  return started is not None and started == holder.get('start_time')


def _read(fd: int) -> dict | None:
  os.lseek(fd, 0, os.SEEK_SET)
  data = b''
  while chunk := os.read(fd, 65536):
    data += chunk
  try:
    holder = json.loads(data.decode())
  except (UnicodeDecodeError, ValueError):
    return None  # empty (being written) or not ours
  return holder if isinstance(holder, dict) else None


def _flock(fd: int) -> bool | None:
  """True: locked; False: another open file holds it; None: the file system has no flock."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  except OSError as e:
    if e.errno in _NO_FLOCK:
      return None
    raise


def _is(fd: int, path: str) -> bool:
  """Whether `fd` is still the file at `path` (a run that ends unlinks run.lock: a lock taken on
  the unlinked file would lock nothing)."""
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


def _prepare(workdir: str) -> bool:
  """Checks that `workdir` is or can become a directory and creates it. True if created here."""
  if not workdir:
    raise WorkdirError('--workdir is empty: give the run directory, e.g. --workdir=/tmp/run')
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(
        f'--workdir={workdir} is a file, not a directory: give a directory (created if missing)'
    )
  if os.path.isdir(workdir):
    return False
  try:
    os.makedirs(workdir)
  except FileExistsError:
    return False  # created meanwhile by someone else (the lock decides next)
  except OSError as e:
    where = f' ({e.filename})' if e.filename and e.filename != workdir else ''
    raise WorkdirError(
        f'--workdir={workdir} cannot be created: {e.strerror}{where}; give a directory path '
        'whose parents are directories you can write to'
    ) from None
  return True


@dataclasses.dataclass
class Lock:
  """<workdir>/run.lock, held until release()."""

  workdir: str
  path: str
  fd: int | None
  created_workdir: bool

  def release(self) -> None:
    """Deletes run.lock (and the workdir if the lock created it and it is empty). Idempotent."""
    if self.fd is None:
      return
    try:
      if _is(self.fd, self.path):
        os.unlink(self.path)  # while still locked: no one can lock this file meanwhile
    except OSError:
      pass  # left behind: the next run finds it unlocked and takes it over
    finally:
      os.close(self.fd)
      self.fd = None
    if self.created_workdir:
      try:
        os.rmdir(self.workdir)  # only if empty: a run refused before writing leaves nothing
      except OSError:
        pass


def acquire(workdir: str, processes: int = 1) -> Lock:
  """Takes the workdir's lock for this process (and the `processes` - 1 others of its run), or
  raises WorkdirError in one line: the workdir is not usable, or another run holds it."""
  created = _prepare(workdir)
  path = os.path.join(workdir, LOCK_FILE)
  for _ in range(100):  # more than one turn only while a finishing run deletes run.lock
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      raise WorkdirError(
          f'--workdir={workdir}: cannot open its lock file {path} ({e.strerror}): give a '
          'directory you can write to'
      ) from None
    try:
      locked = _flock(fd)
      if locked is not False and not _is(fd, path):
        os.close(fd)
        continue
      holder = _read(fd)
      alive = _alive(holder) if holder else False
      if locked is False or alive or (locked is None and alive is None):
        raise WorkdirError(
            f'--workdir={workdir} is in use by another run ({_describe(holder)}): wait for it to '
            'end or stop it, or give this run another --workdir'
            + ('' if locked is not None else f' (if that run is gone, delete {path})')
        )
      if holder:
        logging.warning(
            '%s: the run that held it is gone (%s); this run takes the workdir over',
            path,
            _describe(holder),
        )
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(holder_record(processes)).encode(), 0)
      return Lock(workdir, path, fd, created)
    except BaseException:
      os.close(fd)
      if created:
        try:
          os.rmdir(workdir)
        except OSError:
          pass
      raise
  raise WorkdirError(f'--workdir={workdir}: could not take {path}: it keeps being replaced')
