"""Meshes and shardings: data-parallel batches, FSDP-sharded parameters and optimizer state.

A mesh may have several axes (a role's `cluster.<role>.mesh_shape`); batches and FSDP shards
then go over all of them together (every device holds a distinct slice). On a 1-D mesh the
specs name the single axis, exactly as before.
"""

from __future__ import annotations

from typing import Sequence

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


def fsdp_spec(shape: tuple[int, ...], num_shards: int, axis) -> P:
  """Shard the largest dimension divisible by num_shards; replicate small or indivisible leaves."""
  if num_shards == 1 or not shape:
    return P()
  order = sorted(range(len(shape)), key=lambda i: -shape[i])
  for i in order:
    if shape[i] % num_shards == 0 and shape[i] >= num_shards:
      spec = [None] * len(shape)
      spec[i] = axis
      return P(*spec)
  return P()


def fsdp_shardings(tree, mesh: Mesh):
  """NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), FSDP over the data axes."""
  axis = data_axes(mesh)
  n = mesh.devices.size
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), n, axis)), tree)
