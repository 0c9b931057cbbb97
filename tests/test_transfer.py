"""digen_jax.runtime.transfer: in-process publish and cross-process pytree transfer."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from digen_jax.runtime import transfer

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    'launcher_util', os.path.join(_HERE, 'mp_scripts', 'launcher_util.py')
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


def test_publish_local_onto_other_mesh_with_bf16_cast():
  src, dst = _meshes()
  host, tree = _tree(src)
  targets = {
      'w': NamedSharding(dst, P(None, 'data')),
      'b': NamedSharding(dst, P()),
      'count': NamedSharding(dst, P()),
  }
  out = transfer.publish_local(tree, targets, dtype=jnp.bfloat16)
  assert out['w'].dtype == jnp.bfloat16 and out['b'].dtype == jnp.bfloat16
  assert out['count'].dtype == jnp.int32  # integers are never cast
  for k in host:
    assert out[k].sharding == targets[k], k
    assert out[k].sharding.device_set == set(dst.devices.flat)
    want = host[k].astype(jnp.bfloat16) if host[k].dtype == np.float32 else host[k]
    np.testing.assert_array_equal(np.asarray(out[k]), want, err_msg=k)
  # Widening back to f32 on a single shared sharding reproduces the bf16 values exactly.
  back = transfer.publish_local(out, NamedSharding(src, P()), dtype=jnp.float32)
  assert back['w'].dtype == jnp.float32 and back['count'].dtype == jnp.int32
  np.testing.assert_array_equal(
      np.asarray(back['w']), host['w'].astype(jnp.bfloat16).astype(np.float32)
  )
  # Without dtype: a plain copy, values and dtypes untouched.
  same = transfer.publish_local(tree, targets)
  for k in host:
    assert same[k].dtype == host[k].dtype
    np.testing.assert_array_equal(np.asarray(same[k]), host[k])


def test_publish_local_rejects_bad_arguments():
  src, dst = _meshes()
  _, tree = _tree(src)
  with pytest.raises(ValueError, match='floating dtype'):
    transfer.publish_local(tree, NamedSharding(dst, P()), dtype=jnp.int8)
  with pytest.raises(ValueError, match='does not match'):
    transfer.publish_local(tree, {'w': NamedSharding(dst, P())})


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
  with pytest.raises(RuntimeError, match='publish_local'):
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
