"""The rollout program: the whole sampling scan, then the decode, in one jitted program. For GRPO
it records the Trajectory; for a likelihood-free objective (config.rl.algorithm 'nft' | 'awm')
the same program keeps only the final samples (sampler.sample keep='final', config.rl
.rollout_sampler: the ODE or the run's SDE, no log-probs) and each sample's training-noise key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.programs import common
from digen_jax.rl import timesteps as timesteps_lib

# fold_in salt of a sample's training-noise key (CleanSamples.keys) from its rollout key.
TRAIN_NOISE_SALT = 0x7E41


def _pad_by_cycling(traj, rows: int):
  """`traj` (Trajectory or CleanSamples) of s samples extended to `rows` by repeating them
  (sample i -> i mod s): weight-0 padding rows whose stored log-probs are their own, so every
  ratio stays finite."""
  ax = traj.BATCH_AXES['latents']
  s = traj.latents.shape[ax]
  if s == rows:
    return traj
  idx = np.arange(rows) % s
  return traj.replace(
      **{f: jnp.take(getattr(traj, f), idx, axis=a) for f, a in traj.BATCH_AXES.items()}
  )


def _train_keys(keys) -> jax.Array:
  """uint32 [B, 2]: each sample's training-noise key data from its rollout key [B]."""
  return jax.vmap(lambda k: jax.random.key_data(jax.random.fold_in(k, TRAIN_NOISE_SALT)))(keys)


def _rollout_fn(exp, deterministic: bool, mesh, samples: int | None):
  """rollout(params, cond, uncond, key, step, offset, frozen) -> (Trajectory, images) (images
  only when `deterministic`): the sampling scan and the decode, traced into one program. With
  `samples`, only the first ceil(samples / n) * n rows are sampled and decoded (the images);
  the trajectory is padded back to the input's rows by repeating them."""
  velocity_fn = common.velocity_fn_of(exp, mesh)
  # numpy, not a device array: staged into the program as a literal. A jax.Array closed over
  # here would be a captured constant, which a GPU's transfer guard refuses to lower.
  sigmas = np.asarray(exp.sigmas, np.float32)
  T = len(exp.sigmas) - 1
  guidance, norm_rescale = common.guidance_of(exp)

  clean = common.likelihood_free(exp) and not deterministic

  def rollout(params, cond, uncond, key, step, offset, frozen):
    if deterministic:
      sde_steps = jnp.zeros((T,), bool)
    elif clean:
      # The likelihood-free objectives' sampler: the ODE, or the run's SDE on every step but
      # the last (no log-probs either way).
      sde_steps = None if exp.rl.rollout_sampler == 'ode' else jnp.arange(T) < T - 1
    else:
      sde_steps = timesteps_lib.sde_step_mask(exp.selection, T, step)
    rows = cond['text'].shape[0]
    b = common.computed_rows(rows, samples, mesh.devices.size)
    if b < rows:
      on_batch = lambda a: jax.lax.with_sharding_constraint(
          jax.lax.slice_in_dim(a, 0, b), mesh_lib.batch_sharding(mesh, a.ndim)
      )
      cond, uncond = jax.tree.map(on_batch, (cond, uncond))
    # One noise key per sample: a sample's trajectory does not depend on how the batch is cut.
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b) + offset)
    traj = sampler_lib.sample(
        velocity_fn,
        exp.weights.effective(params, frozen),
        cond,
        sigmas,
        keys,
        latent_shape=(b, *exp.latent_shape),
        sde_cfg=exp.sde_cfg,
        sde_steps=sde_steps,
        guidance_scale=guidance,
        uncond=uncond if guidance is not None else None,
        norm_rescale=norm_rescale,
        keep='final' if clean else 'trajectory',
    )
    if clean:
      traj = sampler_lib.CleanSamples(latents=traj, keys=_train_keys(keys))
    images = exp.weights.decode(frozen, traj.final)
    return images if deterministic else (_pad_by_cycling(traj, rows), images)

  return rollout


def make_rollout(
    exp,
    mesh,
    param_shardings=None,
    traj_shardings=None,
    *,
    with_offset=False,
    frozen=None,
    deterministic=False,
    samples: int | None = None,
):
  """rollout(params, cond, uncond, key, step[, offset]) -> (Trajectory, images [B, H, W, 3] or
  a video run's uint8 videos [B, T, H, W, 3]),
  data-parallel over `mesh`: the sampling scan, then the decode (VAE or identity) in the same
  program, so latents never leave the devices before the reward sees pixels.

  deterministic: every step Euler (the ODE sampler eval uses); the program returns the images
  only.

  with_offset: the program takes a 6th argument, offset (int32 scalar): the batch position of
  its first sample, so a fragment of the logical batch draws exactly the noise the whole-batch
  program gives those samples (GAP, TAG).

  samples: a fragment's real samples, the first of its rows (None: every row): the program
  samples and decodes ceil(samples / n) * n rows and returns those images; the trajectory keeps
  the input's rows, the rest repeating the sampled ones (weight-0 padding, fragments.py).

  Params arrive as the rollout copy: replicated unless `param_shardings` says otherwise (e.g. an
  FSDP layout on the rollout mesh); cond/uncond are batch-sharded. `traj_shardings` (a
  Trajectory of shardings) pins the output layout; None lets XLA choose. `frozen`: the frozen
  weights on `mesh` (default: loaded replicated, with the decoder)."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=False, decode=True)
  rollout = _rollout_fn(exp, deterministic, mesh, samples)

  rep = mesh_lib.replicated(mesh)
  cond_sharding = common.cond_shardings(mesh, exp.cond_abstract(1))
  in_sh = (
      rep if param_shardings is None else param_shardings,
      cond_sharding,
      cond_sharding,
      rep,
      rep,
  )
  image_sh = mesh_lib.batch_sharding(mesh, exp.weights.decoded_ndim)  # images or videos
  out_sh = image_sh if deterministic else (traj_shardings, image_sh)
  frozen_sh = common.frozen_shardings(frozen)

  def make():
    if with_offset:
      return jax.jit(rollout, in_shardings=in_sh + (rep, frozen_sh), out_shardings=out_sh)
    return jax.jit(
        lambda p, c, u, k, s, fr: rollout(p, c, u, k, s, 0, fr),
        in_shardings=in_sh + (frozen_sh,),
        out_shardings=out_sh,
    )

  parts = (
      mesh,
      common.layout_key(param_shardings),
      common.layout_key(traj_shardings),
      with_offset,
      deterministic,
      samples,
      common.layout_key(frozen_sh),
  )
  return common.Bound(common.memoized('rollout', exp, parts, make), frozen)


def abstract_trajectory(exp, batch: int):
  """The rollout's Trajectory (or CleanSamples) for `batch` samples (ShapeDtypeStructs): the
  program traced on one local device, nothing compiled or allocated."""
  mesh = mesh_lib.make_mesh(jax.local_devices()[:1])
  sds = jax.ShapeDtypeStruct
  cond = exp.cond_abstract(batch)
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), exp.params)
  frozen = exp.weights.frozen_abstract(decode=True)
  traj, _ = jax.eval_shape(
      make_rollout(exp, mesh, frozen=frozen),
      params,
      cond,
      cond,
      sds((), jax.random.key(0).dtype),
      sds((), jnp.int32),
  )
  return traj
