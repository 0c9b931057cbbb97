"""Launched by tests/core/runtime/test_transfer.py with 2 processes x 2 CPU devices.

Process 0 sends pytrees (f32 + bf16 + int32, several shapes and shardings) to process 1, which
receives them on several layouts of its own devices; then process 1 sends to process 0. Every
received leaf is compared for exact equality with the same tree rebuilt locally.
"""

import sys

from digen_jax.runtime import distributed

info = distributed.maybe_initialize(initialization_timeout_s=60)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

from digen_jax.runtime import transfer  # noqa: E402
from digen_jax.parallel.mesh import make_mesh  # noqa: E402

assert info.num_processes == 2 and jax.local_device_count() == 2, (info, jax.local_devices())
me, peer = info.process_id, 1 - info.process_id
local = jax.local_devices()
mesh = make_mesh(local)  # Auto axis 'data' over this process's 2 devices
xmesh = jax.make_mesh((2,), ('x',), devices=local, axis_types=(AxisType.Explicit,))


def host_tree(seed: int) -> dict:
  """Deterministic values, different per seed; numpy on host (reference only)."""
  r = np.random.default_rng(seed)
  return {
      'w': r.standard_normal((8, 6)).astype(np.float32),
      'blocks': [
          r.standard_normal((4, 3, 2)).astype(jnp.bfloat16),
          r.standard_normal((5,)).astype(jnp.bfloat16),
      ],
      'scale': np.float32(r.standard_normal()),
      'step': np.arange(6, dtype=np.int32) * (seed + 1),
  }


def specs(m, axis):
  return {'w': P(axis), 'blocks': [P(None, None, axis), P()], 'scale': P(), 'step': P(axis)}


def to_device(tree, m, axis):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(m, s)), tree, specs(m, axis))


def check(got, want, label: str, layout=None) -> int:
  n = 0
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    name = f'{label}{jax.tree_util.keystr(path)}'
    assert isinstance(g, jax.Array), name
    assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
    assert g.sharding.device_set <= set(local), name
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    n += 1
  if layout is not None:
    for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(layout)):
      assert g.sharding.is_equivalent_to(s.sharding, g.ndim), (label, g.sharding, s.sharding)
  return n


chan = transfer.Channel(peer)
checks = 0
if me == 0:
  # 1) three sends of one tag (sequence pairing), the last one cast to bf16 on the way.
  for seed in (1, 2):
    chan.send(to_device(host_tree(seed), mesh, 'data'), 'weights')
  chan.send(to_device(host_tree(3), mesh, 'data'), 'weights', dtype=jnp.bfloat16)
  chan.wait_delivered('weights', timeout_s=60)
  # 2) reverse direction: receive what process 1 sends, on an Explicit mesh.
  want = host_tree(10)
  layout = transfer.abstract(
      want, jax.tree.map(lambda s: NamedSharding(xmesh, s), specs(xmesh, 'x'))
  )
  checks += check(chan.receive(layout, 'traj'), want, 'traj', layout)
else:
  # seq 0: exactly the sender's layout (pieces land where they belong).
  want = host_tree(1)
  same = transfer.abstract(
      want, jax.tree.map(lambda s: NamedSharding(mesh, s), specs(mesh, 'data'))
  )
  bad = dict(same, w=jax.ShapeDtypeStruct((6, 8), jnp.float32, sharding=same['w'].sharding))
  try:
    chan.receive(bad, 'weights')
    raise AssertionError('shape mismatch not detected')
  except ValueError as e:
    assert "['w']" in str(e) and 'shape' in str(e), e
  wrong_dtype = dict(
      same, w=jax.ShapeDtypeStruct((8, 6), jnp.bfloat16, sharding=same['w'].sharding)
  )
  try:
    chan.receive(wrong_dtype, 'weights')
    raise AssertionError('dtype mismatch not detected')
  except ValueError as e:
    assert 'float32' in str(e) and 'bfloat16' in str(e), e
  checks += check(chan.receive(same, 'weights'), want, 'same', same)  # retry after the errors
  # seq 1: another layout: replicated <-> sharded flipped, one leaf on a single device.
  want = host_tree(2)
  other = transfer.abstract(
      want,
      {
          'w': NamedSharding(mesh, P(None, 'data')),  # sent sharded on dim 0
          'blocks': [NamedSharding(mesh, P()), NamedSharding(mesh, P())],  # sent sharded on dim 2
          'scale': SingleDeviceSharding(local[1]),
          'step': SingleDeviceSharding(local[0]),  # sent sharded on dim 0
      },
  )
  checks += check(chan.receive(other, 'weights'), want, 'other', other)
  # seq 2: sent as bf16.
  want = jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.dtype == np.float32 else x, host_tree(3)
  )
  cast = transfer.abstract(want, jax.tree.map(lambda s: NamedSharding(xmesh, s), specs(xmesh, 'x')))
  checks += check(chan.receive(cast, 'weights'), want, 'cast', cast)
  # reverse direction: send from this process's devices (single-device + sharded leaves).
  chan.send(to_device(host_tree(10), mesh, 'data'), 'traj')
  chan.wait_delivered('traj', timeout_s=60)

# wait_posted: False on a timeout while nothing is offered, True once the peer's send is there.
if me == 0:
  assert chan.wait_posted('probe', 0.2) is False
  distributed.barrier('probe_checked', 60)
  assert chan.wait_posted('probe', 60) is True
  probe = {'v': jax.ShapeDtypeStruct((4,), jnp.float32, sharding=SingleDeviceSharding(local[0]))}
  checks += check(chan.receive(probe, 'probe'), {'v': np.arange(4, dtype=np.float32)}, 'probe')
else:
  distributed.barrier('probe_checked', 60)
  chan.send({'v': jax.device_put(np.arange(4, dtype=np.float32), local[1])}, 'probe')
  chan.wait_delivered('probe', timeout_s=60)

distributed.barrier('transfer_roundtrip_done', 60)
print(f'OK process={me} checks={checks}', flush=True)
sys.exit(0)
