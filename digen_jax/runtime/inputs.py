"""What both roles feed their programs: text conditioning on a mesh, CFG's unconditional
branch, a step's PRNG keys (the same in every role, mode and process: both roles derive them
from (config.seed, step), and every sample's noise key folds in its batch position, so a sample
does not depend on how the batch is cut or where it runs), and the check that a fragment's
padded rows split over a role's mesh."""

from __future__ import annotations

from absl import logging
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
  if exp.sampler.guidance_scale <= 1.0:
    return None
  return encode(exp, [exp.sampler.negative_prompt] * batch, mesh)


def guard(level: str):
  """jax.transfer_guard(level) around the device work of a step (config.runtime.transfer_guard,
  'disallow' by default): an implicit host<->device copy in the hot path is an error, not a
  silent slowdown. Host work (text encoding, reward scoring, metrics) stays outside."""
  return jax.transfer_guard(level)


def check_rows(plan, mesh, role: str) -> None:
  """A fragment's rows must split over the role's mesh (the plan was built for the lcm of the
  roles' device counts); logs the weight-0 padding rows when there are any."""
  n = mesh.devices.size
  if plan.rows % n:
    raise ValueError(
        f'a fragment of {plan.size} samples is laid out as {plan.rows} rows, which the {n} '
        f'devices of the {role} mesh do not divide: build the experiment for a device count '
        f'that every role divides (experiment.build(config, workdir, lcm of the roles))'
    )
  if plan.rows > plan.size:
    logging.info(
        '%s: a fragment of %d samples is padded to %d rows (weight 0) for %d devices; '
        'the programs compute ceil(%d / %d) = %d rows a device',
        role,
        plan.size,
        plan.rows,
        n,
        plan.size,
        n,
        -(-plan.size // n),
    )
