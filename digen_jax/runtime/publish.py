"""The weight publish (trainer -> rollout): one function every link sends, one check every
rollout applies.

The trainer owns float32 FSDP-sharded master weights; the rollout samples with its own copy,
laid out for the rollout mesh (replicated for data parallelism, or FSDP) and optionally cast to
bfloat16. `publish` makes the policy the trainer sends: its params with floating leaves cast to
the rollout dtype, stamped with the policy version (the number of optimizer steps they hold)
and, with LoRA, the adapters' manifest. A link moves it (runtime/links.py: jax.device_put onto
the rollout mesh in one process, a transfer.Channel across processes, never a cross-process
device_put, which hangs on CPU) and the rollout side calls `accept`, which checks the version
and the manifest. Everything stays device-to-device: legal under jax.transfer_guard('disallow').
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models.lora import adapters as lora_lib
from digen_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class Policy:
  """Weights the rollout samples with and the policy version they hold. manifest: with LoRA,
  the trainer's description of the adapters it sent (lora.manifest), checked on arrival."""

  params: Any
  version: int
  manifest: Any = None


def publish(weights, params, version: int, dtype=None, *, digest: bool = False) -> Policy:
  """The policy the trainer publishes as `version`: `params` (the trainable tree, on the
  trainer's layout) with floating leaves cast to `dtype` (None: as they are), and with LoRA a
  manifest of the adapters (names, shapes and, when `digest`, a sha256 of their values: one host
  copy of the adapters, done on a process's first publish). Dispatches asynchronously."""
  if dtype is not None:
    params = jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
  manifest = None
  if weights.lora is not None:
    manifest = lora_lib.manifest(jax.device_get(params) if digest else params, digest=digest)
  return Policy(params, int(version), manifest)


def accept(weights, policy: Policy, version: int) -> Policy:
  """Rollout side of a publish: the policy is the expected `version`, and with LoRA every
  adapter this run expects arrived with the expected shape and (when the trainer sent a digest)
  the values it sent. Raises naming what is missing, extra, mis-shaped or altered: a silently
  dropped adapter would otherwise sample the base model while the trainer trains the adapters."""
  if policy.version != version:
    raise RuntimeError(f'the rollout expected policy version {version}, got {policy.version}')
  if weights.lora is None:
    return policy
  if policy.manifest is None:
    raise ValueError(f'policy v{policy.version} arrived without its LoRA adapter manifest')
  lora_lib.check_manifest(lora_lib.manifest(weights.params, digest=False), policy.manifest)
  digest = any(e.get('sha256') for e in policy.manifest.values())
  lora_lib.check_manifest(
      policy.manifest,
      lora_lib.manifest(jax.device_get(policy.params) if digest else policy.params, digest=digest),
  )
  return policy


def rollout_param_shardings(cluster, params):
  """Shardings of the rollout copy: replicated (data-parallel sampling) or FSDP on the rollout
  mesh, per config.cluster.rollout.param_sharding."""
  mesh = cluster.rollout.mesh
  if cluster.rollout_param_sharding == 'fsdp':
    return mesh_lib.fsdp_shardings(params, mesh)
  rep = mesh_lib.replicated(mesh)
  return jax.tree.map(lambda _: rep, params)


def rollout_frozen_fsdp(cluster) -> bool:
  """Whether the rollout's frozen weights (LoRA base) are FSDP-sharded: as its param copy
  (config.cluster.rollout.param_sharding), and always when the roles share one mesh (the
  trainer's FSDP copy serves both, instead of a second, replicated one)."""
  return cluster.is_colocated or cluster.rollout_param_sharding == 'fsdp'


def rollout_param_dtype(cluster):
  """The floating dtype of the rollout copy, or None for no cast (float32 master weights)."""
  return jnp.bfloat16 if cluster.rollout_param_dtype == 'bfloat16' else None


def publish_megabytes(params, dtype=None) -> float:
  """Size of one publish (the rollout copy of `params`, floating leaves cast to `dtype`)."""

  def nbytes(x):
    dt = dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    return int(np.prod(x.shape)) * jnp.dtype(dt).itemsize

  return sum(nbytes(x) for x in jax.tree.leaves(params)) / 1e6
