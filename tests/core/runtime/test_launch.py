"""launch/local.py and digen_jax.runtime.distributed: env plumbing, multi-process runs, cleanup."""

import importlib.util
import os
import signal
import sys
import time

import pytest

from digen_jax.runtime import distributed
from tests.helpers.paths import TESTS


def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


util = _load('launcher_util', os.path.join(TESTS, 'mp_scripts', 'launcher_util.py'))
local = _load('launch_local', util.LAUNCHER)


def _gone(pid: int) -> bool:
  """True when `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] in ('Z', 'X')
  except FileNotFoundError:
    return True


def _wait_gone(pids, timeout_s=10.0) -> list[int]:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and not all(_gone(p) for p in pids):
    time.sleep(0.05)
  return [p for p in pids if not _gone(p)]


def _read_pids(scratch, ranks, timeout_s=30.0) -> list[int]:
  deadline = time.monotonic() + timeout_s
  paths = [os.path.join(scratch, f'pids.{r}') for r in ranks]
  while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
    time.sleep(0.05)
  return [int(x) for p in paths for x in open(p).read().split()]


# ---------------------------------------------------------------- fast, single-process checks


def test_parse_args_splits_at_double_dash():
  args, cmd = local.parse_args(
      ['--num_processes=3', '--cpu_pinning', '--', 'python', '-c', 'x', '--', 'y']
  )
  assert args.num_processes == 3 and args.cpu_pinning and args.devices_per_process is None
  assert cmd == ['python', '-c', 'x', '--', 'y']
  with pytest.raises(SystemExit):
    local.parse_args(['--num_processes=2', 'python'])  # no '--'
  with pytest.raises(SystemExit):
    local.parse_args(['--num_processes=0', '--', 'python'])
  with pytest.raises(SystemExit):
    local.parse_args(['--num_processes=2', '--'])  # no command


def test_child_env_sets_launcher_vars_and_replaces_device_count():
  args, _ = local.parse_args(['--num_processes=4', '--devices_per_process=3', '--', 'x'])
  base = {'XLA_FLAGS': '--xla_force_host_platform_device_count=4 --xla_foo=1', 'KEEP': 'me'}
  env = local.child_env(base, 2, args, 12345)
  assert env['DIGEN_COORDINATOR_ADDRESS'] == '127.0.0.1:12345'
  assert env['DIGEN_NUM_PROCESSES'] == '4' and env['DIGEN_PROCESS_ID'] == '2'
  assert env['JAX_PLATFORMS'] == 'cpu' and env['KEEP'] == 'me'
  assert env['XLA_FLAGS'].split() == ['--xla_foo=1', '--xla_force_host_platform_device_count=3']
  assert env['PYTHONPATH'].split(os.pathsep)[0] == util.REPO
  # The variables round-trip through distributed.launcher_env.
  kw = distributed.launcher_env(env)
  assert kw == dict(coordinator_address='127.0.0.1:12345', num_processes=4, process_id=2)


def test_launcher_env_validation():
  assert distributed.launcher_env({}) is None
  with pytest.raises(ValueError, match='DIGEN_PROCESS_ID'):
    distributed.launcher_env({'DIGEN_COORDINATOR_ADDRESS': 'h:1', 'DIGEN_NUM_PROCESSES': '2'})
  ok = {'DIGEN_COORDINATOR_ADDRESS': 'h:1', 'DIGEN_NUM_PROCESSES': '2', 'DIGEN_PROCESS_ID': '1'}
  with pytest.raises(ValueError, match=r'\[0, 2\)'):
    distributed.launcher_env(dict(ok, DIGEN_PROCESS_ID='2'))
  with pytest.raises(ValueError, match='host:port'):
    distributed.launcher_env(dict(ok, DIGEN_COORDINATOR_ADDRESS='nohost'))
  with pytest.raises(ValueError, match='not an integer'):
    distributed.launcher_env(dict(ok, DIGEN_NUM_PROCESSES='two'))
  kw = distributed.launcher_env(dict(ok, DIGEN_LOCAL_DEVICE_IDS='0,1'))
  assert kw['local_device_ids'] == [0, 1] and kw['process_id'] == 1


def test_maybe_initialize_without_launcher_is_single_process(monkeypatch):
  for k in distributed.LAUNCHER_ENV_VARS:
    monkeypatch.delenv(k, raising=False)
  info = distributed.maybe_initialize()
  assert info == distributed.ProcessInfo(0, 1) and not info.is_distributed and info.is_coordinator
  with pytest.raises(RuntimeError, match='launch/local.py'):
    distributed.kv_set('k', 'v')


# ---------------------------------------------------------------- multi-process runs


@pytest.mark.slow
def test_two_processes_cross_process_sum_and_kv():
  t0 = time.monotonic()
  code, out = util.run(
      ['--num_processes=2', '--devices_per_process=2', '--cpu_pinning', '--timeout_s=50'],
      util.script('psum.py'),
      timeout_s=60,
  )
  assert code == 0, out
  # Devices hold 10, 11 (process 0) and 20, 21 (process 1).
  for rank in (0, 1):
    assert (
        f'[{rank}] RESULT process={rank} sum=62.0 allgather=[1.0, 2.0] '
        f"kv='hello from {1 - rank}'"
    ) in out, out
  assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_failing_child_kills_the_others(tmp_path):
  code, out = util.run(
      ['--num_processes=3', '--grace_s=2'],
      util.script('fail_or_sleep.py') + [str(tmp_path), 'fail'],
      timeout_s=60,
  )
  assert code == 3, out
  assert '[0] failing with 3' in out and '[1] sleeping' in out and '[2] sleeping' in out, out
  pids = _read_pids(tmp_path, [1, 2], timeout_s=1)  # children and their grandchildren
  assert _wait_gone(pids) == [], (pids, out)


def test_sigterm_while_spawning_stops_every_child(tmp_path):
  """The signal lands while Popen is starting the first child (after its fork, before the
  launcher has recorded it): that child is stopped too; nothing is left running."""
  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  before = set(util.descendants(os.getpid()))
  try:
    with util.signal_after_first_fork(signal.SIGTERM):
      # Children that never print: a child the launcher lost is not ended by its closed pipe.
      sleeper = [sys.executable, '-c', 'import time; time.sleep(60)', str(tmp_path)]
      code = local.main(['--num_processes=2', '--grace_s=5', '--', *sleeper])
  finally:
    for s, h in handlers.items():  # main leaves them ignored: it ends its process
      signal.signal(s, h)
  left = [p for p in sorted(set(util.descendants(os.getpid())) - before) if not _gone(p)]
  for pid in left:  # a lost child (maybe not yet exec'd): end it, then fail
    os.kill(pid, signal.SIGKILL)
  assert left == []
  assert code == 128 + signal.SIGTERM


@pytest.mark.slow
def test_sigterm_and_timeout_stop_everything(tmp_path):
  proc = util.start(
      ['--num_processes=2'], util.script('fail_or_sleep.py') + [str(tmp_path), 'sleep']
  )
  try:
    pids = _read_pids(tmp_path, [0, 1])
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _wait_gone(pids) == [], pids
  finally:
    util.kill_tree(proc)
  # --timeout_s ends a run that would never finish, again leaving nothing behind.
  scratch = tmp_path / 'timeout'
  scratch.mkdir()
  t0 = time.monotonic()
  code, out = util.run(
      ['--num_processes=2', '--timeout_s=5', '--grace_s=1'],
      util.script('fail_or_sleep.py') + [str(scratch), 'sleep'],
      timeout_s=60,
  )
  assert code == 124, out
  assert time.monotonic() - t0 < 30
  assert _wait_gone(_read_pids(scratch, [0, 1], timeout_s=1)) == [], out
