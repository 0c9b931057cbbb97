"""The likelihood-free objectives' old policy in the optimizer state (rl/old_policy.py): its
decay schedule is rl/nft.DecaySchedule's, and each update soft-updates it towards the new params
exactly as DiffusionNFT's recursion says."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from digen_jax.rl import nft
from digen_jax.rl import old_policy


@pytest.mark.parametrize(
    'flat, uprate, uphold', [(0, 0.001, 0.5), (75, 0.0075, 0.999), (0, 0.0, 0.0), (3, 0.3, 0.3)]
)
def test_the_traced_decay_is_the_schedule(flat, uprate, uphold):
  schedule = nft.DecaySchedule(flat=flat, uprate=uprate, uphold=uphold)
  decay = jax.jit(old_policy.decay_schedule(flat, uprate, uphold))
  for step in [0, 1, 2, 3, 4, 10, 74, 75, 76, 100, 200, 500, 1000, 5000]:
    assert float(decay(step)) == pytest.approx(schedule(step), abs=1e-7), step


def test_every_update_soft_updates_the_old_policy_towards_the_new_params():
  params = {'w': jnp.array([1.0, -2.0, 3.0]), 'b': jnp.array(0.5)}
  decay = old_policy.decay_schedule(1, 0.2, 0.5)
  opt = old_policy.with_old_policy(optax.sgd(0.1), decay)
  state = opt.init(params)
  np.testing.assert_array_equal(old_policy.old_params(state)['w'], params['w'])
  want_old = jax.tree.map(np.asarray, params)
  p = params
  for n in range(1, 6):
    grads = jax.tree.map(lambda x: 2.0 * x, p)  # d/dp sum(p^2)
    updates, state = opt.update(grads, state, p)
    p = optax.apply_updates(p, updates)
    d = min(max(n - 1, 0) * 0.2, 0.5)  # the schedule at n steps taken (flat 1)
    want_old = jax.tree.map(lambda o, q: d * o + (1 - d) * np.asarray(q), want_old, p)
    got = old_policy.old_params(state)
    for k in params:
      np.testing.assert_allclose(np.asarray(got[k]), want_old[k], rtol=1e-6, atol=1e-7)
    assert int(state.count) == n
  # Decay 0 at the first step (flat = 1): the old policy was the new params then, and it now
  # trails them (decay 0.2 .. 0.5 since).
  assert not np.allclose(np.asarray(old_policy.old_params(state)['w']), np.asarray(p['w']))


def test_the_wrapped_updates_are_the_inner_optimizers():
  params = {'w': jnp.arange(4.0)}
  grads = {'w': jnp.array([0.1, -0.2, 0.3, -0.4])}
  inner = optax.adam(1e-2)
  wrapped = old_policy.with_old_policy(inner, old_policy.decay_schedule(0, 0.001, 0.5))
  u_inner, _ = inner.update(grads, inner.init(params), params)
  u_wrapped, _ = wrapped.update(grads, wrapped.init(params), params)
  np.testing.assert_array_equal(np.asarray(u_inner['w']), np.asarray(u_wrapped['w']))


def test_a_state_without_an_old_policy_is_refused():
  state = optax.sgd(0.1).init({'w': jnp.zeros(2)})
  with pytest.raises(TypeError, match='not an OldPolicyState'):
    old_policy.old_params(state)
  opt = old_policy.with_old_policy(optax.sgd(0.1), old_policy.decay_schedule(0, 0.0, 0.0))
  with pytest.raises(ValueError, match='needs the params'):
    opt.update({'w': jnp.zeros(2)}, opt.init({'w': jnp.zeros(2)}))
