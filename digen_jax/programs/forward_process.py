"""The likelihood-free objectives' loss (config.rl.algorithm 'nft' | 'awm') on a batch of clean
samples: per sample K forward-process noise levels x_t = (1 - t) x_0 + t eps, the policy's (and,
where the objective needs them, the old policy's and the reference's) velocities there, and the
objective (rl/nft.py, rl/awm.py) on the [K, B] grid of (level, sample) pairs.

What makes every schedule give colocated's update: each sample's levels and noise come from its
own key (CleanSamples.keys, drawn by the rollout from the sample's rollout key), so neither how a
batch is cut into fragments nor where a fragment is trained changes them; and the loss is
sum(w * l) / D with D the whole batch's pair weight, as GRPO's (programs/update.py).

The K levels run as one vmap over K*B (TSP lays that grid over the trainer mesh with
`step_constraint`, exactly as for GRPO's trained steps) or as a scan (B-sized forwards).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from digen_jax.rl import awm as awm_lib
from digen_jax.rl import nft as nft_lib

_F32 = jnp.float32
LIKELIHOOD_FREE = ('nft', 'awm')


def levels_and_noise(exp, keys: jax.Array, latent_shape: tuple[int, ...]):
  """(t float32 [K, B], eps float32 [K, B, N, C]) of each sample's K training noise levels, each
  with fresh noise, from its raw key data keys uint32 [B, 2]: for nft K distinct sigmas of the
  rollout grid in random order (rl/nft.sample_noise_levels), for awm K stratified ones
  (rl/awm.stratified_noise_levels). Each sample draws its own levels: AWM's code shares one draw
  over a micro-batch, which would tie a sample's levels to the fragment it is trained in."""
  k = int(exp.rl.train_noise_levels)

  r = exp.rl

  def one(key_data):
    key = jax.random.wrap_key_data(key_data)
    k_levels, k_noise = jax.random.split(key)
    if r.algorithm == 'nft':
      t = nft_lib.sample_noise_levels(k_levels, exp.sigmas, 1, k)
    else:
      t = awm_lib.stratified_noise_levels(
          k_levels,
          exp.sigmas,
          1,
          k,
          timestep_fraction=r.awm_timestep_fraction,
          include_init=r.awm_include_init,
      )
    eps = jax.random.normal(k_noise, (k, *latent_shape), _F32)
    return t[:, 0], eps

  t, eps = jax.vmap(one)(keys)  # [B, K], [B, K, N, C]
  return jnp.swapaxes(t, 0, 1), jnp.swapaxes(eps, 0, 1)


def _per_level(velocity_fn, cond, step_loop: str, step_constraint):
  """v(params, x_t [K, B, N, C], t [K, B]) -> [K, B, N, C]: the conditional velocity at every
  (level, sample) pair, the K levels as one vmap (laid out by step_constraint) or a scan."""

  def one(params, x, t):
    return velocity_fn(params, x, t, cond)

  def run(params, x_t, t):
    if step_loop == 'vmap':
      if step_constraint is not None:
        x_t, t = step_constraint((x_t, t))
      v = jax.vmap(one, in_axes=(None, 0, 0))(params, x_t, t)
      return v if step_constraint is None else step_constraint(v)
    _, v = jax.lax.scan(lambda c, a: (c, one(params, *a)), None, (x_t, t))
    return v

  return run


