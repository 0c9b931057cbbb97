"""Which sampler steps are stochastic at rollout and which are trained on (docs/design.md#the-math).

Steps are indexed t = 0 … T−1 (step t goes σ_t → σ_{t+1}). The last step (σ_{T−1} → 0) is never
stochastic nor trained on: cps is deterministic there (std = sin(aπ/2)·0) and every method we
follow trains on all but the last step at most. So the candidate steps are 0 … T−2 (T ≥ 2).

kinds:
* 'all_but_last': SDE on 0 … T−2, train on all of them (K = T−1).
* 'random_fraction': SDE on 0 … T−2, train on K = max(1, ⌊fraction·(T−1)⌋) of them drawn without
  replacement from ``key`` each call (sorted).
* 'fixed_window': SDE only on [window_start, window_start + window_size), the rest Euler (like
  MixGRPO / Flow-GRPO's ``sde_window``); train on the window (K = window_size).
* 'sliding_window': as fixed_window, with the window start
  (window_start + step // slide_every) mod (T − window_size), i.e. it moves one step later every
  ``slide_every`` optimizer steps and wraps around (MixGRPO's sliding window, stride 1).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = [
    "TimestepSelection",
    "num_selected",
    "select_timesteps",
    "sde_step_mask",
    "SELECTION_KINDS",
]

SELECTION_KINDS = ("all_but_last", "random_fraction", "fixed_window", "sliding_window")


@dataclasses.dataclass(frozen=True)
class TimestepSelection:
  """Timestep selection policy (static; see module docstring)."""

  kind: str = "all_but_last"
  fraction: float = 1.0
  window_start: int = 0
  window_size: int = 1
  slide_every: int = 1

  def __post_init__(self):
    if self.kind not in SELECTION_KINDS:
      raise ValueError(f"TimestepSelection.kind={self.kind!r}: use one of {SELECTION_KINDS}.")
    if self.kind == "random_fraction" and not (0.0 < self.fraction <= 1.0):
      raise ValueError(f"TimestepSelection.fraction={self.fraction}: must be in (0, 1].")
    if self.kind in ("fixed_window", "sliding_window"):
      if self.window_size < 1:
        raise ValueError(f"TimestepSelection.window_size={self.window_size}: must be >= 1.")
      if self.window_start < 0:
        raise ValueError(f"TimestepSelection.window_start={self.window_start}: must be >= 0.")
    if self.kind == "sliding_window" and self.slide_every < 1:
      raise ValueError(f"TimestepSelection.slide_every={self.slide_every}: must be >= 1.")


def _check(sel: TimestepSelection, num_steps: int) -> int:
  """Validates against T; returns the number of candidate steps T−1."""
  if num_steps < 2:
    raise ValueError(
        f"num_steps={num_steps}: training needs T >= 2 (the last step is never trained)."
    )
  n = num_steps - 1
  if sel.kind in ("fixed_window", "sliding_window") and sel.window_start + sel.window_size > n:
    raise ValueError(
        f"TimestepSelection window [{sel.window_start}, {sel.window_start + sel.window_size}) does not fit "
        f"in the trainable steps [0, {n}) of T={num_steps}; lower window_start/window_size."
    )
  return n


def num_selected(sel: TimestepSelection, num_steps: int) -> int:
  """K, the static number of trained timesteps per trajectory."""
  n = _check(sel, num_steps)
  if sel.kind == "all_but_last":
    return n
  if sel.kind == "random_fraction":
    # The epsilon keeps e.g. 0.3·10 = 3.0000000000000004 and 0.29·100 = 28.999999999999996 exact.
    return max(1, min(n, int(math.floor(sel.fraction * n + 1e-9))))
  return sel.window_size


def _window_start(sel: TimestepSelection, num_steps: int, step) -> jax.Array:
  if sel.kind == "fixed_window":
    return jnp.asarray(sel.window_start, jnp.int32)
  positions = (num_steps - 1) - sel.window_size + 1
  step = jnp.asarray(step, jnp.int32)
  return (sel.window_start + step // sel.slide_every) % positions


def select_timesteps(sel: TimestepSelection, num_steps: int, key, step) -> jax.Array:
  """Trained step indices int32 [K] (K static, values may be traced); ``key`` is used by
  'random_fraction' only, ``step`` (optimizer step, may be traced) by 'sliding_window' only."""
  k = num_selected(sel, num_steps)
  n = num_steps - 1
  if sel.kind == "all_but_last":
    return jnp.arange(n, dtype=jnp.int32)
  if sel.kind == "random_fraction":
    if key is None:
      raise ValueError("select_timesteps: kind='random_fraction' needs a PRNG key.")
    return jnp.sort(jax.random.permutation(key, n)[:k]).astype(jnp.int32)
  return _window_start(sel, num_steps, step) + jnp.arange(k, dtype=jnp.int32)


def sde_step_mask(sel: TimestepSelection, num_steps: int, step) -> jax.Array:
  """bool [T]: which sampler steps are stochastic at rollout for this optimizer ``step``."""
  _check(sel, num_steps)
  t = jnp.arange(num_steps, dtype=jnp.int32)
  if sel.kind in ("fixed_window", "sliding_window"):
    start = _window_start(sel, num_steps, step)
    return (t >= start) & (t < start + sel.window_size)
  return t < num_steps - 1
