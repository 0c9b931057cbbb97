"""What both roles feed their programs: text conditioning on a mesh, CFG's unconditional
branch, and a step's PRNG keys (the same in every role, mode and process: both roles derive
them from (config.seed, step), and every sample's noise key folds in its batch position, so a
sample does not depend on how the batch is cut or where it runs)."""

from __future__ import annotations

import jax

from digen_jax import programs


@jax.jit
def step_keys(base_key, step):
  """(k_rollout, k_update) of `step`."""
  k = jax.random.split(jax.random.fold_in(base_key, step))
  return k[0], k[1]


def encode(exp, prompts: list[str], mesh):
  """Text conditioning for `prompts`, batch-sharded on `mesh` (host encoder, explicit copy)."""
  cond = exp.conditioning(prompts)
  return jax.device_put(cond, programs.cond_shardings(mesh, cond))


def uncond(exp, batch: int, mesh):
  """CFG's unconditional branch (config.sampler.negative_prompt) for `batch` samples on `mesh`,
  or None without CFG."""
  c = exp.config
  if c.sampler.guidance_scale <= 1.0:
    return None
  return encode(exp, [c.sampler.negative_prompt] * batch, mesh)


def guard(level: str):
  """jax.transfer_guard(level) around the device work of a step (config.runtime.transfer_guard,
  'disallow' by default): an implicit host<->device copy in the hot path is an error, not a
  silent slowdown. Host work (text encoding, reward scoring, metrics) stays outside."""
  return jax.transfer_guard(level)
