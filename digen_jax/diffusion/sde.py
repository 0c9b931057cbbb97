"""One sampler step of a flow-matching model: ODE (Euler) and SDE variants with exact log-probs.

Conventions (docs/design.md#the-math): x_σ = (1−σ)·x0 + σ·ε, the network predicts v ≈ ε − x0,
sampling runs σ: 1 → 0 and dt = σ_next − σ < 0. Latents are [B, ...] (usually [B, N, C]); sigmas are
a scalar or [B] (one per sample). All arithmetic is float32 whatever the dtype of x and v.

``sde_log_prob`` is THE log-density used by both the rollout (through ``sde_step``) and training, so
recomputing it with unchanged params gives exp(logp_new − logp_old) = 1 up to float32 rounding.

SDE kinds (a = ``noise_level``):

* ``flow_grpo`` (Flow-GRPO, Liu et al. 2025): per-unit-time noise std_t = a·sqrt(σ/(1−σ)), with
  σ → σ_next inside the denominator at σ = 1 (else it divides by zero; Flow-GRPO does the same
  with its ``sigma_max = sigmas[1]``, which is σ_next of the first step). Drift of the reverse SDE
  that keeps the flow's marginals:
      mean = x·(1 + std_t²/(2σ)·dt) + v·(1 + std_t²·(1−σ)/(2σ))·dt,
  transition std = std_t·sqrt(−dt).
* ``dance`` (DanceGRPO, Xue et al. 2025, ``flux_step`` with ``sde_solver=True``): transition
  std = a·sqrt(|dσ|), i.e. a constant per-unit-time std_t = a. DanceGRPO's mean is
  x + v·dσ − ½a²·score·dσ with score = −(x − (1−σ)·x0_pred)/σ² and x0_pred = x − σv, which is
  algebraically the Flow-GRPO drift above with std_t = a; we use that form (same drift function,
  std_t := a), so ``dance`` differs from ``flow_grpo`` only in std_t.
* ``cps`` (coefficients-preserving sampling, Wang & Yu 2025 "Flow-CPS"; Flow-GRPO
  ``sde_type='cps'``): x0_pred = x − σv, eps_pred = x + (1−σ)v, std = sin(a·π/2)·σ_next,
      mean = (1−σ_next)·x0_pred + sqrt(σ_next² − std²)·eps_pred,   x' = mean + std·ε.
  Flow-GRPO's cps log-prob is ``-(x' − mean)²`` ("remove all constants"): that drops not only the
  normaliser but also the 1/(2·std²) scale, so its log-ratios are those of the true density times
  2·std² (a per-step rescaling, not a constant shift). Ours is the proper Gaussian log-density,
  so clip ranges tuned on Flow-GRPO's cps log-probs do not transfer one to one.
  Note cps's std does not shrink with the step size: with an exact x0 prediction it lands on the
  forward marginals at any T, but with a posterior-mean predictor it under-disperses (tested in
  tests/core/diffusion/test_sampler.py); flow_grpo/dance converge to the marginals as T grows.

Log-probs are reduced over the latent dims: ``mean`` (default, as Flow-GRPO and DanceGRPO do) or
``sum`` (the true joint log-density); the PPO clip range depends on the choice.

Zero-std steps: cps has std = 0 at σ_next = 0 (the usual last step), and a = 0 gives std = 0 for
every kind. Such a step is deterministic (x' = mean) and its log-prob is undefined; we return 0
(and KL 0), with no NaN in values or gradients. flow_grpo and dance keep std > 0 at σ_next = 0
(std_t·sqrt(σ)); callers that want a deterministic last step use an Euler step there
(``sde_steps`` mask in the sampler).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = [
    "SDEConfig",
    "euler_step",
    "sde_mean_std",
    "sde_step",
    "sde_log_prob",
    "gaussian_log_prob",
    "cfg_velocity",
]

_F32 = jnp.float32
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
SDE_KINDS = ("flow_grpo", "dance", "cps")
REDUCE_KINDS = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class SDEConfig:
  """Which SDE the sampler runs; frozen so it can be a static jit argument.

  kind: 'flow_grpo' | 'dance' | 'cps' (see module docstring).
  noise_level: a ≥ 0 (cps: 0 ≤ a ≤ 1, a = 1 means std = σ_next, i.e. a fresh-noise DDPM-like step).
  logprob_reduce: 'mean' | 'sum' over latent dims.
  """

  kind: str = "flow_grpo"
  noise_level: float = 0.7
  logprob_reduce: str = "mean"

  def __post_init__(self):
    if self.kind not in SDE_KINDS:
      raise ValueError(f"SDEConfig.kind={self.kind!r}: use one of {SDE_KINDS}.")
    if self.logprob_reduce not in REDUCE_KINDS:
      raise ValueError(
          f"SDEConfig.logprob_reduce={self.logprob_reduce!r}: use one of {REDUCE_KINDS}."
      )
    if not (self.noise_level >= 0.0):
      raise ValueError(f"SDEConfig.noise_level={self.noise_level}: must be >= 0.")
    if self.kind == "cps" and self.noise_level > 1.0:
      raise ValueError(
          f"SDEConfig.noise_level={self.noise_level} with kind='cps': must be in [0, 1] "
          "(std = sin(a·π/2)·σ_next stops growing at a = 1)."
      )


def _per_sample(sigma, x: jax.Array) -> jax.Array:
  """sigma (scalar or [B]) -> float32 [B]."""
  s = jnp.asarray(sigma, _F32)
  if s.ndim > 1 or (s.ndim == 1 and s.shape[0] != x.shape[0]):
    raise ValueError(
        f"sigma has shape {s.shape}; expected a scalar or [B] with B={x.shape[0]} (x.shape={x.shape})."
    )
  return jnp.broadcast_to(s, (x.shape[0],))


def _expand(a: jax.Array, x: jax.Array) -> jax.Array:
  """[B] -> [B, 1, ..., 1] matching x's rank."""
  return a.reshape(a.shape + (1,) * (x.ndim - 1))


