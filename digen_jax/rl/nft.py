"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process, likelihood-free.

Paper: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
arXiv 2509.16117 (method: implicit positive/negative policies and the contrastive flow-matching
loss; practical design: optimality reward, adaptive loss weighting, soft update of the sampling
policy). Reference code: NVlabs/DiffusionNFT scripts/train_nft_sd3.py (cited below as
"NFT train_nft_sd3.py:LINE") and config/base.py, config/nft.py; cross-checked against
X-GenGroup/Flow-Factory src/flow_factory/trainers/nft.py ("FF nft.py:LINE").

Convention (rectified flow, as in both codes): x_t = (1 − t)·x0 + t·ε, v = ε − x0, so the x0
prediction of a velocity is x0_hat = x_t − t·v. t is the sigma in [0, 1] (scheduler timestep/1000).

One training step, per rollout sample b (clean final latent x0_b, group-normalised advantage A_b)
and per noise level k (t_kb, fresh ε_kb):

  r_b    = clip(clip(A_b, −m, m)/m/2 + 1/2, 0, 1)                      m = adv_clip_max
  v⁺     = β·v_θ + (1 − β)·v_old            v⁻ = (1 + β)·v_old − β·v_θ  (v_old: no gradient)
  x0⁺    = x_t − t·v⁺                        x0⁻ = x_t − t·v⁻
  L^±    = mean((x0^± − x0)²) / sg(max(mean|x0^± − x0|, 1e-5))          (means over N, C)
  ℓ_kb   = m·(r·L⁺ + (1 − r)·L⁻)/β  +  kl_beta·mean((v_θ − v_ref)²)
  loss   = Σ w_kb·ℓ_kb / denominator                                     (default Σ w_kb)

Sources: r — NFT train_nft_sd3.py:909-929 (FF nft.py:400-406); v^± — :934-937 (FF :409-410);
x0^± and the detached adaptive weights clipped at 1e-5 — :939-957 (FF :412-426); the 1/β and
×adv_clip_max scaling — :959-960 (FF :429-430); KL on velocities to the reference, the base
model with the LoRA adapter disabled (:897) — :966-970 (FF :434-443). The official script
averages ℓ over the micro-batch and divides each backward by gradient_accumulation_steps ×
num_train_timesteps (:801, :983), so one optimizer step takes the plain mean over all
(level, sample) pairs: Σ w·ℓ / Σ w here.

