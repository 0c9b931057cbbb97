"""digen_jax.runtime.transfer: in-process publish and cross-process pytree transfer."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from digen_jax.runtime import transfer
from tests.helpers.paths import TESTS

_spec = importlib.util.spec_from_file_location(
    'launcher_util', os.path.join(TESTS, 'mp_scripts', 'launcher_util.py')
)
util = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(util)


def _meshes():
  devs = jax.devices()
  assert len(devs) >= 4, 'conftest forces 4 CPU devices'
  # Source mesh as jax.make_mesh builds it (Explicit axes); target an Auto 2-device mesh.
  src = jax.make_mesh((2,), ('x',), devices=devs[:2], axis_types=(AxisType.Explicit,))
  dst = Mesh(np.asarray(devs[2:4]), ('data',), axis_types=(AxisType.Auto,))
  return src, dst


def _tree(src):
  r = np.random.default_rng(0)
  host = {
      'w': r.standard_normal((8, 6)).astype(np.float32),
      'b': r.standard_normal((5,)).astype(np.float32),
      'count': np.arange(4, dtype=np.int32),
  }
  specs = {'w': P('x'), 'b': P(), 'count': P('x')}
  return host, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(src, s)), host, specs)


def test_abstract_casts_floats_and_rejects_bad_arguments():
  src, dst = _meshes()
  host, tree = _tree(src)
  ab = transfer.abstract(tree, NamedSharding(dst, P()), jnp.bfloat16)
  assert ab['w'].dtype == jnp.bfloat16 and ab['count'].dtype == jnp.int32  # ints never cast
  assert ab['w'].shape == host['w'].shape and ab['b'].sharding == NamedSharding(dst, P())
  with pytest.raises(ValueError, match='floating dtype'):
    transfer.abstract(tree, NamedSharding(dst, P()), jnp.int8)
  with pytest.raises(ValueError, match='does not match'):
    transfer.abstract(tree, {'w': NamedSharding(dst, P())})


def _relayout_in_process(x, target_sharding, leaf_index=0):
  """What send + receive do to one leaf, with the network pull replaced by a device_put of each
  piece onto the device the receiver's plan chose."""
  pieces, meta = transfer._split(x)
  spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target_sharding)
  plan = transfer._plan(leaf_index, spec, meta)
  pulled = [jax.device_put(p, d) for p, d in zip(pieces, plan['devices'])]
  return transfer._build(spec, pulled, plan), plan, meta


@pytest.mark.parametrize(
    'src_spec,target,direct',
    [
        # same slicing: each piece is pulled straight onto the device that holds it
        (P('x'), lambda dst: NamedSharding(dst, P('data')), True),
        # replicated -> replicated: one piece, copied device-to-device on the receiver
        (P(), lambda dst: NamedSharding(dst, P()), True),
        # other dimension: pieces assembled on one device, then resharded
        (P('x'), lambda dst: NamedSharding(dst, P(None, 'data')), False),
        # replicated -> sharded: the single full piece is resharded
        (P(), lambda dst: NamedSharding(dst, P('data')), False),
        # sharded -> one device
        (P('x'), lambda dst: SingleDeviceSharding(dst.devices.flat[1]), False),
    ],
)
def test_receive_layout_plan(src_spec, target, direct):
  src, dst = _meshes()
  host = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  x = jax.device_put(host, NamedSharding(src, src_spec))
  sharding = target(dst)
  out, plan, meta = _relayout_in_process(x, sharding)
  assert len(meta['pieces']) == (2 if src_spec == P('x') else 1)  # replicas are sent once
  assert plan['direct'] is direct
  assert set(plan['devices']) <= sharding.device_set
  assert out.sharding == sharding
  np.testing.assert_array_equal(np.asarray(out), host)
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


def test_channel_needs_distributed():
  with pytest.raises(RuntimeError, match='jax.device_put'):
    transfer.Channel(peer=1)


@pytest.mark.slow
def test_two_process_pytree_transfer_both_directions():
  code, out = util.run(
      ['--num_processes=2', '--devices_per_process=2', '--timeout_s=50'],
      util.script('transfer_roundtrip.py'),
      timeout_s=60,
  )
  assert code == 0, out
  # Process 1 checked 3 receives x 5 leaves of 0 -> 1; process 0 one receive of 1 -> 0 and the
  # wait_posted probe (one leaf).
  assert '[1] OK process=1 checks=15' in out, out
  assert '[0] OK process=0 checks=6' in out, out
