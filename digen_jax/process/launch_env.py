"""The launcher's environment contract (launch/local.py, launch/slurm.sh): the variables that make
a process one of a jax.distributed job. No JAX here: an entry point reads them to know whether it
runs alone before it imports anything heavy (runtime/distributed.py initializes the job)."""

from __future__ import annotations

import os

ENV_COORDINATOR = 'DIGEN_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'DIGEN_NUM_PROCESSES'
ENV_PROCESS_ID = 'DIGEN_PROCESS_ID'
ENV_LOCAL_DEVICE_IDS = 'DIGEN_LOCAL_DEVICE_IDS'
LAUNCHER_ENV_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


def _parse_int(name: str, value: str) -> int:
  try:
    return int(value)
  except ValueError:
    raise ValueError(
        f'{name}={value!r} is not an integer; launch through launch/local.py or '
        'launch/slurm.sh, or unset it to run as a single process.'
    ) from None


def launcher_env(environ=None) -> dict | None:
  """Reads the launcher's variables from `environ` (default os.environ).

  Returns None when none of them is set (single-process run), else a dict of
  jax.distributed.initialize keyword arguments. Raises ValueError on a partial or invalid set.
  """
  environ = os.environ if environ is None else environ
  present = [k for k in LAUNCHER_ENV_VARS if environ.get(k)]
  if not present:
    return None
  missing = [k for k in LAUNCHER_ENV_VARS if not environ.get(k)]
  if missing:
    raise ValueError(
        f'{", ".join(present)} set but {", ".join(missing)} missing: set all of '
        f'{", ".join(LAUNCHER_ENV_VARS)} (launch/local.py does) or none of them.'
    )
  address = environ[ENV_COORDINATOR]
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit():
    raise ValueError(f'{ENV_COORDINATOR}={address!r} must look like host:port.')
  num_processes = _parse_int(ENV_NUM_PROCESSES, environ[ENV_NUM_PROCESSES])
  process_id = _parse_int(ENV_PROCESS_ID, environ[ENV_PROCESS_ID])
  if num_processes < 1:
    raise ValueError(f'{ENV_NUM_PROCESSES}={num_processes} must be >= 1.')
  if not 0 <= process_id < num_processes:
    raise ValueError(f'{ENV_PROCESS_ID}={process_id} must be in [0, {num_processes}).')
  kwargs = dict(coordinator_address=address, num_processes=num_processes, process_id=process_id)
  ids = environ.get(ENV_LOCAL_DEVICE_IDS, '').strip()
  if ids:
    kwargs['local_device_ids'] = [_parse_int(ENV_LOCAL_DEVICE_IDS, s) for s in ids.split(',')]
  return kwargs
