"""The old policy of the likelihood-free objectives as part of the optimizer state.

DiffusionNFT (and AWM after it) keep a second copy of the trainable weights, the old policy
v_old, that trails the trained one by a soft update after every optimizer step:

    old <- decay(n) * old + (1 - decay(n)) * new          (n: the optimizer steps so far)

(DiffusionNFT, arXiv 2509.16117, Algorithm 1; rl/nft.py `old_policy_decay` is the schedule).
With decay 0 the old policy is the current one at the start of every step.

Held in the optimizer state (an optax wrapper), the copy is sharded like the moments, saved and
restored with them, and skipped with them by a non-finite step (programs/update.optimizer_step),
with no second code path for checkpoints or resumes. With LoRA the trainable params are the
adapters, so the old policy is the old adapters only (the base is shared).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ['OldPolicyState', 'decay_schedule', 'old_params', 'with_old_policy']


class OldPolicyState(NamedTuple):
  """inner: the wrapped optimizer's state; old: the old policy (a params tree); count: int32
  scalar, the optimizer steps applied so far."""

  inner: Any
  old: Any
  count: jax.Array


def decay_schedule(flat: int, uprate: float, uphold: float) -> Callable[[jax.Array], jax.Array]:
  """decay(steps) -> float32: 0 before `flat` optimizer steps, then min((steps - flat) * uprate,
  uphold): rl/nft.DecaySchedule as a traced function (steps may be a traced int)."""

  def decay(steps):
    s = jnp.asarray(steps, jnp.float32)
    return jnp.where(s < flat, 0.0, jnp.minimum((s - flat) * uprate, uphold)).astype(jnp.float32)

  return decay


def with_old_policy(
    inner: optax.GradientTransformation, decay: Callable[[jax.Array], jax.Array]
) -> optax.GradientTransformation:
  """`inner` whose state also carries the old policy: init copies the params; every update
  soft-updates the copy towards the params that update produces, with decay(n) for n the
  optimizer steps taken with this one (DiffusionNFT evaluates its schedule at the global step
  counted after the epoch's update: NVlabs/DiffusionNFT scripts/train_nft_sd3.py, the soft update
  after the epoch loop)."""

  def init(params):
    old = jax.tree.map(jnp.copy, params)
    return OldPolicyState(inner.init(params), old, jnp.zeros((), jnp.int32))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError('with_old_policy: update needs the params (the old policy follows them)')
    updates, inner_state = inner.update(grads, state.inner, params)
    new_params = optax.apply_updates(params, updates)
    d = jnp.asarray(decay(state.count + 1), jnp.float32)
    old = jax.tree.map(lambda o, n: (d * o + (1.0 - d) * n).astype(o.dtype), state.old, new_params)
    return updates, OldPolicyState(inner_state, old, state.count + 1)

  return optax.GradientTransformation(init, update)


def old_params(opt_state) -> Any:
  """The old policy held in `opt_state` (a with_old_policy state)."""
  if not isinstance(opt_state, OldPolicyState):
    raise TypeError(
        f'old_params: the optimizer state is a {type(opt_state).__name__}, not an '
        'OldPolicyState (the run was not built with a likelihood-free objective)'
    )
  return opt_state.old
