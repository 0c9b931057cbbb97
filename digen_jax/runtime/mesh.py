"""Meshes and shardings: data-parallel batches, FSDP-sharded parameters and optimizer state."""
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


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
  """Shards dimension `batch_axis` of an ndim array over the mesh's data axis."""
  spec = [None] * ndim
  spec[batch_axis] = mesh.axis_names[0]
  return NamedSharding(mesh, P(*spec))


def fsdp_spec(shape: tuple[int, ...], num_shards: int, axis: str) -> P:
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
  """NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), FSDP over the data axis."""
  axis = mesh.axis_names[0]
  n = mesh.shape[axis]
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), n, axis)), tree)