def euler_step(x: jax.Array, v: jax.Array, sigma, sigma_next) -> jax.Array:
  """ODE step x' = x + v·(σ_next − σ), float32 [B, ...] (diffusers FlowMatchEulerDiscreteScheduler.step)."""
  x = jnp.asarray(x, _F32)
  v = jnp.asarray(v, _F32)
  dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
  return x + _expand(dt, x) * v


def _flow_drift(x, v, s, dt, std_t):
  """Mean of the marginal-preserving reverse SDE step (Flow-GRPO form); s, dt, std_t expanded."""
  var = std_t * std_t
  return x * (1.0 + var / (2.0 * s) * dt) + v * (1.0 + var * (1.0 - s) / (2.0 * s)) * dt


def sde_mean_std(x: jax.Array, v: jax.Array, sigma, sigma_next, cfg: SDEConfig):
  """Gaussian transition of one SDE step: (mean float32 [B, ...], std float32 [B]).

  std is the per-sample std of x' around mean (std_t·sqrt(−dt) for flow_grpo / dance).
  """
  x = jnp.asarray(x, _F32)
  v = jnp.asarray(v, _F32)
  s = _per_sample(sigma, x)
  sn = _per_sample(sigma_next, x)
  a = float(cfg.noise_level)
  if cfg.kind in ("flow_grpo", "dance"):
    dt = sn - s
    if cfg.kind == "flow_grpo":
      # At σ = 1 the ratio σ/(1−σ) is infinite; use σ_next there (Flow-GRPO's choice).
      std_t = a * jnp.sqrt(s / (1.0 - jnp.where(s == 1.0, sn, s)))
    else:
      std_t = jnp.full_like(s, a)
    mean = _flow_drift(x, v, _expand(s, x), _expand(dt, x), _expand(std_t, x))
    std = std_t * jnp.sqrt(jnp.maximum(-dt, 0.0))
    return mean, std
  # cps
  std = math.sin(a * math.pi / 2.0) * sn
  s_e, sn_e = _expand(s, x), _expand(sn, x)
  x0_pred = x - s_e * v
  eps_pred = x + (1.0 - s_e) * v
  # σ_next² − std² = σ_next²·cos²(aπ/2) ≥ 0; the max only guards float rounding at a = 1.
  eps_coef = jnp.sqrt(jnp.maximum(sn * sn - std * std, 0.0))
  mean = (1.0 - sn_e) * x0_pred + _expand(eps_coef, x) * eps_pred
  return mean, std


