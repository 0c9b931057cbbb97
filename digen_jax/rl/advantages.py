"""GRPO advantages: rewards normalised within each prompt group (docs/design.md#the-math)."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
import jax.numpy as jnp

__all__ = ["grpo_advantages", "reward_advantages", "STD_MODES", "COMBINE_MODES"]

STD_MODES = ("group", "global")
# How several rewards make one advantage (config.reward.combine): "sum" normalises the weighted
# sum of the rewards within each group; "advantages" normalises each reward within its group and
# sums the weighted advantages (multi-reward GRPO, as DanceGRPO combines HPS and CLIP).
COMBINE_MODES = ("sum", "advantages")


def grpo_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    clip: Optional[float] = 5.0,
    mask_failed: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """A = (r − mean_group(r)) / (std + eps), clipped to |A| ≤ clip.

  Args:
    rewards: float [B], group-contiguous: samples g·G … g·G+G−1 share prompt g (B = groups·G).
    group_size: G ≥ 2, static.
    std_mode: 'group' (std of the prompt's G rewards, Flow-GRPO's per-prompt tracker) or 'global'
      (std of all B rewards, Flow-GRPO's ``global_std``). Population std (ddof=0) like np.std.
    eps: added to the std (Flow-GRPO: 1e-4).
    clip: A_max, or None for no clipping.
  Returns:
    (adv float32 [B], valid bool [B]). Groups whose rewards are all equal (max == min, an exact
    test) get adv 0 and valid False: they carry no learning signal and the loss leaves them out.
    A group with a NaN/inf reward keeps non-finite advantages (valid False): zeroing them would
    train on the rest as if nothing happened, while the update programs skip a batch with any
    non-finite advantage and count it (programs.make_update).
    mask_failed: a NaN/inf reward is a sample whose reward failed (config.reward.failed='mask'):
      it gets adv 0 and valid False, and its group's mean and std are those of the group's
      other samples (a group left with fewer than 2 has no signal). Groups without a failure
      are bit for bit as without masking. When every reward failed nothing is masked: the
      advantages stay non-finite and the update is skipped and counted (a reward that never
      works stops the run after runtime.max_consecutive_skips).
  """
  if std_mode not in STD_MODES:
    raise ValueError(f"grpo_advantages: std_mode={std_mode!r}: use one of {STD_MODES}.")
  if (
      isinstance(group_size, bool)
      or not isinstance(group_size, (int, np.integer))
      or group_size < 2
  ):
    raise ValueError(
        f"grpo_advantages: group_size={group_size!r} must be an int >= 2 (GRPO needs a group)."
    )
  if clip is not None and clip <= 0:
    raise ValueError(f"grpo_advantages: clip={clip} must be > 0 or None.")
  group_size = int(group_size)
  r = jnp.asarray(rewards, jnp.float32)
  if r.ndim != 1 or r.shape[0] % group_size:
    raise ValueError(
        f"grpo_advantages: rewards has shape {r.shape}; expected [B] with B a multiple of group_size={group_size}."
    )
  g = r.reshape(-1, group_size)
  if mask_failed:
    return _masked(g, std_mode, eps, clip)
  mean = jnp.mean(g, axis=1, keepdims=True)
  if std_mode == "group":
    std = jnp.std(g, axis=1, keepdims=True)
  else:
    std = jnp.std(r)
  adv = (g - mean) / (std + eps)
  valid = jnp.max(g, axis=1, keepdims=True) > jnp.min(g, axis=1, keepdims=True)
  broken = ~jnp.all(jnp.isfinite(g), axis=1, keepdims=True)
  adv = jnp.where(valid | broken, adv, 0.0)
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  valid = jnp.broadcast_to(valid, g.shape)
  return adv.reshape(-1), valid.reshape(-1)


def _masked(g: jax.Array, std_mode: str, eps: float, clip: Optional[float]):
  """grpo_advantages(mask_failed=True) on group rows g [groups, G]."""
  ok = jnp.isfinite(g)
  plain_adv, plain_valid = grpo_advantages(g.reshape(-1), g.shape[1], std_mode=std_mode, eps=eps)
  plain_adv, plain_valid = plain_adv.reshape(g.shape), plain_valid.reshape(g.shape)
  n = jnp.sum(ok, axis=1, keepdims=True)
  z = jnp.where(ok, g, 0.0)
  mean = jnp.sum(z, axis=1, keepdims=True) / jnp.maximum(n, 1)
  if std_mode == "group":
    var = jnp.sum(jnp.where(ok, (z - mean) ** 2, 0.0), axis=1, keepdims=True) / jnp.maximum(n, 1)
  else:
    total = jnp.maximum(jnp.sum(ok), 1)
    mu = jnp.sum(z) / total
    var = jnp.sum(jnp.where(ok, (z - mu) ** 2, 0.0)) / total
  lo = jnp.min(jnp.where(ok, g, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(ok, g, -jnp.inf), axis=1, keepdims=True)
  valid = ok & (n >= 2) & (hi > lo)
  adv = jnp.where(valid, (z - mean) / (jnp.sqrt(var) + eps), 0.0)
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  # Groups without a failure: exactly the unmasked formula (global std: only when none failed).
  clean = jnp.all(ok, axis=1, keepdims=True) if std_mode == "group" else jnp.all(ok)
  adv = jnp.where(clean, plain_adv if clip is None else jnp.clip(plain_adv, -clip, clip), adv)
  valid = jnp.where(clean, plain_valid, valid)
  # Every reward failed: nothing to learn from; stay non-finite so the update is skipped.
  dead = ~jnp.any(ok)
  adv = jnp.where(dead, jnp.nan, adv)
  return adv.reshape(-1), valid.reshape(-1)


def reward_advantages(
    parts: jax.Array,
    weights,
    group_size: int,
    *,
    combine: str = "sum",
    std_mode: str = "group",
    eps: float = 1e-4,
    clip: Optional[float] = 5.0,
    mask_failed: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Advantages of K rewards parts [K, B] (group-contiguous) with weights [K].

  combine 'sum': grpo_advantages(sum_k w_k r_k). 'advantages': sum_k w_k A_k with A_k the
  unclipped grpo advantage of reward k alone (each reward normalised within its group), then
  clipped; valid where any reward has spread in the group. A sample whose any reward failed
  (NaN) is failed for every reward (masked or poisoning its group as mask_failed says)."""
  if combine not in COMBINE_MODES:
    raise ValueError(f"reward_advantages: combine={combine!r}: use one of {COMBINE_MODES}.")
  parts = jnp.asarray(parts, jnp.float32)
  w = jnp.asarray(weights, jnp.float32)
  if parts.ndim != 2 or w.shape != (parts.shape[0],):
    raise ValueError(
        f"reward_advantages: parts {parts.shape} and weights {w.shape} must be [K, B] and [K]."
    )
  failed = ~jnp.all(jnp.isfinite(parts), axis=0)
  kw = dict(std_mode=std_mode, eps=eps, mask_failed=mask_failed)
  if combine == "sum":
    total = jnp.where(failed, jnp.nan, jnp.sum(w[:, None] * jnp.nan_to_num(parts), axis=0))
    return grpo_advantages(total, group_size, clip=clip, **kw)
  adv = jnp.zeros(parts.shape[1], jnp.float32)
  valid = jnp.zeros(parts.shape[1], bool)
  for k in range(parts.shape[0]):
    a, v = grpo_advantages(jnp.where(failed, jnp.nan, parts[k]), group_size, clip=None, **kw)
    adv, valid = adv + w[k] * a, valid | v
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  return jnp.where(valid | jnp.isnan(adv), adv, 0.0), valid
