"""Versioned weight publish (trainer -> rollout) and batch moves (rollout -> trainer).

The trainer owns float32 FSDP-sharded master weights; the rollout samples with its own copy,
laid out for the rollout mesh (replicated for data parallelism, or FSDP) and optionally cast to
bfloat16. A publish moves, reshards and casts the weights in one go and stamps them with the
policy version (the number of optimizer steps they contain); every batch the rollout produces
carries the version of the policy that sampled it, and the trainer checks it.

In one process both moves are `jax.device_put` onto the other mesh (`publish_local`,
`move_batch_local`); across processes they go through a `transfer.Channel`
(`send_weights`/`receive_weights`, `send_batch`/`receive_batch`), never a cross-process
device_put (it hangs on CPU). Everything stays device-to-device: these functions are legal
under jax.transfer_guard('disallow').
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import lora as lora_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import transfer

WEIGHTS_TAG = 'weights'
BATCH_TAG = 'batch'


@dataclasses.dataclass(frozen=True)
class Policy:
  """Rollout weights (on the rollout mesh) and the policy version they hold. manifest: with
  LoRA, the trainer's description of the adapters it sent (lora.manifest), checked on arrival."""

  params: Any
  version: int
  manifest: Any = None


def adapter_manifest(weights, params, *, digest: bool):
  """LoRA runs: the manifest a publish carries (adapter names, shapes and, when `digest`, a
  sha256 of their values: one host copy of the adapters); None for full fine-tuning."""
  if weights.lora is None:
    return None
  return lora_lib.manifest(jax.device_get(params) if digest else params, digest=digest)


def verify_policy(weights, policy: Policy) -> None:
  """Rollout side of a LoRA publish: every adapter this run expects arrived with the expected
  shape, and (when the trainer sent a digest) with the values it sent. Raises ValueError
  naming what is missing, extra, mis-shaped or altered; a silently dropped adapter would
  otherwise sample the base model while the trainer trains the adapters."""
  if weights.lora is None:
    return
  if policy.manifest is None:
    raise ValueError(f'policy v{policy.version} arrived without its LoRA adapter manifest')
  lora_lib.check_manifest(lora_lib.manifest(weights.params, digest=False), policy.manifest)
  digest = any(e.get('sha256') for e in policy.manifest.values())
  lora_lib.check_manifest(
      policy.manifest,
      lora_lib.manifest(jax.device_get(policy.params) if digest else policy.params, digest=digest),
  )


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


def publish_local(params, version: int, shardings, dtype=None) -> Policy:
  """In one process: `params` (any layout, e.g. the trainer's FSDP) -> the rollout layout
  `shardings`, floating leaves cast to `dtype` when given, stamped with `version`.
  Dispatches asynchronously; block on `.params` to time it."""
  return Policy(transfer.publish_local(params, shardings, dtype), int(version))


def send_weights(channel: transfer.Channel, params, version: int, dtype=None, manifest=None) -> int:
  """Across processes, trainer side: offers `params` (cast to `dtype`) stamped with `version`
  (and a LoRA manifest). Returns at once; call channel.wait_delivered(WEIGHTS_TAG) before
  donating `params`."""
  return channel.send(
      params, WEIGHTS_TAG, dtype=dtype, info={'version': int(version), 'manifest': manifest}
  )


def receive_weights(channel: transfer.Channel, abstract_params) -> tuple[Policy, float]:
  """Across processes, rollout side: the next published policy on the layout of
  `abstract_params` (see transfer.abstract) and the seconds the pull took (not counting the
  wait for the trainer to publish)."""
  d = channel.receive_full(abstract_params, WEIGHTS_TAG)
  return Policy(d.tree, int(d.info['version']), d.info.get('manifest')), d.pull_s


def move_batch_local(batch, shardings):
  """In one process: a rollout batch (trajectories, advantages, valid mask) onto the trainer's
  shardings (a pytree of the same structure)."""
  return jax.device_put(batch, shardings)


def send_batch(channel: transfer.Channel, batch, info: dict) -> int:
  """Across processes, rollout side: offers a batch; `info` (JSON) carries its step, policy
  version, prompts and rollout statistics."""
  return channel.send(batch, BATCH_TAG, info=info)


def receive_batch(channel: transfer.Channel, abstract_batch) -> tuple[Any, dict, float]:
  """Across processes, trainer side: the next batch on the layout of `abstract_batch`, its info
  dict, and the seconds the pull took (not counting the wait for the rollout)."""
  d = channel.receive_full(abstract_batch, BATCH_TAG)
  return d.tree, d.info, d.pull_s
