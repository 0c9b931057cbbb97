"""Colocated synchronous GRPO: one mesh; sample the whole batch, score it, update, repeat.

The baseline every later mode is compared to. Per step: prompts -> (cached) text embeddings ->
rollout program (one jitted lax.scan, data-parallel, on a replicated copy of the weights) ->
decode + reward on the host -> advantages -> update program (FSDP params/optimizer state,
donated) -> metrics + checkpoint. The loop is runtime/synchronous.py with both roles on one
mesh; naive disaggregation runs the same loop with a mesh per role.
"""

from __future__ import annotations

import jax

from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import pipeline
from digen_jax.runtime import synchronous


def train(exp, workdir: str, devices=None) -> dict:
  """Runs config.total_steps optimizer steps on `devices` (default: all local devices),
  resuming from <workdir>/checkpoints. Returns the final {'params', 'opt_state', 'step'} so
  tests can compare runs."""
  devices = devices if devices is not None else jax.local_devices()
  cluster = cluster_lib.colocated(devices)
  if pipeline.enabled(exp.config):  # GAP on one mesh (TAG/TCSS need disagg: validate)
    return pipeline.train(exp, workdir, cluster)
  return synchronous.train(exp, workdir, cluster)
