"""Meshes and shardings: data-parallel batches, FSDP-sharded parameters and optimizer state.

A mesh may have several axes (a role's `cluster.<role>.mesh_shape`); batches and FSDP shards
then go over all of them together (every device holds a distinct slice). On a 1-D mesh the
specs name the single axis, exactly as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = 'data'


def make_mesh(devices: Sequence[jax.Device], axis: str = DATA) -> Mesh:
  """1-D mesh over `devices`. Auto axis types: shardings are given explicitly at jit boundaries
  and XLA's partitioner inserts the collectives (FSDP all-gathers, gradient reduce-scatters)."""
  return Mesh(np.asarray(devices), (axis,), axis_types=(AxisType.Auto,))


def make_role_mesh(
    devices: Sequence[jax.Device], shape: Sequence[int] = (), axis_names: Sequence[str] = (DATA,)
) -> Mesh:
  """Mesh of `shape` (default: 1-D over all `devices`) with `axis_names`, devices in the given
  order (row-major). The caller checks that shape and names fit (runtime.cluster does)."""
  shape = tuple(shape) or (len(devices),)
  return Mesh(
      np.asarray(devices).reshape(shape),
      tuple(axis_names),
      axis_types=(AxisType.Auto,) * len(shape),
  )


def data_axes(mesh: Mesh):
  """The mesh axes a batch (and an FSDP shard) is split over: all of them, as one spec entry."""
  names = tuple(mesh.axis_names)
  return names[0] if len(names) == 1 else names


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
  """Shards dimension `batch_axis` of an ndim array over the mesh's data axes."""
  spec = [None] * ndim
  spec[batch_axis] = data_axes(mesh)
  return NamedSharding(mesh, P(*spec))


# A leaf no dimension of which the device count divides is replicated when it holds at most
# this many elements: a copy on every device then costs at most 4 MiB in float32 (12 MiB with
# Adam's two moments), next to nothing on an accelerator. A larger one is an error: silently
# replicated, a 40 x 5120 x 5120 block stack on 6 devices would be whole on each.
REPLICATE_AT_MOST = 1 << 20
SMALL_RULE = f'at most {REPLICATE_AT_MOST:,} elements and no dimension divisible'
SCALAR_RULE = 'a scalar'


def fsdp_spec(shape: tuple[int, ...], num_shards: int, axis, path: str = 'a leaf') -> P:
  """Shard the largest dimension divisible by num_shards. A leaf none divides is replicated by
  rule (replication_rule: scalars, leaves of at most REPLICATE_AT_MOST elements); any other is
  a ValueError naming `path`, its shape and the mesh axis."""
  if num_shards == 1 or not shape:
    return P()
  order = sorted(range(len(shape)), key=lambda i: -shape[i])
  for i in order:
    if shape[i] % num_shards == 0 and shape[i] >= num_shards:
      spec = [None] * len(shape)
      spec[i] = axis
      return P(*spec)
  if math.prod(shape) <= REPLICATE_AT_MOST:
    return P()
  raise ValueError(
      f'FSDP cannot shard {path} of shape {tuple(shape)} ({math.prod(shape):,} elements) over '
      f'mesh axis {axis!r} of {num_shards} devices: no dimension is divisible by {num_shards}, '
      f'and only leaves of at most {REPLICATE_AT_MOST:,} elements are replicated. Give the '
      f'role a device count that divides one of its dimensions (config.cluster.<role>.devices '
      f'/ mesh_shape)'
  )


def replication_rule(shape: tuple[int, ...], num_shards: int) -> str | None:
  """Why fsdp_spec replicates a leaf of `shape` over num_shards devices (SCALAR_RULE,
  SMALL_RULE), or None when it shards it (or there is one device: nothing to shard)."""
  if num_shards == 1:
    return None
  if not shape:
    return SCALAR_RULE
  if any(d % num_shards == 0 and d >= num_shards for d in shape):
    return None
  return SMALL_RULE if math.prod(shape) <= REPLICATE_AT_MOST else None


def leaf_name(path) -> str:
  """A tree path as dotted names: 'blocks.attn.to_q.kernel' (nnx's trailing .value dropped)."""
  parts = []
  for k in path:
    part = getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))
    parts.append(str(part))
  if len(parts) > 1 and parts[-1] == 'value':
    parts.pop()
  return '.'.join(parts) or '<root>'


@dataclasses.dataclass(frozen=True)
class FsdpLayout:
  """A tree's FSDP layout on a mesh: `shardings` (a NamedSharding per leaf) and the leaves
  replicated by rule, `replicated` ((name, shape, rule), in tree order)."""

  shardings: Any
  replicated: tuple[tuple[str, tuple[int, ...], str], ...]
  leaves: int
  devices: int
  axis: Any

  def describe(self, listed: int = 8) -> str:
    """One line: how many leaves are sharded over which axis, and each leaf replicated by rule
    with its shape and the rule (the first `listed` named, the rest counted)."""
    head = (
        f'FSDP over {self.devices} devices (axis {self.axis!r}): '
        f'{self.leaves - len(self.replicated)} of {self.leaves} leaves sharded'
    )
    if self.devices == 1 or not self.replicated:
      return head
    by_rule: dict[str, list[str]] = {}
    for name, shape, rule in self.replicated:
      by_rule.setdefault(rule, []).append(f'{name} {shape}')
    parts = []
    for rule, names in by_rule.items():
      more = f' and {len(names) - listed} more' if len(names) > listed else ''
      parts.append(f'{len(names)} replicated as {rule}: {", ".join(names[:listed])}{more}')
    return f'{head}; ' + '; '.join(parts)


def fsdp_layout(tree, mesh: Mesh) -> FsdpLayout:
  """fsdp_shardings' layout of `tree` (arrays or ShapeDtypeStructs) with the leaves it replicates
  by rule; ValueError naming the first leaf it can neither shard nor replicate."""
  axis = data_axes(mesh)
  n = mesh.devices.size
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  shardings, replicated = [], []
  for path, x in with_paths:
    shape, name = tuple(x.shape), leaf_name(path)
    shardings.append(NamedSharding(mesh, fsdp_spec(shape, n, axis, name)))
    rule = replication_rule(shape, n)
    if rule is not None:
      replicated.append((name, shape, rule))
  return FsdpLayout(
      shardings=jax.tree_util.tree_unflatten(treedef, shardings),
      replicated=tuple(replicated),
      leaves=len(with_paths),
      devices=n,
      axis=axis,
  )


def fsdp_shardings(tree, mesh: Mesh):
  """NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), FSDP over the data axes
  (fsdp_spec's rules; fsdp_layout also says which leaves they replicate)."""
  return fsdp_layout(tree, mesh).shardings
