"""Advantage Weighted Matching (AWM): the pretraining flow-matching loss, weighted by advantage.

Paper: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models", arXiv 2509.25050 (DDPO as noisy-target score matching; AWM replaces the per-step
Gaussian likelihood of x_{t−1} by the flow-matching loss on x0 and reweights it by the
advantage). Reference code: scxue/advantage_weighted_matching
advantage_weighted_matching/scripts/train_sd3_awm.py (cited "AWM train_sd3_awm.py:LINE") and
config/dgx_awm.py; cross-checked against X-GenGroup/Flow-Factory src/flow_factory/trainers/awm.py
("FF awm.py:LINE").

Convention: x_t = (1 − t)·x0 + t·ε, target velocity u = ε − x0, t the sigma in [0, 1].

Per rollout sample b (clean latent x0_b, group-normalised advantage A_b) and trained level k (t_kb,
fresh ε_kb):

  mse_kb   = mean((v_θ(x_t, t) − (ε − x0))²)                                   (over N, C)
  logp_kb  = −ρ(mse_kb, t)   the weighted matching loss as a log-likelihood surrogate:
             'Uniform' mse · 't' t·mse · 't**2' t²·mse · 'huber' t·(√(mse + 1e-10) − 1e-5)
             'ghuber' t·((mse + 1e-10)^p − 1e-10^p)/p   (p = ghuber_power)
  Â_b      = clip(A_b, −M, M)/M·advantage_max    (no rescaling when advantage_max is None)
  ρ_kb     = exp(logp_kb − logp_old_kb)          (logp_old = sg(logp) on-policy: ρ = 1, ∇ρ = ∇logp)
  ℓ_kb     = max(−Â·ρ, −Â·clip(ρ, 1 − ε, 1 + ε))
             + kl_beta·mean((v_θ − v_ref)²) + ema_kl_beta·mean((v_θ − v_ema)²)
  loss     = Σ w_kb·ℓ_kb / denominator           (default Σ w_kb: the plain mean over pairs)

On-policy (the first optimizer step after a rollout, and every step of the published recipe,
which takes one step per rollout) the gradient is Σ w·Â·∇(−ρ(mse))/den: a flow-matching loss
weighted by the advantage (paper, the AWM objective).

Sources: logp and the weightings — AWM train_sd3_awm.py:236-252 (FF awm.py:304-330); advantage
clip and rescale — :1293-1299 (FF awm.py:466-469 clips only: its recipe's adv_clip_range 1.0
equals M = 1, advantage_max = 1 here); per-pair ratio ('exp_first') and PPO clip —
:1305-1327 (FF awm.py:496-502; the 'sum_first' per-sample ratio variant is not implemented);
on-policy old log-prob = the current one detached — :1282-1284 (FF computes it under the sampling
policy before the step, the same values: FF awm.py:441-461); velocity KL to the reference (base)
model and to the EMA ("kl_weight 'Uniform'") — :1330-1352 (FF awm.py:506-537; the official
script applies the EMA term only when kl_beta > 0 too, here the two are independent); the mean
over all (level, sample) pairs of a step — the micro-batch mean with accelerate's accumulation.

Noise levels (``stratified_noise_levels``): indices into the rollout's T-level grid, stratified:
K strata over [lo, int(T·fraction)] (lo = 0, or 1 to skip the pure-noise level σ_0 = 1:
'discrete_wo_init'), one uniform index per stratum, the same K levels for every sample of a
micro-batch (AWM train_sd3_awm.py:1172-1180, :1197-1205; FF utils/noise_schedule.py:185-259),
each level with fresh noise (:1215-1220).

EMA policy (v_ema): a copy of the trainable weights, updated after every epoch with
θ_ema ← η·θ_ema + (1 − η)·θ, η = min(0.3, 0.001·global_step) ('linear', AWM
train_sd3_awm.py:1409-1419), i.e. ``nft.DecaySchedule(flat=0, uprate=0.001, uphold=0.3)`` with
``nft.soft_update``. (Flow-Factory's 'linear' schedule ramps 0 → 0.3 over warmup_steps = 1000
epochs instead: FF ema/ema_utils.py linear_warmup_decay.) The rollouts use the current policy
(off_policy False in the recipe; with off_policy they and logp_old would use the EMA: :883-904).

Published recipe (config/dgx_awm.py, SD3.5-M, LoRA on attention): weighting 'ghuber', p = 0.25,
clip_range 1 (ρ ∈ [0, 2]), adv_clip_max 5 (base_awm.py), advantage_max 1, kl_beta (``train.beta``)
1e-4 for PickScore (1e-3 GenEval, 3e-3 OCR), ema_kl_beta (``train.ema_beta``) 1, EMA decay
'linear' to 0.3, K = 6 levels with timestep_fraction 0.9 of T = 14 rollout steps ('discrete' for
PickScore, 'discrete_wo_init' for GenEval/OCR), AdamW lr 3e-4 (wd 1e-4, grad-norm clip 1.0),
CFG 1.0 (no CFG) rollouts with the SA-solver (deterministic for PickScore: noise_level 0),
512 px, 24 images per prompt, advantages with per-prompt mean and global std.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.rl.loss import broadcast_weights
from digen_jax.rl.nft import DecaySchedule, trainable_levels

__all__ = [
    "AWMConfig",
    "WEIGHTINGS",
    "awm_log_prob",
    "awm_loss",
    "scale_advantages",
    "stratified_noise_levels",
]

_F32 = jnp.float32
WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")
# The official small constant of the (generalised) Huber weightings (AWM train_sd3_awm.py:247-249).
_HUBER_EPS = 1e-10


def _safe_div(num, den):
  return num / jnp.where(den > 0, den, 1.0)


def _per_pair_mean(x):
  return jnp.mean(x, axis=tuple(range(2, x.ndim)))


def _check_weighting(weighting: str, ghuber_power: float, where: str):
  if weighting not in WEIGHTINGS:
    raise ValueError(f"{where}: weighting={weighting!r}: use one of {WEIGHTINGS}.")
  if weighting == "ghuber" and not (ghuber_power > 0):
    raise ValueError(f"{where}: ghuber_power={ghuber_power} must be > 0.")


def _weighted_log_prob(mse, t, weighting: str, ghuber_power: float):
  if weighting == "Uniform":
    return -mse
  if weighting == "t":
    return -mse * t
  if weighting == "t**2":
    return -mse * t**2
  if weighting == "huber":
    return -(jnp.sqrt(mse + _HUBER_EPS) - math.sqrt(_HUBER_EPS)) * t
  p = float(ghuber_power)
  return -((mse + _HUBER_EPS) ** p - _HUBER_EPS**p) * t / p


def awm_log_prob(
    v: jax.Array,
    x0: jax.Array,
    eps: jax.Array,
    t: jax.Array,
    *,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
) -> jax.Array:
  """The weighted matching log-likelihood surrogate logp float32 [K, B] (module docstring).

  Args:
    v: float [K, B, N, C], velocities at x_t = forward_noise(x0, t, eps).
    x0: float [B, N, C]; eps: float [K, B, N, C]; t: float [K, B].
  Use it to precompute logp_old under the sampling policy for an off-policy step.
  """
  _check_weighting(weighting, ghuber_power, "awm_log_prob")
  v = jnp.asarray(v, _F32)
  if v.ndim < 3:
    raise ValueError(f"awm_log_prob: v has shape {v.shape}; expected [K, B, N, C].")
  x0 = jnp.asarray(x0, _F32)
  eps = jnp.asarray(eps, _F32)
  t = jnp.asarray(t, _F32)
  if eps.shape != v.shape:
    raise ValueError(f"awm_log_prob: eps has shape {eps.shape}; expected v's {v.shape}.")
  if x0.shape != v.shape[1:]:
    raise ValueError(f"awm_log_prob: x0 has shape {x0.shape}; expected [B, N, C]={v.shape[1:]}.")
  if t.shape != v.shape[:2]:
    raise ValueError(f"awm_log_prob: t has shape {t.shape}; expected [K, B]={v.shape[:2]}.")
  mse = _per_pair_mean((v - (eps - x0[None])) ** 2)
  return _weighted_log_prob(mse, t, weighting, ghuber_power)


def scale_advantages(adv, adv_clip_max: float, advantage_max: float | None = 1.0) -> jax.Array:
  """Â = clip(A, −M, M)/M·advantage_max, or clip(A, −M, M) if advantage_max is None -> float32 [B]
  (AWM train_sd3_awm.py:1293-1299)."""
  if not (adv_clip_max > 0):
    raise ValueError(f"scale_advantages: adv_clip_max={adv_clip_max} must be > 0.")
  if advantage_max is not None and not (advantage_max > 0):
    raise ValueError(f"scale_advantages: advantage_max={advantage_max} must be > 0 or None.")
  a = jnp.clip(jnp.asarray(adv, _F32), -adv_clip_max, adv_clip_max)
  if advantage_max is not None:
    a = a / adv_clip_max * advantage_max
  return a


def _check_hparams(weighting, ghuber_power, clip_range, kl_beta, ema_kl_beta, v_ref, v_ema):
  _check_weighting(weighting, ghuber_power, "awm_loss")
  if not (clip_range > 0):
    raise ValueError(f"awm_loss: clip_range={clip_range} must be > 0.")
  if not (kl_beta >= 0 and ema_kl_beta >= 0):
    raise ValueError(f"awm_loss: kl_beta={kl_beta}, ema_kl_beta={ema_kl_beta} must be >= 0.")
  if kl_beta > 0 and v_ref is None:
    raise ValueError("awm_loss: kl_beta > 0 needs v_ref (reference velocities); pass it or set 0.")
  if ema_kl_beta > 0 and v_ema is None:
    raise ValueError("awm_loss: ema_kl_beta > 0 needs v_ema (EMA velocities); pass it or set 0.")


def _old_log_prob(logp, logp_old):
  """logp_old under stop_gradient; on-policy (None) the current logp itself."""
  if logp_old is None:
    return jax.lax.stop_gradient(logp)
  logp_old = jax.lax.stop_gradient(jnp.asarray(logp_old, _F32))
  if logp_old.shape != logp.shape:
    raise ValueError(
        f"awm_loss: logp_old has shape {logp_old.shape}; expected [K, B]={logp.shape}."
    )
  return logp_old


def _pair_means(w, *, mse, logp, ratio, clip_range, adv):
  """awm_loss's diagnostic metrics: weighted means over the call's pairs, and sum(w)."""
  sg = jax.lax.stop_gradient
  w_sum = jnp.sum(w)
  mean = lambda x: _safe_div(jnp.sum(w * sg(x)), w_sum)
  return {
      "mse": mean(mse),
      "logp": mean(logp),
      "ratio_mean": mean(ratio),
      "clip_frac": mean((jnp.abs(sg(ratio) - 1.0) > clip_range).astype(_F32)),
      "adv_mean": mean(adv),
      "weight_sum": w_sum,
  }


def awm_loss(
    v_theta: jax.Array,
    x0: jax.Array,
    eps: jax.Array,
    t: jax.Array,
    adv: jax.Array,
    weights=None,
    *,
    logp_old: jax.Array | None = None,
    v_ref: jax.Array | None = None,
    v_ema: jax.Array | None = None,
    kl_beta: float = 0.0,
    ema_kl_beta: float = 0.0,
    clip_range: float = 1.0,
    adv_clip_max: float = 5.0,
    advantage_max: float | None = 1.0,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    denominator=None,
) -> tuple[jax.Array, dict]:
  """The AWM loss (module docstring) over K levels × B samples.

  Args:
    v_theta: float [K, B, N, C], velocities under the trained params at x_t (differentiable).
    x0: float [B, N, C] clean latents; eps: float [K, B, N, C] the noise of x_t; t: float [K, B].
    adv: float [B], group-normalised advantages (clipped and rescaled here).
    weights: None, [B] (e.g. the valid mask) or [K, B]; 0 removes a pair from loss and metrics.
    logp_old: float [K, B], ``awm_log_prob`` under the sampling policy with the same weighting;
      None means on-policy (the current logp, detached: ratio 1).
    v_ref, v_ema: float [K, B, N, C], reference / EMA velocities (no gradient); needed when their
      coefficient is > 0.
    clip_range: ε > 0; ρ is clipped to [1 − ε, 1 + ε].
    denominator: normaliser of the loss; default sum(weights). Pass the whole batch's sum(weights)
      to every fragment so that the fragments' losses (and gradients) sum to the batch's.
  Returns:
    (loss scalar, metrics). With the denominator (they add up over fragments): policy_loss,
    kl_div (Σ w·mean((v_θ − v_ref)²)/den), ema_kl_div (same with v_ema); loss = policy_loss +
    kl_beta·kl_div + ema_kl_beta·ema_kl_div. Weighted means over this call's pairs: mse (the
    flow-matching loss), logp, ratio_mean, clip_frac (|ρ − 1| > ε), adv_mean (Â); weight_sum.
  """
  _check_hparams(weighting, ghuber_power, clip_range, kl_beta, ema_kl_beta, v_ref, v_ema)
  sg = jax.lax.stop_gradient
  v_theta = jnp.asarray(v_theta, _F32)
  # awm_log_prob validates v_theta, x0, eps, t; the mse is its input, recomputed for the metric.
  logp = awm_log_prob(v_theta, x0, eps, t, weighting=weighting, ghuber_power=ghuber_power)
  shape, kb = v_theta.shape, v_theta.shape[:2]
  x0, eps = sg(jnp.asarray(x0, _F32)), sg(jnp.asarray(eps, _F32))
  mse = _per_pair_mean((v_theta - (eps - x0[None])) ** 2)
  adv = jnp.asarray(adv, _F32)
  if adv.shape != kb[1:]:
    raise ValueError(f"awm_loss: adv has shape {adv.shape}; expected [B]={kb[1:]}.")
  a = sg(scale_advantages(adv, adv_clip_max, advantage_max))[None, :]
  w = broadcast_weights(weights, kb)
  den = jnp.sum(w) if denominator is None else jnp.asarray(denominator, _F32)

  ratio = jnp.exp(logp - _old_log_prob(logp, logp_old))
  per_pair = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range))
  policy_loss = _safe_div(jnp.sum(w * per_pair), den)

  def velocity_kl(v_other, name):
    if v_other is None:
      return jnp.zeros((), _F32)
    v_other = sg(jnp.asarray(v_other, _F32))
    if v_other.shape != shape:
      raise ValueError(f"awm_loss: {name} has shape {v_other.shape}; expected v_theta's {shape}.")
    return _safe_div(jnp.sum(w * _per_pair_mean((v_theta - v_other) ** 2)), den)

  kl_div = velocity_kl(v_ref, "v_ref")
  ema_kl_div = velocity_kl(v_ema, "v_ema")
  loss = policy_loss + kl_beta * kl_div + ema_kl_beta * ema_kl_div

  metrics = {
      "loss": sg(loss),
      "policy_loss": sg(policy_loss),
      "kl_div": sg(kl_div),
      "ema_kl_div": sg(ema_kl_div),
      **_pair_means(w, mse=mse, logp=logp, ratio=ratio, clip_range=clip_range, adv=a),
  }
  return loss, metrics


def stratified_noise_levels(
    key,
    sigmas,
    num_samples: int,
    num_levels: int,
    *,
    timestep_fraction: float = 0.9,
    include_init: bool = True,
    per_sample: bool = False,
) -> jax.Array:
  """K stratified levels of the rollout grid -> t float32 [K, B] (module docstring).

  Strata: boundaries b = linspace(lo, int(T·fraction), K + 1), lo = 0 if include_init else 1;
  stratum j draws index ⌊b_j⌋ + ⌊u·(⌊b_{j+1}⌋ − ⌊b_j⌋)⌋, u ~ U[0, 1) (a stratum narrower than one
  index collapses to ⌊b_j⌋, so K larger than the span repeats levels, as in the official code).
  per_sample False (the official): one draw shared by all B samples; True: one draw per sample.

  Args:
    sigmas: the sampler grid [T+1] ending in 0 (host array; nft.trainable_levels).
  """
  levels = trainable_levels(sigmas)
  n = levels.shape[0]
  if not (0.0 < timestep_fraction <= 1.0):
    raise ValueError(
        f"stratified_noise_levels: timestep_fraction={timestep_fraction} must be in (0, 1]."
    )
  lo = 0 if include_init else 1
  hi = int(n * timestep_fraction)
  if hi <= lo:
    raise ValueError(
        f"stratified_noise_levels: the span [{lo}, {hi}) of T={n} levels × fraction "
        f"{timestep_fraction} is empty; raise timestep_fraction or the number of rollout steps."
    )
  if num_levels < 1 or num_samples < 1:
    raise ValueError(
        f"stratified_noise_levels: num_levels={num_levels}, num_samples={num_samples} must be >= 1."
    )
  b = np.linspace(lo, hi, num_levels + 1)
  lower = np.floor(b[:-1]).astype(np.int32)
  width = (np.floor(b[1:]) - np.floor(b[:-1])).astype(np.float32)
  u = jax.random.uniform(key, (num_levels, num_samples if per_sample else 1))
  idx = jnp.asarray(lower)[:, None] + jnp.floor(u * jnp.asarray(width)[:, None]).astype(jnp.int32)
  idx = jnp.clip(idx, 0, n - 1)
  t = jnp.asarray(levels)[idx]
  return jnp.broadcast_to(t, (num_levels, num_samples)).astype(_F32)


@dataclasses.dataclass(frozen=True)
class AWMConfig:
  """AWM hyper-parameters; defaults are the official SD3.5-M PickScore recipe (module docstring).

  weighting / ghuber_power: ρ of the matching loss ('ghuber', 0.25).
  clip_range: PPO ratio clip ε (1).
  adv_clip_max / advantage_max: Â = clip(A, ±5)/5·1; advantage_max None keeps clip(A, ±M).
  kl_beta: velocity KL to the reference model (1e-4; 1e-3 GenEval, 3e-3 OCR).
  ema_kl_beta: velocity KL to the EMA policy (1).
  ema_decay: the EMA's soft-update schedule (η = min(0.3, 0.001·step)).
  num_levels / timestep_fraction / include_init: K = 6 stratified levels over the first 90% of
    the grid, σ_0 included ('discrete'; False for GenEval/OCR's 'discrete_wo_init').
  """

  weighting: str = "ghuber"
  ghuber_power: float = 0.25
  clip_range: float = 1.0
  adv_clip_max: float = 5.0
  advantage_max: float | None = 1.0
  kl_beta: float = 1e-4
  ema_kl_beta: float = 1.0
  ema_decay: DecaySchedule = DecaySchedule(flat=0, uprate=0.001, uphold=0.3)
  num_levels: int = 6
  timestep_fraction: float = 0.9
  include_init: bool = True

  def __post_init__(self):
    if self.weighting not in WEIGHTINGS:
      raise ValueError(f"AWMConfig.weighting={self.weighting!r}: use one of {WEIGHTINGS}.")
    if not (self.ghuber_power > 0 and math.isfinite(self.ghuber_power)):
      raise ValueError(
          f"AWMConfig.ghuber_power={self.ghuber_power}: must be finite and > 0 (official 0.25)."
      )
    if not (self.clip_range > 0):
      raise ValueError(f"AWMConfig.clip_range={self.clip_range}: must be > 0 (official 1).")
    if not (self.adv_clip_max > 0 and math.isfinite(self.adv_clip_max)):
      raise ValueError(
          f"AWMConfig.adv_clip_max={self.adv_clip_max}: must be finite and > 0 (official 5)."
      )
    if self.advantage_max is not None and not (self.advantage_max > 0):
      raise ValueError(
          f"AWMConfig.advantage_max={self.advantage_max}: must be > 0, or None for no rescale."
      )
    for name in ("kl_beta", "ema_kl_beta"):
      v = getattr(self, name)
      if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"AWMConfig.{name}={v}: must be finite and >= 0 (0 turns the term off).")
    if not isinstance(self.ema_decay, DecaySchedule):
      raise ValueError(f"AWMConfig.ema_decay={self.ema_decay!r}: pass an nft.DecaySchedule.")
    if not (isinstance(self.num_levels, (int, np.integer)) and self.num_levels >= 1):
      raise ValueError(
          f"AWMConfig.num_levels={self.num_levels!r}: must be an int >= 1 (official 6)."
      )
    if not (0.0 < self.timestep_fraction <= 1.0):
      raise ValueError(f"AWMConfig.timestep_fraction={self.timestep_fraction}: must be in (0, 1].")
