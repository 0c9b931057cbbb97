"""Multi-process start-up and a small key-value store shared by all processes.

`launch/local.py` (one machine) and `launch/slurm.sh` (a cluster) start N copies of a command
and give each one these environment variables:

  DIGEN_COORDINATOR_ADDRESS  host:port of the coordinator service (process 0 binds it)
  DIGEN_NUM_PROCESSES        N
  DIGEN_PROCESS_ID           this process's rank, 0..N-1
  DIGEN_LOCAL_DEVICE_IDS     optional, e.g. "0" or "0,1": the local devices this process may use
                             (one-process-per-GPU launches)

`maybe_initialize()` reads them and calls `jax.distributed.initialize`; without them it does
nothing and reports a single process. It must run before anything touches a JAX backend.

Every process then sees the global device list (`jax.devices()`), its own devices
(`jax.local_devices()`), and can use the coordinator's key-value store (`kv_set` / `kv_get`)
to exchange short strings, e.g. transfer-server addresses (see `runtime/transfer.py`).
Cross-process collectives on CPU use gloo.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax

from digen_jax.process import interrupt
from digen_jax.process.launch_env import ENV_COORDINATOR  # noqa: F401  (the launcher's contract)
from digen_jax.process.launch_env import ENV_LOCAL_DEVICE_IDS  # noqa: F401
from digen_jax.process.launch_env import ENV_NUM_PROCESSES  # noqa: F401
from digen_jax.process.launch_env import ENV_PROCESS_ID  # noqa: F401
from digen_jax.process.launch_env import LAUNCHER_ENV_VARS  # noqa: F401
from digen_jax.process.launch_env import launcher_env
from digen_jax.process import peers

KV_POLL_S = 1.0  # longest uninterruptible wait for a key


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """Where this process sits in the job."""

  process_id: int
  num_processes: int
  coordinator_address: str | None = None

  @property
  def is_distributed(self) -> bool:
    """True when jax.distributed is running (the KV store and transfer servers are usable)."""
    return self.coordinator_address is not None

  @property
  def is_coordinator(self) -> bool:
    return self.process_id == 0


def _global_state():
  # jax keeps the distributed client/service here; there is no public accessor for the client.
  from jax._src import distributed as _dist

  return _dist.global_state


def maybe_initialize(
    initialization_timeout_s: int = 120,
    heartbeat_timeout_s: int = 100,
    exit_on_uncaught: bool = True,
) -> ProcessInfo:
  """Initializes jax.distributed from the launcher's environment variables, if they are set.

  Idempotent: a second call returns the running job's info. Without the variables this is a
  no-op returning ProcessInfo(0, 1). Must be called before any JAX computation.

  exit_on_uncaught: an uncaught exception prints its traceback and ends the process at once
  (exit 1). Otherwise the interpreter's exit waits in jax.distributed's shutdown barrier for
  peers that may be blocked on this very process, and the job hangs instead of failing (seen
  with jax 0.10.2); the launcher then stops the other processes.
  """
  state = _global_state()
  if state.client is not None:
    return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address)
  kwargs = launcher_env()
  if kwargs is None:
    return ProcessInfo(process_id=0, num_processes=1)
  # Cross-process collectives of the CPU backend: gloo over TCP, with peers found through the
  # distributed KV store. It is jax 0.10's default already; set it only when nobody chose
  # another implementation (e.g. JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi).
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      **kwargs,
      # Our variables are authoritative; do not let SLURM/OpenMPI auto-detection override them.
      cluster_detection_method='deactivate',
      initialization_timeout=initialization_timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
  )
  if exit_on_uncaught:
    _exit_on_uncaught_exception()
  return ProcessInfo(kwargs['process_id'], kwargs['num_processes'], kwargs['coordinator_address'])


def _exit_on_uncaught_exception() -> None:
  previous = sys.excepthook

  def hook(exc_type, exc, tb):
    dead = None
    if not issubclass(exc_type, KeyboardInterrupt):
      dead = peers.dead_peer(wait_s=2.0)  # launch/local.py names a copy that died, if one did
    if dead is not None:
      # What failed was a call to that peer (a transfer, a key-value get): its death is the
      # cause, said in one line (process/peers.py).
      peers.last_line(peers.stop_line(dead, _global_state().process_id))
    else:
      previous(exc_type, exc, tb)  # the usual traceback
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips atexit, where jax.distributed.shutdown would wait for the peers.
    os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

  sys.excepthook = hook


def process_info() -> ProcessInfo:
  """The current job's info without initializing anything."""
  state = _global_state()
  if state.client is None:
    return ProcessInfo(process_id=0, num_processes=1)
  return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address)


# ------------------------------------------------------------------------------------------
# Key-value store over the coordination service: small strings (addresses, metadata), not data.


def kv_client():
  """The jax.distributed client; raises RuntimeError in a single-process run."""
  client = _global_state().client
  if client is None:
    raise RuntimeError(
        'The key-value store needs jax.distributed: start the job with '
        'launch/local.py (or launch/slurm.sh) and call maybe_initialize() first.'
    )
  return client


def kv_set(key: str, value: str, overwrite: bool = False) -> None:
  """Stores `value` under `key` for all processes. Without overwrite, an existing key is an error."""
  kv_client().key_value_set(key, value, allow_overwrite=overwrite)


def timed_out(e: Exception) -> bool:
  return 'DEADLINE_EXCEEDED' in str(e) or 'timed out' in str(e).lower()


def kv_get(key: str, timeout_s: float = 60.0) -> str:
  """Blocks until some process has set `key` (or raises after timeout_s) and returns its value.
  Waits in slices of at most KV_POLL_S so that a SIGTERM/SIGINT (digen_jax.process.interrupt) stops a
  process waiting for a peer that will never answer."""
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    try:
      return kv_client().blocking_key_value_get(key, max(1, int(min(left, KV_POLL_S) * 1000)))
    except jax.errors.JaxRuntimeError as e:
      if not timed_out(e) or left <= KV_POLL_S:
        raise
    interrupt.check(f'while waiting for {key!r} from another process')


def kv_try_get(key: str) -> str | None:
  """The value under `key`, or None when it is not set (does not block)."""
  try:
    return kv_client().key_value_try_get(key)
  except jax.errors.JaxRuntimeError as e:
    if 'NOT_FOUND' in str(e):
      return None
    raise


def kv_delete(key: str) -> None:
  """Deletes `key` (and, as a directory, every key under `key/`)."""
  kv_client().key_value_delete(key)


def barrier(name: str, timeout_s: float = 120.0) -> None:
  """Waits until every process reaches the barrier `name` (names must not be reused)."""
  kv_client().wait_at_barrier(name, int(timeout_s * 1000))
