"""PPO-clip policy loss over (timestep, sample) pairs, and the exact Gaussian KL
(docs/design.md#the-math).

Averaging. Flow-GRPO takes, per selected timestep, the mean of max(−A·ρ, −A·clip(ρ)) over the
samples of a micro-batch, and accumulates gradients over timesteps and micro-batches with
accelerate's gradient accumulation (which divides by the number of accumulation steps); it first
drops samples whose advantage is 0. The result is the plain mean over all (timestep, kept sample)
pairs. ``ppo_clip_loss`` computes exactly that as sum(w·ℓ) / sum(w) with weights w [K, B] (valid
samples × stochastic steps). For gradient accumulation across fragments (GAP), pass the logical
batch's total weight as ``denominator`` so that summing fragment losses gives the full-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ppo_clip_loss", "gaussian_kl", "broadcast_weights"]

_F32 = jnp.float32


def broadcast_weights(weights, shape: tuple[int, int]) -> jax.Array:
  """None | bool/float [B] | [K, B] -> float32 [K, B]."""
  if weights is None:
    return jnp.ones(shape, _F32)
  w = jnp.asarray(weights).astype(_F32)
  if w.shape == shape[1:]:
    return jnp.broadcast_to(w[None, :], shape)
  if w.shape == shape:
    return w
  raise ValueError(f"weights has shape {w.shape}; expected [B]={shape[1:]} or [K, B]={shape}.")


def _safe_div(num, den):
  return num / jnp.where(den > 0, den, 1.0)


def ppo_clip_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    adv: jax.Array,
    clip_range: float,
    weights=None,
    *,
    denominator=None,
) -> tuple[jax.Array, dict]:
  """Clipped surrogate loss.

  Args:
    logp_new: float [K, B], log-probs under the current params (differentiable).
    logp_old: float [K, B], behaviour log-probs stored at rollout (treated as constants).
    adv: float [B], advantages (already clipped by ``grpo_advantages``).
    clip_range: ε > 0; ρ is clipped to [1−ε, 1+ε].
    weights: None, [B] (e.g. the ``valid`` mask) or [K, B]; 0 removes a pair from loss and metrics.
    denominator: normaliser of the loss; default sum(weights) (the weighted mean).
  Returns:
    (loss scalar, metrics): policy_loss, approx_kl = ½·mean((logp_new − logp_old)²) (Flow-GRPO's),
    clip_frac = mean(|ρ − 1| > ε), ratio_mean = mean(ρ) (weighted means over pairs), ratio_max_dev =
    max |ρ − 1| over pairs with w > 0, weight_sum = sum(w).
  """
  if not (clip_range > 0):
    raise ValueError(f"ppo_clip_loss: clip_range={clip_range} must be > 0.")
  logp_new = jnp.asarray(logp_new, _F32)
  logp_old = jax.lax.stop_gradient(jnp.asarray(logp_old, _F32))
  if logp_new.ndim != 2 or logp_old.shape != logp_new.shape:
    raise ValueError(
        f"ppo_clip_loss: logp_new {logp_new.shape} and logp_old {logp_old.shape} must both be [K, B]."
    )
  adv = jax.lax.stop_gradient(jnp.asarray(adv, _F32))
  if adv.shape != logp_new.shape[1:]:
    raise ValueError(
        f"ppo_clip_loss: adv has shape {adv.shape}; expected [B]={logp_new.shape[1:]}."
    )
  w = broadcast_weights(weights, logp_new.shape)
  w_sum = jnp.sum(w)
  den = w_sum if denominator is None else jnp.asarray(denominator, _F32)

  log_ratio = logp_new - logp_old
  ratio = jnp.exp(log_ratio)
  a = adv[None, :]
  unclipped = -a * ratio
  clipped = -a * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
  per_pair = jnp.maximum(unclipped, clipped)
  loss = _safe_div(jnp.sum(w * per_pair), den)

  metrics = {
      "policy_loss": loss,
      "approx_kl": _safe_div(0.5 * jnp.sum(w * jax.lax.stop_gradient(log_ratio) ** 2), w_sum),
      "clip_frac": _safe_div(
          jnp.sum(w * (jnp.abs(jax.lax.stop_gradient(ratio) - 1.0) > clip_range).astype(_F32)),
          w_sum,
      ),
      "ratio_mean": _safe_div(jnp.sum(w * jax.lax.stop_gradient(ratio)), w_sum),
      # Largest |ρ − 1| over weighted pairs: must be ~0 before the first update of a batch.
      "ratio_max_dev": jnp.max(jnp.where(w > 0, jnp.abs(jax.lax.stop_gradient(ratio) - 1.0), 0.0)),
      "weight_sum": w_sum,
  }
  return loss, metrics


def gaussian_kl(
    mean_theta: jax.Array, mean_ref: jax.Array, std: jax.Array, reduce: str = "mean"
) -> jax.Array:
  """KL(N(μ_θ, s²I) ‖ N(μ_ref, s²I)) per sample -> float32 [B].

  Per element (μ_θ − μ_ref)² / (2·s²); reduced over all but the batch dim like the log-prob
  ('mean' or 'sum'), so β trades off against a loss built from equally reduced log-probs.
  std is the per-sample transition std [B] (std_t·sqrt(−dt) for flow_grpo). Flow-GRPO divides by
  std_t² without the dt factor; this is the exact KL of the two transition kernels. Samples with
  std == 0 (deterministic steps) get 0.
  """
  if reduce not in ("mean", "sum"):
    raise ValueError(f"gaussian_kl: reduce={reduce!r}: use 'mean' or 'sum'.")
  mean_theta = jnp.asarray(mean_theta, _F32)
  mean_ref = jnp.asarray(mean_ref, _F32)
  std = jnp.asarray(std, _F32)
  if std.shape != mean_theta.shape[:1]:
    raise ValueError(
        f"gaussian_kl: std has shape {std.shape}; expected [B]={mean_theta.shape[:1]}."
    )
  positive = std > 0
  safe_var = jnp.where(positive, std * std, 1.0)
  d2 = (mean_theta - mean_ref) ** 2
  axes = tuple(range(1, d2.ndim))
  red = jnp.mean(d2, axis=axes) if reduce == "mean" else jnp.sum(d2, axis=axes)
  return jnp.where(positive, red / (2.0 * safe_var), 0.0)
