"""The GRPO training objective on stored trajectories (docs/design.md#the-math).

For each selected step t and sample b it recomputes v_θ(x_t) (with the rollout's CFG settings),
the log-prob of the stored x_{t+1} through ``sde_log_prob`` (the function the rollout used), and
the PPO-clip loss against the stored behaviour log-prob; optionally β·KL to a frozen reference.

The K selected steps run either as one ``vmap`` (``step_loop='vmap'``: one batched forward over
K·B, and the timestep axis is an ordinary array axis that can be sharded over a mesh) or as a
``lax.scan`` (``'scan'``: the steps one after another, B-sized forwards like the rollout's; under
grad the residuals of all K steps are still kept unless velocity_fn is rematerialised). Both give
the same loss and gradients to float32 rounding (the model's matmuls round differently in the last
bit on a K·B batch than on a B batch, so 'scan' reproduces the rollout's log-probs more tightly).

Time-step parallelism (TSP, docs/design.md#execution-modes) is the 'vmap' loop with
``step_constraint`` laying the gathered [K, B, ...] steps over a (steps x samples) view of the
trainer mesh (so one parameter all-gather serves all K steps; programs/tsp.py); ``step_weights`` [K]
zero out the padding steps that make K divisible by the steps axis.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from digen_jax.diffusion.sampler import Trajectory
from digen_jax.diffusion.sde import SDEConfig, cfg_velocity, sde_log_prob, sde_mean_std
from digen_jax.rl.loss import gaussian_kl, ppo_clip_loss

__all__ = ["grpo_objective", "step_log_probs", "gather_steps", "STEP_LOOPS"]

STEP_LOOPS = ("vmap", "scan")
_F32 = jnp.float32


def gather_steps(traj: Trajectory, step_indices: jax.Array) -> dict:
  """Per selected step: x_t, x_{t+1} [K, B, N, C], sigma, sigma_next [K], logp_old [K, B], sde [K]."""
  idx = jnp.asarray(step_indices, jnp.int32)
  return {
      "x": traj.latents[idx],
      "x_next": traj.latents[idx + 1],
      "sigma": traj.sigmas[idx],
      "sigma_next": traj.sigmas[idx + 1],
      "logp_old": traj.log_probs[idx],
      "sde": traj.sde_steps[idx],
  }


def step_log_probs(
    velocity_fn: Callable[..., jax.Array],
    params: Any,
    traj_batch: Trajectory,
    cond: Any,
    step_indices: jax.Array,
    *,
    sde_cfg: SDEConfig,
    ref_params: Any = None,
    guidance_scale=None,
    uncond: Any = None,
    norm_rescale: bool = False,
    step_loop: str = "vmap",
    step_constraint: Callable[[Any], Any] | None = None,
) -> tuple[jax.Array, jax.Array, dict]:
  """Recompute the log-probs of the stored transitions at ``step_indices`` under ``params``.

  Returns (logp_new float32 [K, B], kl [K, B], gathered steps). kl is the exact Gaussian KL of
  the transition under params vs ``ref_params`` (reference velocity under stop_gradient), zeros
  if ref_params is None. Deterministic steps (sde_steps False) get log-prob 0 and KL 0.
  step_constraint: with 'vmap', applied to the per-step inputs and outputs (pytrees with a
  leading K axis), e.g. a sharding constraint putting K on the mesh (TSP).
  """
  if step_loop not in STEP_LOOPS:
    raise ValueError(f"step_log_probs: step_loop={step_loop!r}: use one of {STEP_LOOPS}.")
  g = gather_steps(traj_batch, step_indices)
  b = g["x"].shape[1]
  use_kl = ref_params is not None

  def one_step(x, x_next, s, sn, stochastic):
    sb = jnp.broadcast_to(s, (b,))
    snb = jnp.broadcast_to(sn, (b,))
    v = cfg_velocity(velocity_fn, params, x, sb, cond, uncond, guidance_scale, norm_rescale)
    logp = jnp.where(stochastic, sde_log_prob(x_next, x, v, sb, snb, sde_cfg), 0.0)
    if use_kl:
      v_ref = jax.lax.stop_gradient(
          cfg_velocity(velocity_fn, ref_params, x, sb, cond, uncond, guidance_scale, norm_rescale)
      )
      mean, std = sde_mean_std(x, v, sb, snb, sde_cfg)
      mean_ref, _ = sde_mean_std(x, v_ref, sb, snb, sde_cfg)
      kl = jnp.where(stochastic, gaussian_kl(mean, mean_ref, std, sde_cfg.logprob_reduce), 0.0)
    else:
      kl = jnp.zeros((b,), _F32)
    return logp, kl

  xs = (g["x"], g["x_next"], g["sigma"], g["sigma_next"], g["sde"])
  if step_loop == "vmap":
    if step_constraint is not None:
      xs = step_constraint(xs)
    logp_new, kl = jax.vmap(one_step)(*xs)
    if step_constraint is not None:
      logp_new, kl = step_constraint((logp_new, kl))
  else:
    _, (logp_new, kl) = jax.lax.scan(lambda c, a: (c, one_step(*a)), None, xs)
  return logp_new, kl, g


def grpo_objective(
    velocity_fn: Callable[..., jax.Array],
    params: Any,
    traj_batch: Trajectory,
    cond: Any,
    adv: jax.Array,
    valid: jax.Array,
    step_indices: jax.Array,
    *,
    sde_cfg: SDEConfig,
    clip_range: float,
    kl_beta: float = 0.0,
    ref_params: Any = None,
    guidance_scale=None,
    uncond: Any = None,
    norm_rescale: bool = False,
    step_loop: str = "vmap",
    denominator=None,
    step_weights=None,
    step_constraint: Callable[[Any], Any] | None = None,
    behaviour: str = "stored",
) -> tuple[jax.Array, dict]:
  """Loss (scalar) and metrics; differentiate w.r.t. ``params``.

  Args:
    velocity_fn: (params, latents [B, N, C], sigma [B], cond) -> v [B, N, C].
    params: current policy params.
    traj_batch: the rollout's Trajectory for these B samples.
    cond / uncond / guidance_scale / norm_rescale: exactly as passed to the rollout.
    adv: float [B] advantages; valid: bool [B] (samples of zero-spread groups are False).
    step_indices: int32 [K] trained steps (``select_timesteps``).
    sde_cfg: the rollout's SDEConfig.
    clip_range: PPO ε.
    kl_beta: β of the KL penalty (0 disables; > 0 needs ``ref_params``).
    step_loop: 'vmap' or 'scan' over the K steps.
    denominator: loss normaliser (default: number of weighted pairs; see rl/loss.py).
    step_weights: optional float [K] per-step multiplier of the pair weights (0 = padding step).
    step_constraint: see ``step_log_probs`` (TSP).
    behaviour: 'stored' takes the behaviour log-probs the rollout stored in the trajectory;
      'self' takes this very forward's log-probs under stop_gradient (on-policy, one epoch:
      the ratio is exactly 1 and the gradient the policy gradient, whatever precision or
      layout the rollout computed in). metrics['rollout_ratio_max_dev'] then still reports how
      far the rollout's stored log-probs are from the trainer's.
  Returns:
    (loss, metrics): the scalar metrics of ``ppo_clip_loss`` plus 'loss' and 'kl' (weighted mean
    exact KL per pair; only computed when kl_beta > 0, else 0).
  Pairs (t, b) are weighted by valid[b] · sde_steps[t]: a deterministic step has no log-prob.
  """
  if kl_beta < 0:
    raise ValueError(f"grpo_objective: kl_beta={kl_beta} must be >= 0.")
  use_kl = kl_beta > 0
  if use_kl and ref_params is None:
    raise ValueError("grpo_objective: kl_beta > 0 needs ref_params (the frozen reference model).")
  logp_new, kl, g = step_log_probs(
      velocity_fn,
      params,
      traj_batch,
      cond,
      step_indices,
      sde_cfg=sde_cfg,
      ref_params=ref_params if use_kl else None,
      guidance_scale=guidance_scale,
      uncond=uncond,
      norm_rescale=norm_rescale,
      step_loop=step_loop,
      step_constraint=step_constraint,
  )
  weights = jnp.asarray(valid, _F32)[None, :] * g["sde"].astype(_F32)[:, None]
  if step_weights is not None:
    weights = weights * jnp.asarray(step_weights, _F32)[:, None]
  if behaviour not in ("stored", "self"):
    raise ValueError(f"grpo_objective: behaviour={behaviour!r}: use 'stored' or 'self'.")
  return _loss_and_metrics(
      logp_new, g["logp_old"], kl, adv, weights, clip_range, kl_beta, denominator, behaviour
  )


def _loss_and_metrics(
    logp_new: jax.Array,
    logp_stored: jax.Array,
    kl: jax.Array,
    adv: jax.Array,
    weights: jax.Array,
    clip_range: float,
    kl_beta: float,
    denominator,
    behaviour: str,
) -> tuple[jax.Array, dict]:
  """`grpo_objective`'s loss and metrics from the recomputed [K, B] log-probs and KL, the
  rollout's stored log-probs and the pair weights."""
  logp_old = logp_stored if behaviour == "stored" else jax.lax.stop_gradient(logp_new)
  loss, metrics = ppo_clip_loss(
      logp_new, logp_old, adv, clip_range, weights, denominator=denominator
  )
  # How far the trainer's forward is from the rollout's, whichever behaviour the ratio uses.
  dev = jnp.abs(jnp.exp(jax.lax.stop_gradient(logp_new) - logp_stored) - 1.0)
  metrics["rollout_ratio_max_dev"] = jnp.max(jnp.where(weights > 0, dev, 0.0))
  w_sum = metrics["weight_sum"]
  kl_sum = jnp.sum(weights * kl)
  if kl_beta > 0:
    den = w_sum if denominator is None else jnp.asarray(denominator, _F32)
    loss = loss + kl_beta * kl_sum / jnp.where(den > 0, den, 1.0)
  metrics = dict(metrics, loss=loss, kl=kl_sum / jnp.where(w_sum > 0, w_sum, 1.0))
  return loss, metrics
