"""FSDP layouts (parallel/mesh.py): a leaf no dimension of which the devices divide is replicated
only by rule (a scalar, or at most REPLICATE_AT_MOST elements), and the layout names each one
with its rule; any other is an error naming the leaf, its shape and the mesh axis, raised while
the shardings are made (before anything compiles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from digen_jax.parallel import mesh as mesh_lib


def _mesh(n=4):
  return mesh_lib.make_mesh(jax.devices()[:n])


def test_small_indivisible_leaves_and_scalars_are_replicated_by_rule_and_named():
  tree = {
      'blocks': {'kernel': np.zeros((16, 12), np.float32), 'bias': np.zeros((3,), np.float32)},
      'count': np.zeros((), np.int32),
  }
  layout = mesh_lib.fsdp_layout(tree, _mesh())
  assert layout.shardings['blocks']['kernel'].spec == P('data', None)
  assert layout.shardings['blocks']['bias'].spec == P()
  assert layout.shardings['count'].spec == P()
  assert layout.replicated == (
      ('blocks.bias', (3,), mesh_lib.SMALL_RULE),
      ('count', (), mesh_lib.SCALAR_RULE),
  )
  text = layout.describe()
  assert text.startswith("FSDP over 4 devices (axis 'data'): 1 of 3 leaves sharded; ")
  assert f'1 replicated as {mesh_lib.SMALL_RULE}: blocks.bias (3,)' in text
  assert '1 replicated as a scalar: count ()' in text
  # fsdp_shardings is the same layout; a leaf one element under the limit is replicated.
  edge = {'w': jax.ShapeDtypeStruct((mesh_lib.REPLICATE_AT_MOST // 3, 3), jnp.float32)}
  assert mesh_lib.REPLICATE_AT_MOST - 1 == 3 * (mesh_lib.REPLICATE_AT_MOST // 3)
  assert mesh_lib.fsdp_shardings(edge, _mesh(4))['w'].spec == P()


def test_nnx_state_leaves_are_named_by_their_dotted_path():
  from flax import nnx

  state = nnx.state(nnx.Linear(6, 3, rngs=nnx.Rngs(0)))
  layout = mesh_lib.fsdp_layout(state, _mesh())
  assert [name for name, _, _ in layout.replicated] == ['bias', 'kernel']


def test_a_large_leaf_no_dimension_of_which_divides_is_an_error_naming_it():
  big = mesh_lib.REPLICATE_AT_MOST // 5 + 2  # odd; 5 x that: just over the rule's limit
  tree = {
      'blocks': {
          'ok': jax.ShapeDtypeStruct((4, 8), jnp.float32),
          'attn': {'to_q': {'kernel': jax.ShapeDtypeStruct((5, big), jnp.float32)}},
      }
  }
  assert 5 * big > mesh_lib.REPLICATE_AT_MOST and big % 3 and big % 4
  with pytest.raises(ValueError) as e:
    mesh_lib.fsdp_layout(tree, _mesh(4))
  message = str(e.value)
  assert f'blocks.attn.to_q.kernel of shape (5, {big})' in message
  assert "over mesh axis 'data' of 4 devices" in message
  assert 'config.cluster.<role>.devices' in message
  with pytest.raises(ValueError, match=r"blocks\.attn\.to_q\.kernel .* mesh axis 'data' of 3"):
    mesh_lib.fsdp_shardings(tree, _mesh(3))
  # One device: nothing to shard, nothing replicated by rule.
  layout = mesh_lib.fsdp_layout(tree, _mesh(1))
  assert layout.replicated == () and layout.describe().endswith('2 of 2 leaves sharded')
  # A 2-D mesh's axes together (data_axes) are the axis named.
  grid = mesh_lib.make_role_mesh(jax.devices()[:4], (2, 2), ('a', 'b'))
  with pytest.raises(ValueError, match=r"mesh axis \('a', 'b'\) of 4 devices"):
    mesh_lib.fsdp_shardings(tree, grid)
