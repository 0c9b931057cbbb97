"""The two jitted programs of every execution mode: rollout (the whole sampling scan) and the
GRPO update. Each is compiled for a mesh with explicit in/out shardings; the update donates the
params and optimizer state it replaces."""
from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.rl import objective as objective_lib
from digen_jax.rl import timesteps as timesteps_lib
from digen_jax.runtime import mesh as mesh_lib


def make_velocity_fn(graphdef, img_shape, compute_dtype):
  """velocity_fn(params, latents [B,N,C], sigma [B], cond) -> v [B,N,C] float32.

  cond = {'text': [B, L, D], 'text_mask': [B, L]}. With a bf16 compute dtype the float32 master
  params are cast inside the jitted program, so gradients flow back to float32."""
  def velocity_fn(params, latents, sigma, cond):
    if compute_dtype != jnp.float32:
      params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    v = model(latents.astype(compute_dtype), sigma, cond['text'].astype(compute_dtype),
              cond['text_mask'], img_shape=img_shape)
    return v.astype(jnp.float32)
  return velocity_fn


def guidance_of(exp):
  """(guidance_scale or None, norm_rescale) as the sampler and objective take them."""
  s = exp.config.sampler
  return (s.guidance_scale, s.norm_rescale) if s.guidance_scale > 1.0 else (None, False)


def make_rollout(exp, mesh, param_shardings=None, traj_shardings=None):
  """rollout(params, cond, uncond, key, step) -> Trajectory, data-parallel over `mesh`.

  Params arrive as the rollout copy: replicated unless `param_shardings` says otherwise (e.g. an
  FSDP layout on the rollout mesh); cond/uncond are batch-sharded. `traj_shardings` (a
  Trajectory of shardings) pins the output layout; None lets XLA choose."""
  velocity_fn = make_velocity_fn(exp.graphdef, exp.img_shape, exp.compute_dtype)
  sigmas = jnp.asarray(exp.sigmas)
  T = len(exp.sigmas) - 1
  guidance, norm_rescale = guidance_of(exp)

  def rollout(params, cond, uncond, key, step):
    sde_steps = timesteps_lib.sde_step_mask(exp.selection, T, step)
    b = cond['text'].shape[0]
    # One noise key per sample: a sample's trajectory does not depend on how the batch is cut.
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
    return sampler_lib.sample(
        velocity_fn, params, cond, sigmas, keys, latent_shape=(b, *exp.latent_shape),
        sde_cfg=exp.sde_cfg, sde_steps=sde_steps, guidance_scale=guidance,
        uncond=uncond if guidance is not None else None, norm_rescale=norm_rescale)

  rep = mesh_lib.replicated(mesh)
  cond_sharding = {'text': mesh_lib.batch_sharding(mesh, 3), 'text_mask': mesh_lib.batch_sharding(mesh, 2)}
  return jax.jit(rollout, in_shardings=(rep if param_shardings is None else param_shardings,
                                       cond_sharding, cond_sharding, rep, rep),
                 out_shardings=traj_shardings)


def make_update(exp, mesh, param_shardings, opt_shardings, traj_shardings=None):
  """update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params)
       -> (params, opt_state, metrics); rl.inner_epochs PPO epochs over the batch.
  ref_params: the frozen reference (FSDP-sharded like params) when rl.kl_beta > 0, else None.
  traj_shardings: the layout the trajectory arrives in (None: whatever it has).

  A step whose gradient is not finite is skipped (params and optimizer state unchanged) and
  reported as metrics['nonfinite'] = 1: NaN/inf never enters the weights."""
  velocity_fn = make_velocity_fn(exp.graphdef, exp.img_shape, exp.compute_dtype)
  r = exp.config.rl
  T = len(exp.sigmas) - 1
  guidance, norm_rescale = guidance_of(exp)
  optimizer = exp.optimizer

  def update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params):
    indices = timesteps_lib.select_timesteps(exp.selection, T, key, step)

    def loss_fn(p):
      return objective_lib.grpo_objective(
          velocity_fn, p, traj, cond, adv, valid, indices, sde_cfg=exp.sde_cfg,
          clip_range=r.clip_range, kl_beta=r.kl_beta,
          ref_params=ref_params if r.kl_beta > 0 else None,
          guidance_scale=guidance, uncond=uncond if guidance is not None else None,
          norm_rescale=norm_rescale)

    def epoch(carry, _):
      p, o = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
      updates, new_o = optimizer.update(grads, o, p)
      new_p = optax.apply_updates(p, updates)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      metrics = dict(metrics, loss=loss, grad_norm=grad_norm,
                     nonfinite=(~finite).astype(jnp.float32))
      return (keep(new_p, p), keep(new_o, o)), metrics

    (params, opt_state), per_epoch = jax.lax.scan(epoch, (params, opt_state), None,
                                                  length=r.inner_epochs)
    # Report the first epoch's statistics (ratio == 1 there, on-policy) and the last loss.
    metrics = jax.tree.map(lambda m: m[0], per_epoch)
    metrics['nonfinite'] = per_epoch['nonfinite'].max()
    return params, opt_state, metrics

  rep = mesh_lib.replicated(mesh)
  data = lambda nd, axis=0: mesh_lib.batch_sharding(mesh, nd, axis)
  cond_sharding = {'text': data(3), 'text_mask': data(2)}
  return jax.jit(
      update,
      in_shardings=(param_shardings, opt_shardings, traj_shardings, cond_sharding, cond_sharding,
                    data(1), data(1), rep, rep, param_shardings if r.kl_beta > 0 else None),
      out_shardings=(param_shardings, opt_shardings, rep),
      donate_argnums=(0, 1))
