"""Start N cooperating copies of a command on this machine (one jax.distributed process each).

Usage:
  python launch/local.py --num_processes=N [--devices_per_process=K] [--cpu_pinning]
                         [--port=P] [--platforms=cpu] [--timeout_s=T] [--grace_s=G] -- CMD [ARGS...]

Each copy i (0 <= i < N) gets the environment of this launcher plus
  DIGEN_COORDINATOR_ADDRESS=127.0.0.1:<port>  (a free port unless --port is given)
  DIGEN_NUM_PROCESSES=N, DIGEN_PROCESS_ID=i
  JAX_PLATFORMS=<--platforms>                 (default cpu; --platforms='' leaves it alone)
  XLA_FLAGS=... --xla_force_host_platform_device_count=K   (only with --devices_per_process;
                                              replaces any count already in XLA_FLAGS)
  PYTHONPATH=<repo root>:...                  (so `digen_jax` imports without installing)
which `digen_jax.runtime.distributed.maybe_initialize()` turns into jax.distributed.initialize.

--cpu_pinning pins copy i to the i % ncores-th core this launcher may run on (taskset when
installed, else os.sched_setaffinity).

Output: stdout and stderr of copy i are merged and every line is printed as "[i] line".
Exit: 0 when every copy exits 0. On the first copy that fails (nonzero exit or a signal), all
other copies are terminated (SIGTERM to their process groups, SIGKILL after --grace_s) and the
launcher exits with the failing copy's code (128+signal for a signal), naming the copy. Before
the SIGTERM it writes that copy and its code to the file named by DIGEN_LAUNCH_STATUS in every
copy's environment: a digen_jax copy's last line then names the peer that died
(digen_jax/process/peers.py).
SIGINT/SIGTERM to the launcher are forwarded to every copy as SIGTERM (a digen_jax.main copy
checkpoints its last completed step and exits within its config.runtime.shutdown_timeout_s,
default 60 s) and the launcher exits 130/143 once they are gone, listing their exit codes;
--timeout_s>0 stops everything the same way after T seconds (exit 124). --grace_s (default 90,
above the runtime's bound) is the SIGTERM -> SIGKILL backstop. Each copy runs in its own process
group, so whatever it starts is terminated with it. Should the launcher itself be SIGKILLed, the
copies still die (PDEATHSIG); only processes they started themselves could then outlive them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_STATUS = 'DIGEN_LAUNCH_STATUS'  # digen_jax/process/peers.py reads it
_PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """Splits `argv` at the first '--' into launcher flags and the command."""
  if '--' not in argv:
    raise SystemExit('usage: local.py --num_processes=N [flags] -- CMD [ARGS...] (missing "--")')
  split = argv.index('--')
  flags, cmd = argv[:split], argv[split + 1 :]
  p = argparse.ArgumentParser(prog='launch/local.py', description=__doc__.split('\n')[0])
  p.add_argument('--num_processes', type=int, required=True, help='copies to start (>= 1)')
  p.add_argument(
      '--devices_per_process',
      type=int,
      default=None,
      help='fake host-platform (CPU) devices per copy',
  )
  p.add_argument('--cpu_pinning', action='store_true', help='pin copy i to core i % ncores')
  p.add_argument('--port', type=int, default=0, help='coordinator port (0: pick a free one)')
  p.add_argument('--platforms', default='cpu', help="JAX_PLATFORMS for the copies ('' = inherit)")
  p.add_argument(
      '--timeout_s', type=float, default=0.0, help='kill everything after this (0=never)'
  )
  p.add_argument(
      '--grace_s',
      type=float,
      default=90.0,
      help="SIGTERM -> SIGKILL delay (above the copies' runtime.shutdown_timeout_s)",
  )
  args = p.parse_args(flags)
  if args.num_processes < 1:
    p.error(f'--num_processes={args.num_processes} must be >= 1')
  if args.devices_per_process is not None and args.devices_per_process < 1:
    p.error(f'--devices_per_process={args.devices_per_process} must be >= 1')
  if not 0 <= args.port <= 65535:
    p.error(f'--port={args.port} must be in [0, 65535] (0: pick a free one)')
  for name in ('timeout_s', 'grace_s'):
    value = getattr(args, name)
    if not 0 <= value < float('inf'):  # also NaN
      p.error(f'--{name}={value} must be a finite number >= 0')
  if not cmd:
    p.error('no command after "--"')
  return args, cmd


def free_port() -> int:
  """A TCP port that was free a moment ago (the coordinator binds it shortly after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def child_env(base: dict, rank: int, args: argparse.Namespace, port: int) -> dict:
  env = dict(base)
  env['DIGEN_COORDINATOR_ADDRESS'] = f'127.0.0.1:{port}'
  env['DIGEN_NUM_PROCESSES'] = str(args.num_processes)
  env['DIGEN_PROCESS_ID'] = str(rank)
  if args.platforms:
    env['JAX_PLATFORMS'] = args.platforms
  if args.devices_per_process is not None:
    flags = [
        f
        for f in env.get('XLA_FLAGS', '').split()
        if not f.startswith('--xla_force_host_platform_device_count')
    ]
    flags.append(f'--xla_force_host_platform_device_count={args.devices_per_process}')
    env['XLA_FLAGS'] = ' '.join(flags)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO_ROOT, env.get('PYTHONPATH')) if p)
  env['PYTHONUNBUFFERED'] = '1'  # lines show up as they are printed, not at exit
  return env