def lf_loss(
    exp,
    velocity_fn: Callable[..., jax.Array],
    frozen,
    batch,
    ref_params,
    old_params,
    indices,
    *,
    step_loop: str = 'vmap',
    denominator=None,
    step_weights=None,
    step_constraint=None,
):
  """loss(params) -> (loss, metrics) of the run's likelihood-free objective on `batch`
  (samples: CleanSamples, cond, uncond, adv [B], valid [B]) at the level slots `indices` int32
  [K'] (0 .. K-1; TSP repeats a slot with step_weights 0 as padding).

  old_params: the old policy's trainable params (rl/old_policy.py; nft: v_old, the sampling
  policy; awm: the EMA policy of its velocity KL), or None when it is the current one (an
  on-policy step whose decay is 0): nft's v_old is then the policy's own velocity under
  stop_gradient, with no second forward, and awm's EMA KL is 0. ref_params: the KL reference as
  grpo_loss takes it (rl.kl_beta > 0). The training forward is the conditional model's, without
  CFG (DiffusionNFT and AWM train the conditional velocity; the rollout may still use CFG).
  Metrics: 'policy_loss' and 'weight_sum' as ppo_clip_loss names them, and the objective's own
  weighted means."""
  r = exp.rl
  samples, cond, _, adv, valid = batch
  x0 = samples.latents
  t_all, eps_all = levels_and_noise(exp, samples.keys, x0.shape[1:])
  t, eps = t_all[indices], eps_all[indices]  # [K', B], [K', B, N, C]
  x_t = (1.0 - t)[..., None, None] * x0[None] + t[..., None, None] * eps
  weights = jnp.broadcast_to(jnp.asarray(valid, _F32)[None, :], t.shape)
  if step_weights is not None:
    weights = weights * jnp.asarray(step_weights, _F32)[:, None]
  velocities = _per_level(velocity_fn, cond, step_loop, step_constraint)
  sg = jax.lax.stop_gradient
  v_ref = None
  if r.kl_beta > 0:
    v_ref = sg(velocities(exp.weights.reference(ref_params, frozen), x_t, t))
  v_old_given = None
  if old_params is not None:
    v_old_given = sg(velocities(exp.weights.effective(old_params, frozen), x_t, t))

  def loss(params):
    v = velocities(exp.weights.effective(params, frozen), x_t, t)
    v_old = sg(v) if v_old_given is None and r.algorithm == 'nft' else v_old_given
    return objective(exp, v, v_old, v_ref, x0, x_t, eps, t, adv, weights, denominator)

  return loss


def objective(exp, v, v_old, v_ref, x0, x_t, eps, t, adv, weights, denominator):
  """The configured objective on the (level, sample) grid: (loss, metrics). v, v_old, v_ref,
  x_t, eps: float32 [K, B, N, C] (v_old, v_ref may be None where unused); x0 [B, N, C]; t and
  weights [K, B]; adv [B]."""
  r = exp.rl
  if r.algorithm == 'nft':
    return nft_lib.nft_loss(
        v,
        v_old,
        x0,
        x_t,
        t,
        nft_lib.optimality_probability(adv, r.adv_clip),  # advantages clipped at adv_clip
        weights,
        beta=r.nft_beta,
        adv_clip_max=r.adv_clip,
        denominator=denominator,
        v_ref=v_ref,
        kl_beta=r.kl_beta,
    )
  if r.algorithm == 'awm':
    # On-policy (one optimizer step per rollout: validation): logp_old is the current logp
    # under stop_gradient, the ratio 1.
    return awm_lib.awm_loss(
        v,
        x0,
        eps,
        t,
        adv,
        weights,
        v_ref=v_ref,
        v_ema=v_old,
        kl_beta=r.kl_beta,
        ema_kl_beta=r.awm_ema_kl_beta if v_old is not None else 0.0,
        clip_range=r.clip_range,
        adv_clip_max=r.adv_clip,
        advantage_max=r.awm_advantage_max,
        weighting=r.awm_weighting,
        ghuber_power=r.awm_ghuber_power,
        denominator=denominator,
    )
  raise ValueError(f'config.rl.algorithm={r.algorithm!r} is not a likelihood-free objective')


def metric_names(exp) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(totals, means): the configured objective's metrics that are sums over pairs divided by
  the loss denominator ('loss' first), and its weighted means over this call's pairs (beside
  'weight_sum'), as the fragment accumulator keeps them."""
  if exp.rl.algorithm == 'nft':
    return NFT_TOTALS, NFT_MEANS
  return AWM_TOTALS, AWM_MEANS


# The metrics of rl/nft.nft_loss and rl/awm.awm_loss.
NFT_TOTALS = ('loss', 'policy_loss', 'kl_div')
NFT_MEANS = ('positive_loss', 'negative_loss', 'r_mean', 'old_deviate')
AWM_TOTALS = ('loss', 'policy_loss', 'kl_div', 'ema_kl_div')
AWM_MEANS = ('mse', 'logp', 'ratio_mean', 'clip_frac', 'adv_mean')


__all__ = [
    'LIKELIHOOD_FREE',
    'levels_and_noise',
    'lf_loss',
    'metric_names',
    'objective',
]
