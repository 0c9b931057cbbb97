"""GRPO advantages: rewards normalised within each prompt group (DESIGN.md §2)."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
import jax.numpy as jnp

__all__ = ["grpo_advantages", "STD_MODES"]

STD_MODES = ("group", "global")


def grpo_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    clip: Optional[float] = 5.0,
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