def _die_with_parent():
  """preexec_fn: SIGKILL this child if the launcher dies (even by SIGKILL)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
  except (OSError, AttributeError):
    pass  # not Linux: the signal handlers and the finally-block still clean up


class Launcher:
  """Owns the children: spawning, output forwarding, and killing their process groups."""

  def __init__(self, args: argparse.Namespace, cmd: list[str]):
    self.args, self.cmd = args, cmd
    self.procs: list[subprocess.Popen] = []
    self.readers: list[threading.Thread] = []
    self.out_lock = threading.Lock()
    self._killed = False
    # Where a failed copy is recorded for the others (ENV_STATUS in their environment).
    self.status_dir = tempfile.mkdtemp(prefix='digen_launch_')
    self.status_path = os.path.join(self.status_dir, 'status.json')

  def spawn(self) -> None:
    port = self.args.port or free_port()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
    taskset = shutil.which('taskset')
    for rank in range(self.args.num_processes):
      cmd = list(self.cmd)
      core = cores[rank % len(cores)] if (self.args.cpu_pinning and cores) else None
      if core is not None and taskset:
        cmd = [taskset, '-c', str(core)] + cmd
      # All children are spawned before any reader thread starts, so preexec_fn runs while the
      # launcher is single-threaded (it is unsafe otherwise).
      env = child_env(os.environ, rank, self.args, port)
      env[ENV_STATUS] = self.status_path
      proc = subprocess.Popen(
          cmd,
          env=env,
          stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          start_new_session=True,
          preexec_fn=_die_with_parent,
      )
      if core is not None and not taskset:
        os.sched_setaffinity(proc.pid, {core})
      self.procs.append(proc)
    for rank, proc in enumerate(self.procs):
      t = threading.Thread(target=self._forward, args=(rank, proc.stdout), daemon=True)
      t.start()
      self.readers.append(t)

  def _forward(self, rank: int, stream) -> None:
    prefix = f'[{rank}] '.encode()
    out = sys.stdout.buffer
    for line in iter(stream.readline, b''):
      if not line.endswith(b'\n'):
        line += b'\n'
      with self.out_lock:
        out.write(prefix + line)
        out.flush()
    stream.close()

  def kill_all(self) -> None:
    """SIGTERM every live child's process group, then SIGKILL what is left after grace_s."""
    if self._killed:
      return
    self._killed = True
    live = [p for p in self.procs if p.poll() is None]
    for p in live:
      _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + self.args.grace_s
    for p in live:
      try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    for p in self.procs:
      # A copy's own children get a moment to end by themselves, then the group is killed: also
      # the groups of copies that already exited, whose children may linger. (A copy's stderr
      # watcher, digen_jax/process/peers.py, has its own group: it ends once the copy's stderr
      # closes, and join_readers waits for its last line.)
      _wait_group(p.pid, deadline=time.monotonic() + 2.0)
      _signal_group(p.pid, signal.SIGKILL)
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass

  def exit_codes(self) -> str:
    """'0: 143, 1: 143' (128 + signal for a copy a signal killed; '?' if still running)."""
    codes = [p.poll() for p in self.procs]
    return ', '.join(
        f'{i}: {"?" if c is None else (128 - c if c < 0 else c)}' for i, c in enumerate(codes)
    )

  def wait(self, interrupted=lambda: False) -> int | None:
    """Polls the children; returns the launcher's exit code, or None once interrupted()."""
    deadline = time.monotonic() + self.args.timeout_s if self.args.timeout_s > 0 else None
    while not interrupted():
      codes = [p.poll() for p in self.procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        rank, code = failed[0]
        code = 128 - code if code < 0 else code  # killed by signal -s
        self._note(f'process {rank} exited with {code}; terminating the others')
        # Before the SIGTERM: each survivor's last line names the copy that died (digen_jax's
        # process/peers.py reads this file).
        self._write_status({'process': rank, 'exit_code': code})
        self.kill_all()
        return code
      if all(c == 0 for c in codes):
        return 0
      if deadline is not None and time.monotonic() > deadline:
        self._note(f'timeout after {self.args.timeout_s}s; terminating all processes')
        self.kill_all()
        return 124
      time.sleep(0.05)
    return None

  def _write_status(self, status: dict) -> None:
    tmp = self.status_path + '.tmp'
    with open(tmp, 'w') as f:
      json.dump(status, f)
    os.replace(tmp, self.status_path)  # readers see all of it or nothing

  def join_readers(self) -> None:
    for t in self.readers:
      t.join(timeout=5)

  def _note(self, msg: str) -> None:
    with self.out_lock:
      sys.stdout.flush()
      print(f'[launcher] {msg}', file=sys.stderr, flush=True)


def _wait_group(pgid: int, deadline: float) -> None:
  """Until the process group is empty or the deadline passed."""
  while time.monotonic() < deadline:
    try:
      os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
      return
    time.sleep(0.02)


def _signal_group(pid: int, sig: int) -> None:
  try:
    os.killpg(pid, sig)  # start_new_session=True: the child's pgid is its pid
  except (ProcessLookupError, PermissionError):
    pass


def main(argv: list[str]) -> int:
  args, cmd = parse_args(argv)
  launcher = Launcher(args, cmd)

  # The handler only records the signal; wait() acts on it. Raising from the handler could land
  # inside Popen after its fork: a child started but never recorded, so never stopped.
  caught: list[int] = []

  def on_signal(signum, frame):
    caught.append(signum)

  old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  code, interrupted = 1, False
  try:
    launcher.spawn()
    code = launcher.wait(lambda: bool(caught))
    if code is None:
      name = signal.Signals(caught[0]).name
      launcher._note(f'interrupted by {name}: forwarding SIGTERM to every process')
      code, interrupted = 128 + caught[0], True
  finally:
    # Ignore further Ctrl-C while cleaning up so that no child is left behind.
    for s in old:
      signal.signal(s, signal.SIG_IGN)
    t0 = time.monotonic()
    launcher.kill_all()
    launcher.join_readers()
    shutil.rmtree(launcher.status_dir, ignore_errors=True)
    if code != 0 and launcher.procs:
      launcher._note(
          f'{"interrupted: " if interrupted else ""}every process stopped within '
          f'{time.monotonic() - t0:.1f} s (exit codes {launcher.exit_codes()})'
      )
  return code


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