At v_θ = v_old the gradient is d ℓ/d v_θ = −2·m·t²·(2r − 1)·(ε − x0 − v)/(D·w) (D = N·C, w the
common adaptive weight): r > 1/2 moves v toward the flow-matching target ε − x0 (raises the
sample's likelihood), r < 1/2 pushes it away, r = 1/2 (A = 0) gives no gradient.

Noise levels (``sample_noise_levels``): the sampler's own sigma grid. Per sample, a random
permutation of the T rollout levels σ_0 … σ_{T−1} is drawn and its first K = int(T·fraction)
(timestep_fraction 0.99) are trained on, each with fresh Gaussian noise (NFT
train_nft_sd3.py:569, :810-814, :864-870). Flow-Factory's NFT instead stratifies level indices
over a fraction of the grid, shared across the batch (FF nft.py:83-130); that sampler is
``digen_jax.rl.awm.stratified_noise_levels``.

Old policy (``old_policy_decay``, ``soft_update``): v_old comes from a separate copy θ_old of the
trainable weights that is also the rollout (sampling) policy (NFT train_nft_sd3.py:640, :873). It
starts equal to θ (:576-580) and after each epoch's optimizer steps is softly updated,
θ_old ← η·θ_old + (1 − η)·θ with η = old_policy_decay(global_step) (:1034-1039), global_step being
the number of optimizer steps taken so far. (The official run's separate EMA, decay 0.9, only
serves evaluation: :565-567.)

Published recipe (NFT config/base.py, config/nft.py, SD3.5-M, LoRA r=32 α=64): β = 1.0 (0.1 for
OCR and multi-reward), adv_clip_max = 5, decay type 1 (flat 0, uprate 0.001, uphold 0.5; type 2
for OCR), timestep_fraction 0.99 of T = 10 rollout steps (K = 9; T = 25 for multi-reward),
kl_beta (config ``train.beta``) = 1e-4, AdamW lr 3e-4 (wd 1e-4, grad-norm clip 1.0), rollouts
with the deterministic 2nd-order multistep DPM solver ('dpm2', flow_grpo/diffusers_patch/
solver.py) at CFG 1.0 (CFG-free), 512 px, 40 steps for evaluation, 24 images per prompt, 48
prompts per epoch, advantages (reward − per-prompt mean)/(global std + 1e-4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.rl.loss import broadcast_weights

__all__ = [
    "ADV_MODES",
    "DECAY_TYPES",
    "DecaySchedule",
    "NFTConfig",
    "forward_noise",
    "nft_loss",
    "num_train_levels",
    "old_policy_decay",
    "optimality_probability",
    "sample_noise_levels",
    "soft_update",
    "trainable_levels",
]

_F32 = jnp.float32

# The official script's adv_mode options (NFT train_nft_sd3.py:915-925); 'all' is the recipe's.
ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


def _safe_div(num, den):
  return num / jnp.where(den > 0, den, 1.0)


# ------------------------------------------------------------------ old-policy schedule


@dataclasses.dataclass(frozen=True)
class DecaySchedule:
  """Decay η(step) of the old policy's soft update: 0 before ``flat`` steps, then
  min((step − flat)·uprate, uphold) (NFT train_nft_sd3.py:169-189, ``return_decay``).

  η = 0 copies θ into θ_old (on-policy); η → 1 freezes θ_old.
  """

  flat: int = 0
  uprate: float = 0.001
  uphold: float = 0.5

  def __post_init__(self):
    if not (isinstance(self.flat, (int, np.integer)) and self.flat >= 0):
      raise ValueError(f"DecaySchedule.flat={self.flat!r}: must be an int >= 0 (steps).")
    if not (self.uprate >= 0 and math.isfinite(self.uprate)):
      raise ValueError(f"DecaySchedule.uprate={self.uprate}: must be finite and >= 0.")
    if not (0.0 <= self.uphold <= 1.0):
      raise ValueError(f"DecaySchedule.uphold={self.uphold}: must be in [0, 1] (a decay).")

  def __call__(self, step: int) -> float:
    if step < 0:
      raise ValueError(f"DecaySchedule: step={step} must be >= 0.")
    if step < self.flat:
      return 0.0
    return float(min((step - self.flat) * self.uprate, self.uphold))


# The official decay types (NFT train_nft_sd3.py:170-183): 0 on-policy, 1 the default recipe
# (config/nft.py _get_config), 2 the OCR recipe (a 75-step on-policy warm-up, then slow).
DECAY_TYPES = {
    0: DecaySchedule(flat=0, uprate=0.0, uphold=0.0),
    1: DecaySchedule(flat=0, uprate=0.001, uphold=0.5),
    2: DecaySchedule(flat=75, uprate=0.0075, uphold=0.999),
}


def old_policy_decay(step: int, schedule: DecaySchedule | int = 1) -> float:
  """η for θ_old ← η·θ_old + (1 − η)·θ after ``step`` optimizer steps.

  schedule: a DecaySchedule or an official decay type (0, 1, 2; see DECAY_TYPES). The official
  script evaluates it at the global step counted after the epoch's updates (so 1 after the first
  epoch of a one-step-per-epoch run).
  """
  if not isinstance(schedule, DecaySchedule):
    if schedule not in DECAY_TYPES:
      raise ValueError(
          f"old_policy_decay: schedule={schedule!r}: pass a DecaySchedule or one of the "
          f"official decay types {sorted(DECAY_TYPES)}."
      )
    schedule = DECAY_TYPES[schedule]
  return schedule(step)


def soft_update(old_tree: Any, new_tree: Any, decay) -> Any:
  """old·decay + new·(1 − decay), leaf by leaf, in each old leaf's dtype.

  The blend is computed in float32 (or wider, if a leaf is wider) so that bf16 weights do not lose
  the small (1 − decay) step to rounding before the cast back.
  """
  old_struct = jax.tree_util.tree_structure(old_tree)
  new_struct = jax.tree_util.tree_structure(new_tree)
  if old_struct != new_struct:
    raise ValueError(
        f"soft_update: old and new trees differ in structure ({old_struct} vs {new_struct}); "
        "pass the same parameter subset for both."
    )
  if isinstance(decay, (int, float)) and not (0.0 <= decay <= 1.0):
    raise ValueError(f"soft_update: decay={decay} must be in [0, 1].")

  def blend(o, n):
    o = jnp.asarray(o)
    n = jnp.asarray(n)
    if o.shape != n.shape:
      raise ValueError(f"soft_update: leaf shapes differ: old {o.shape} vs new {n.shape}.")
    dt = jnp.promote_types(jnp.promote_types(o.dtype, n.dtype), _F32)
    d = jnp.asarray(decay, dt)
    return (o.astype(dt) * d + n.astype(dt) * (1 - d)).astype(o.dtype)

  return jax.tree_util.tree_map(blend, old_tree, new_tree)


# ------------------------------------------------------------------ optimality probability


def optimality_probability(adv, adv_clip_max: float, adv_mode: str = "all") -> jax.Array:
  """Group-normalised advantages [B] -> optimality probability r float32 [B] in [0, 1].

  r = clip(Ã/m/2 + 1/2, 0, 1) = 1/2 + clip(A/m, −1, 1)/2 with m = adv_clip_max and Ã = clip(A, −m, m)
  (NFT train_nft_sd3.py:909-929; FF nft.py:400-406). adv_mode first reshapes Ã as the official
  script can: 'positive_only' clips it to [0, m], 'negative_only' to [−m, 0], 'one_only' maps it to
  1[Ã > 0], 'binary' to sign(Ã). r is non-decreasing in A (strictly on (−m, m) for 'all').
  """
  if not (adv_clip_max > 0):
    raise ValueError(f"optimality_probability: adv_clip_max={adv_clip_max} must be > 0.")
  if adv_mode not in ADV_MODES:
    raise ValueError(f"optimality_probability: adv_mode={adv_mode!r}: use one of {ADV_MODES}.")
  a = jnp.asarray(adv, _F32)
  if a.ndim != 1:
    raise ValueError(f"optimality_probability: adv has shape {a.shape}; expected [B].")
  m = float(adv_clip_max)
  a = jnp.clip(a, -m, m)
  if adv_mode == "positive_only":
    a = jnp.clip(a, 0.0, m)
  elif adv_mode == "negative_only":
    a = jnp.clip(a, -m, 0.0)
  elif adv_mode == "one_only":
    a = jnp.where(a > 0, 1.0, 0.0)
  elif adv_mode == "binary":
    a = jnp.sign(a)
  return jnp.clip(a / m / 2.0 + 0.5, 0.0, 1.0)


# ------------------------------------------------------------------ noise levels


def forward_noise(x0: jax.Array, t: jax.Array, eps: jax.Array) -> jax.Array:
  """x_t = (1 − t)·x0 + t·ε.

  Args:
    x0: float [B, N, C] (any trailing dims), the rollout's clean final latents.
    t: float [K, B], sigmas in [0, 1].
    eps: float [K, B, N, C], fresh noise per level (the official script draws a new ε per level:
      NFT train_nft_sd3.py:868), e.g. jax.random.normal(key, (K, *x0.shape)).
  Returns:
    x_t float [K, B, N, C], in the promoted dtype of the inputs.
  """
  x0 = jnp.asarray(x0)
  t = jnp.asarray(t)
  eps = jnp.asarray(eps)
  if t.ndim != 2 or t.shape[1:] != x0.shape[:1]:
    raise ValueError(f"forward_noise: t has shape {t.shape}; expected [K, B] with B={x0.shape[0]}.")
  if eps.shape != t.shape + x0.shape[1:]:
    raise ValueError(
        f"forward_noise: eps has shape {eps.shape}; expected [K, B, ...]={t.shape + x0.shape[1:]}."
    )
  tb = t.reshape(t.shape + (1,) * (x0.ndim - 1))
  return (1 - tb) * x0[None] + tb * eps


def trainable_levels(sigmas) -> np.ndarray:
  """The T rollout levels σ_0 … σ_{T−1} of a sampler grid [T+1] that ends in the terminal 0.

  These are the sigmas the model is evaluated at during the rollout (the official script trains
  on scheduler.timesteps/1000, which excludes the terminal 0: NFT train_nft_sd3.py:662, :864).
  """
  s = np.asarray(sigmas, np.float32)
  if s.ndim != 1 or s.shape[0] < 2 or s[-1] != 0.0:
    raise ValueError(
        f"sigmas has shape {s.shape} and last value {s[-1] if s.size else None}; expected the "
        "sampler grid [T+1] ending in 0 (digen_jax.diffusion.sigmas.sigmas)."
    )
  levels = s[:-1]
  if not (np.all(levels > 0) and np.all(levels <= 1)):
    raise ValueError(f"sigmas {s}: the T rollout levels must lie in (0, 1].")
  return levels


def num_train_levels(num_steps: int, timestep_fraction: float) -> int:
  """K = int(T·timestep_fraction) (NFT train_nft_sd3.py:569), at least 1 (as Flow-Factory's
  ``max(1, int(...))``, FF hparams/training_args.py:523), at most T."""
  if num_steps < 1:
    raise ValueError(f"num_train_levels: num_steps={num_steps} must be >= 1.")
  if not (0.0 < timestep_fraction <= 1.0):
    raise ValueError(f"num_train_levels: timestep_fraction={timestep_fraction} must be in (0, 1].")
  return max(1, min(num_steps, int(num_steps * timestep_fraction)))


def sample_noise_levels(key, sigmas, num_samples: int, num_levels: int) -> jax.Array:
  """Per sample, K distinct levels of the rollout grid in random order -> t float32 [K, B].

  Each sample draws its own uniform random permutation of σ_0 … σ_{T−1} and keeps the first K
  (NFT train_nft_sd3.py:810-814 shuffles the T timesteps per sample; :853-864 trains on the first
  num_train_timesteps). Pair it with fresh noise per level (``forward_noise``).

  Args:
    key: PRNG key.
    sigmas: the sampler's grid [T+1] ending in 0 (host array; see ``trainable_levels``).
    num_samples: B.
    num_levels: K, 1 <= K <= T (``num_train_levels``).
  """
  levels = trainable_levels(sigmas)
  n = levels.shape[0]
  if not (1 <= num_levels <= n):
    raise ValueError(
        f"sample_noise_levels: num_levels={num_levels} must be in [1, T={n}] (distinct levels "
        "per sample); lower it or use a finer grid."
    )
  if num_samples < 1:
    raise ValueError(f"sample_noise_levels: num_samples={num_samples} must be >= 1.")
  # argsort of iid uniforms is a uniformly random permutation per row.
  u = jax.random.uniform(key, (num_samples, n))
  idx = jnp.argsort(u, axis=1)[:, :num_levels]  # [B, K]
  return jnp.asarray(levels)[idx].T.astype(_F32)


# ------------------------------------------------------------------ the loss


def _per_pair_mean(x):
  return jnp.mean(x, axis=tuple(range(2, x.ndim)))


def _checked_inputs(v_theta, v_old, x0, x_t, t, r, v_ref, beta, adv_clip_max, kl_beta, weight_min):
  """nft_loss's arguments validated, as float32, all but v_theta under stop_gradient."""
  if not (beta > 0):
    raise ValueError(f"nft_loss: beta={beta} must be > 0 (the loss divides by it).")
  if not (adv_clip_max > 0):
    raise ValueError(f"nft_loss: adv_clip_max={adv_clip_max} must be > 0.")
  if not (kl_beta >= 0):
    raise ValueError(f"nft_loss: kl_beta={kl_beta} must be >= 0.")
  if not (weight_min > 0):
    raise ValueError(f"nft_loss: weight_min={weight_min} must be > 0.")
  if kl_beta > 0 and v_ref is None:
    raise ValueError("nft_loss: kl_beta > 0 needs v_ref (reference velocities); pass it or set 0.")
  v_theta = jnp.asarray(v_theta, _F32)
  if v_theta.ndim < 3:
    raise ValueError(f"nft_loss: v_theta has shape {v_theta.shape}; expected [K, B, N, C].")
  shape = v_theta.shape
  const = lambda a: jax.lax.stop_gradient(jnp.asarray(a, _F32))
  v_old, x0, x_t, t, r = const(v_old), const(x0), const(x_t), const(t), const(r)
  v_ref = None if v_ref is None else const(v_ref)
  for name, a in (("v_old", v_old), ("x_t", x_t), ("v_ref", v_ref)):
    if a is not None and a.shape != shape:
      raise ValueError(f"nft_loss: {name} has shape {a.shape}; expected v_theta's {shape}.")
  if x0.shape != shape[1:]:
    raise ValueError(f"nft_loss: x0 has shape {x0.shape}; expected [B, N, C]={shape[1:]}.")
  if t.shape != shape[:2]:
    raise ValueError(f"nft_loss: t has shape {t.shape}; expected [K, B]={shape[:2]}.")
  if r.shape != shape[1:2]:
    raise ValueError(f"nft_loss: r has shape {r.shape}; expected [B]={shape[1:2]}.")
  return v_theta, v_old, x0, x_t, t, r, v_ref


def _implicit_losses(v_theta, v_old, x0, x_t, t, beta, weight_min):
  """(L⁺, L⁻) float32 [K, B]: the adaptively weighted x0 errors of the implicit policies."""
  tb = t.reshape(t.shape + (1,) * (v_theta.ndim - 2))
  v_pos = beta * v_theta + (1.0 - beta) * v_old
  v_neg = (1.0 + beta) * v_old - beta * v_theta
  err_pos = x_t - tb * v_pos - x0[None]
  err_neg = x_t - tb * v_neg - x0[None]
  # Self-normalising weights (per pair, held constant): each term's gradient scale no longer depends
  # on how far the x0 prediction is off, which differs by orders of magnitude across levels.
  w_pos = jax.lax.stop_gradient(jnp.maximum(_per_pair_mean(jnp.abs(err_pos)), weight_min))
  w_neg = jax.lax.stop_gradient(jnp.maximum(_per_pair_mean(jnp.abs(err_neg)), weight_min))
  return _per_pair_mean(err_pos**2) / w_pos, _per_pair_mean(err_neg**2) / w_neg


def nft_loss(
    v_theta: jax.Array,
    v_old: jax.Array,
    x0: jax.Array,
    x_t: jax.Array,
    t: jax.Array,
    r: jax.Array,
    weights=None,
    *,
    beta: float,
    adv_clip_max: float,
    denominator=None,
    v_ref: jax.Array | None = None,
    kl_beta: float = 0.0,
    weight_min: float = 1e-5,
) -> tuple[jax.Array, dict]:
  """The DiffusionNFT loss (module docstring) over K levels × B samples.

  Args:
    v_theta: float [K, B, N, C], velocities under the trained params (differentiable).
    v_old: float [K, B, N, C], velocities under the old (sampling) policy (no gradient).
    x0: float [B, N, C], clean latents of the rollouts.
    x_t: float [K, B, N, C], ``forward_noise(x0, t, eps)``.
    t: float [K, B], sigmas of x_t.
    r: float [B], ``optimality_probability`` of the samples' advantages (no gradient).
    weights: None, [B] (e.g. the valid mask) or [K, B]; 0 removes a pair from loss and metrics.
    beta: β > 0 of the implicit policies.
    adv_clip_max: m > 0, the loss's ×m scale (the same m that made r).
    denominator: normaliser of the loss; default sum(weights). Pass the whole batch's sum(weights)
      to every fragment so that the fragments' losses (and gradients) sum to the batch's.
    v_ref: float [K, B, N, C], reference-model velocities (no gradient); needed if kl_beta > 0.
    kl_beta: coefficient of mean((v_θ − v_ref)²) per pair (NFT config ``train.beta``).
    weight_min: floor of the adaptive weight mean|x0_hat − x0| (the official 1e-5).
  Returns:
    (loss scalar, metrics). With the denominator (so they add up over fragments): policy_loss
    (Σ w·m(rL⁺ + (1 − r)L⁻)/β / den), kl_div (Σ w·mean((v_θ − v_ref)²) / den, 0 without v_ref);
    loss = policy_loss + kl_beta·kl_div. Weighted means over this call's pairs: positive_loss
    (L⁺), negative_loss (L⁻), r_mean, old_deviate (mean((v_θ − v_old)²), the official log);
    weight_sum = Σ w.
  """
  v_theta, v_old, x0, x_t, t, r, v_ref = _checked_inputs(
      v_theta, v_old, x0, x_t, t, r, v_ref, beta, adv_clip_max, kl_beta, weight_min
  )
  kb = v_theta.shape[:2]
  w = broadcast_weights(weights, kb)
  w_sum = jnp.sum(w)
  den = w_sum if denominator is None else jnp.asarray(denominator, _F32)

  l_pos, l_neg = _implicit_losses(v_theta, v_old, x0, x_t, t, beta, weight_min)
  rr = r[None, :]
  per_pair = adv_clip_max * (rr * l_pos + (1.0 - rr) * l_neg) / beta
  policy_loss = _safe_div(jnp.sum(w * per_pair), den)
  if v_ref is not None:
    kl_div = _safe_div(jnp.sum(w * _per_pair_mean((v_theta - v_ref) ** 2)), den)
  else:
    kl_div = jnp.zeros((), _F32)
  loss = policy_loss + kl_beta * kl_div

  sg = jax.lax.stop_gradient
  metrics = {
      "loss": sg(loss),
      "policy_loss": sg(policy_loss),
      "kl_div": sg(kl_div),
      "positive_loss": _safe_div(jnp.sum(w * sg(l_pos)), w_sum),
      "negative_loss": _safe_div(jnp.sum(w * sg(l_neg)), w_sum),
      "r_mean": _safe_div(jnp.sum(w * rr), w_sum),
      "old_deviate": _safe_div(jnp.sum(w * _per_pair_mean(sg(v_theta - v_old) ** 2)), w_sum),
      "weight_sum": w_sum,
  }
  return loss, metrics


# ------------------------------------------------------------------ hyper-parameters


@dataclasses.dataclass(frozen=True)
class NFTConfig:
  """DiffusionNFT hyper-parameters; defaults are the official SD3.5-M recipe (module docstring).

  beta: β of v^± (config/nft.py ``config.beta`` = 1.0; 0.1 for OCR / multi-reward).
  adv_clip_max: m (config/base.py ``train.adv_clip_max`` = 5).
  adv_mode: reshaping of the clipped advantage before r (``train.adv_mode`` = 'all').
  kl_beta: coefficient of the velocity KL to the reference model (``train.beta`` = 1e-4).
  decay: the old policy's soft-update schedule (``decay_type`` 1; DECAY_TYPES[2] for OCR).
  timestep_fraction: K = int(T·fraction) levels per sample (``train.timestep_fraction`` = 0.99).
  weight_min: floor of the adaptive loss weight (1e-5 in the script).
  """

  beta: float = 1.0
  adv_clip_max: float = 5.0
  adv_mode: str = "all"
  kl_beta: float = 1e-4
  decay: DecaySchedule = DECAY_TYPES[1]
  timestep_fraction: float = 0.99
  weight_min: float = 1e-5

  def __post_init__(self):
    if not (self.beta > 0 and math.isfinite(self.beta)):
      raise ValueError(f"NFTConfig.beta={self.beta}: must be finite and > 0 (official 1.0 or 0.1).")
    if not (self.adv_clip_max > 0 and math.isfinite(self.adv_clip_max)):
      raise ValueError(
          f"NFTConfig.adv_clip_max={self.adv_clip_max}: must be finite and > 0 (official 5)."
      )
    if self.adv_mode not in ADV_MODES:
      raise ValueError(f"NFTConfig.adv_mode={self.adv_mode!r}: use one of {ADV_MODES}.")
    if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
      raise ValueError(
          f"NFTConfig.kl_beta={self.kl_beta}: must be finite and >= 0 (0 turns the KL off)."
      )
    if not isinstance(self.decay, DecaySchedule):
      raise ValueError(
          f"NFTConfig.decay={self.decay!r}: pass a DecaySchedule, e.g. nft.DECAY_TYPES[1]."
      )
    if not (0.0 < self.timestep_fraction <= 1.0):
      raise ValueError(f"NFTConfig.timestep_fraction={self.timestep_fraction}: must be in (0, 1].")
    if not (self.weight_min > 0):
      raise ValueError(f"NFTConfig.weight_min={self.weight_min}: must be > 0.")

  def num_levels(self, num_steps: int) -> int:
    """K for a T-step rollout grid."""
    return num_train_levels(num_steps, self.timestep_fraction)