def gaussian_log_prob(x_next: jax.Array, mean: jax.Array, std: jax.Array, reduce: str) -> jax.Array:
  """log N(x_next; mean, std² I) reduced over all but the batch dim -> float32 [B].

  ``reduce='mean'`` averages the per-element log-density, ``'sum'`` adds it up. Samples with
  std == 0 get 0 (deterministic step, density undefined), with finite gradients.
  """
  if reduce not in REDUCE_KINDS:
    raise ValueError(f"reduce={reduce!r}: use one of {REDUCE_KINDS}.")
  x_next = jnp.asarray(x_next, _F32)
  mean = jnp.asarray(mean, _F32)
  std = jnp.asarray(std, _F32)
  positive = std > 0.0
  safe_std = jnp.where(positive, std, 1.0)
  z = (x_next - mean) / _expand(safe_std, mean)
  axes = tuple(range(1, mean.ndim))
  # Per element: -z²/2 - log std - log sqrt(2π); the last two are equal across elements.
  const = jnp.log(safe_std) + _HALF_LOG_2PI
  if reduce == "mean":
    lp = -0.5 * jnp.mean(z * z, axis=axes) - const
  else:
    d = math.prod(mean.shape[1:])
    lp = -0.5 * jnp.sum(z * z, axis=axes) - d * const
  return jnp.where(positive, lp, 0.0)


def sde_log_prob(
    x_next: jax.Array, x: jax.Array, v: jax.Array, sigma, sigma_next, cfg: SDEConfig
) -> jax.Array:
  """log p(x_next | x) of one SDE step -> float32 [B]; used by rollout and training alike.

  x_next is treated as data (stop_gradient), as in Flow-GRPO: gradients flow only through v.
  """
  mean, std = sde_mean_std(x, v, sigma, sigma_next, cfg)
  return gaussian_log_prob(jax.lax.stop_gradient(x_next), mean, std, cfg.logprob_reduce)


def sde_step(x: jax.Array, v: jax.Array, sigma, sigma_next, noise: jax.Array, cfg: SDEConfig):
  """One SDE step with standard-normal ``noise`` [B, ...].

  Returns (x_next [B, ...], log_prob [B], mean [B, ...], std [B]); zero-std samples step to the
  mean with log_prob 0.
  """
  mean, std = sde_mean_std(x, v, sigma, sigma_next, cfg)
  x_next = mean + _expand(std, mean) * jnp.asarray(noise, _F32)
  log_prob = sde_log_prob(x_next, x, v, sigma, sigma_next, cfg)
  return x_next, log_prob, mean, std


def cfg_velocity(
    velocity_fn: Callable[..., jax.Array],
    params: Any,
    x: jax.Array,
    sigma,
    cond: Any,
    uncond: Any = None,
    guidance_scale=None,
    norm_rescale: bool = False,
) -> jax.Array:
  """Velocity with optional classifier-free guidance, float32 [B, N, C].

  velocity_fn(params, latents [B, N, C], sigma [B], cond) -> v [B, N, C]; cond/uncond are pytrees
  with leading batch dim B and identical structure and shapes (pad text to one length).
  guidance_scale None: plain v(cond). Otherwise one batched call on [x; x] with [cond; uncond]:
  v = v_u + s·(v_c − v_u), then (``norm_rescale``, QwenImage "true CFG") v·‖v_c‖/‖v‖ with norms
  over the last dim. The combination runs in float32 (QwenImage does it in the model dtype).
  """
  s = _per_sample(sigma, x)
  if guidance_scale is None:
    if norm_rescale:
      raise ValueError("cfg_velocity: norm_rescale=True needs guidance_scale (CFG on).")
    return jnp.asarray(velocity_fn(params, x, s, cond), _F32)
  if uncond is None:
    raise ValueError(
        "cfg_velocity: guidance_scale is set but uncond is None; pass the negative-prompt cond."
    )
  if jax.tree_util.tree_structure(cond) != jax.tree_util.tree_structure(uncond):
    raise ValueError("cfg_velocity: cond and uncond must be pytrees of the same structure.")
  b = x.shape[0]
  both = jax.tree_util.tree_map(lambda c, u: jnp.concatenate([c, u], axis=0), cond, uncond)
  v2 = jnp.asarray(
      velocity_fn(params, jnp.concatenate([x, x], axis=0), jnp.concatenate([s, s], axis=0), both),
      _F32,
  )
  v_c, v_u = v2[:b], v2[b:]
  comb = v_u + jnp.asarray(guidance_scale, _F32) * (v_c - v_u)
  if norm_rescale:
    c_norm = _safe_norm(v_c)
    m_norm = _safe_norm(comb)
    # Guard a zero combined vector (0/0 in QwenImage's formula): leave it as is.
    comb = comb * jnp.where(m_norm > 0.0, c_norm / jnp.where(m_norm > 0.0, m_norm, 1.0), 1.0)
  return comb


def _safe_norm(a: jax.Array) -> jax.Array:
  """L2 norm over the last dim (keepdims) whose gradient is finite at a zero vector."""
  sq = jnp.sum(a * a, axis=-1, keepdims=True)
  return jnp.where(sq > 0.0, jnp.sqrt(jnp.where(sq > 0.0, sq, 1.0)), 0.0)
