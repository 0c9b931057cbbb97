"""Launched by tests/core/runtime/test_launch.py: a cross-process sum over all processes' devices (gloo)."""

import sys

from digen_jax.runtime import distributed

info = distributed.maybe_initialize(initialization_timeout_s=60)

import jax  # noqa: E402  (after initialize, which must precede any backend use)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from digen_jax.parallel.mesh import make_mesh  # noqa: E402

n_local = jax.local_device_count()
assert jax.process_count() == info.num_processes, (jax.process_count(), info)
assert jax.device_count() == n_local * info.num_processes

# Each local device holds (process_id + 1) * 10 + local index: the global sum is only right if
# every process's shards took part.
mesh = make_mesh(jax.devices())
local = np.array([(info.process_id + 1) * 10 + i for i in range(n_local)], np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
gathered = multihost_utils.process_allgather(jnp.float32(info.process_id + 1))

# Key-value store: each process posts a string, reads the other's, and a missing key is None.
distributed.kv_set(f'psum/greeting/{info.process_id}', f'hello from {info.process_id}')
peer = (info.process_id + 1) % info.num_processes
greeting = distributed.kv_get(f'psum/greeting/{peer}', timeout_s=30)
assert distributed.kv_try_get('psum/never-set') is None
distributed.barrier('psum/done', timeout_s=30)
print(
    f'RESULT process={info.process_id} sum={float(total.addressable_data(0))} '
    f'allgather={np.asarray(gathered).tolist()} kv={greeting!r}',
    flush=True,
)
sys.exit(0)
