"""digen_jax.rl: advantages, PPO-clip loss, KL, timestep selection, the GRPO objective, and the
ratio test (recomputed log-probs of a stored trajectory under unchanged params give ratio 1)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import sampler, sde
from digen_jax.diffusion import sigmas as sigmas_lib
from digen_jax.rl import advantages, loss, objective, timesteps

from tests.helpers.toy_model import B, C, D_COND, HID, N, T, toy_cond, toy_params, toy_velocity  # noqa: F401

SIGMAS = sigmas_lib.sigmas(sigmas_lib.qwenimage_scheduler_config(), T, image_seq_len=N)


# ------------------------------------------------------------------ advantages


def test_advantages_group_std_and_zero_spread():
  r = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
  adv, valid = advantages.grpo_advantages(r, 4)
  std1 = math.sqrt(1.25)  # population std of 1, 2, 3, 4
  expected = [(x - 2.5) / (std1 + 1e-4) for x in (1, 2, 3, 4)] + [0.0] * 4
  np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(valid), [True] * 4 + [False] * 4)


def test_advantages_global_std():
  r = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
  adv, valid = advantages.grpo_advantages(r, 4, std_mode="global")
  std = math.sqrt(17.5 / 8)  # all 8 rewards: mean 3.75, squared deviations sum to 17.5
  expected = [(x - 2.5) / (std + 1e-4) for x in (1, 2, 3, 4)] + [0.0] * 4
  np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(valid), [True] * 4 + [False] * 4)


def test_advantages_clip():
  r = jnp.array([0.0] * 9 + [1.0])  # mean 0.1, std 0.3: the 1 gets 0.9/0.3 ≈ 3
  adv, _ = advantages.grpo_advantages(r, 10, clip=2.0)
  np.testing.assert_allclose(np.asarray(adv[:9]), -0.1 / (0.3 + 1e-4), rtol=1e-5)
  np.testing.assert_allclose(float(adv[9]), 2.0)
  adv_nc, _ = advantages.grpo_advantages(r, 10, clip=None)
  np.testing.assert_allclose(float(adv_nc[9]), 0.9 / (0.3 + 1e-4), rtol=1e-5)


def test_advantages_jit_and_validation():
  f = jax.jit(functools.partial(advantages.grpo_advantages, group_size=2, std_mode="group"))
  adv, valid = f(jnp.array([0.0, 1.0, 3.0, 3.0]))
  np.testing.assert_allclose(
      np.asarray(adv), [-0.5 / (0.5 + 1e-4), 0.5 / (0.5 + 1e-4), 0, 0], rtol=1e-6
  )
  np.testing.assert_array_equal(np.asarray(valid), [True, True, False, False])
  with pytest.raises(ValueError, match="multiple of group_size"):
    advantages.grpo_advantages(jnp.zeros(5), 2)
  with pytest.raises(ValueError, match="std_mode"):
    advantages.grpo_advantages(jnp.zeros(4), 2, std_mode="batch")
  with pytest.raises(ValueError, match="group_size"):
    advantages.grpo_advantages(jnp.zeros(4), 1)


# ------------------------------------------------------------------ PPO loss and KL

# (ratio, advantage) pairs, ε = 0.2; expected per-pair loss max(−Aρ, −A·clip(ρ)) by hand:
PAIRS = [
    (1.0, 1.0, -1.0),  # on-policy
    (1.5, 1.0, -1.2),  # A > 0, ρ above 1+ε: clipped
    (0.5, -1.0, 0.8),  # A < 0, ρ below 1−ε: clipped
    (1.1, -1.0, 1.1),  # inside the trust region
    (1.5, -1.0, 1.5),  # A < 0, ρ above: unclipped (pessimistic side)
    (0.5, 1.0, -0.5),  # A > 0, ρ below: unclipped
]


def _ppo_inputs():
  ratio = jnp.array([[p[0] for p in PAIRS]])
  adv = jnp.array([p[1] for p in PAIRS])
  logp_old = jnp.array([[-3.0, -2.0, -1.0, -0.5, 0.0, 1.0]])
  return logp_old + jnp.log(ratio), logp_old, adv


def test_ppo_clip_loss_hand_values_and_grad():
  logp_new, logp_old, adv = _ppo_inputs()
  val, m = loss.ppo_clip_loss(logp_new, logp_old, adv, 0.2)
  per = np.array([p[2] for p in PAIRS])
  np.testing.assert_allclose(float(val), per.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m["clip_frac"]), 4 / 6, rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_mean"]), 6.1 / 6, rtol=1e-6)
  lr = np.log([p[0] for p in PAIRS])
  np.testing.assert_allclose(float(m["approx_kl"]), 0.5 * np.mean(lr**2), rtol=1e-5)
  np.testing.assert_allclose(float(m["ratio_max_dev"]), 0.5, rtol=1e-6)
  # gradient: −A·ρ/n where the unclipped branch is active, 0 where clipping holds it constant
  g = jax.grad(lambda lp: loss.ppo_clip_loss(lp, logp_old, adv, 0.2)[0])(logp_new)
  expected = np.array([-1.0, 0.0, 0.0, 1.1, 1.5, -0.5]) / 6
  np.testing.assert_allclose(np.asarray(g[0]), expected, rtol=1e-5, atol=1e-7)
  # no gradient into the behaviour log-probs
  g_old = jax.grad(lambda lo: loss.ppo_clip_loss(logp_new, lo, adv, 0.2)[0])(logp_old)
  np.testing.assert_array_equal(np.asarray(g_old), 0.0)


def test_ppo_clip_loss_weights_and_denominator():
  logp_new, logp_old, adv = _ppo_inputs()
  per = np.array([p[2] for p in PAIRS])
  valid = jnp.array([True, True, True, True, False, False])
  val, m = loss.ppo_clip_loss(logp_new, logp_old, adv, 0.2, valid)
  np.testing.assert_allclose(float(val), per[:4].mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m["clip_frac"]), 2 / 4, rtol=1e-6)
  val_d, _ = loss.ppo_clip_loss(logp_new, logp_old, adv, 0.2, valid, denominator=12.0)
  np.testing.assert_allclose(float(val_d), per[:4].sum() / 12, rtol=1e-6)
  # [K, B] weights: two timesteps, the second masked out
  w = jnp.array([[1.0] * 6, [0.0] * 6])
  val_k, m_k = loss.ppo_clip_loss(
      jnp.concatenate([logp_new, logp_old]), jnp.concatenate([logp_old, logp_old]), adv, 0.2, w
  )
  np.testing.assert_allclose(float(val_k), per.mean(), rtol=1e-6)
  assert float(m_k["weight_sum"]) == 6.0
  # all weights zero: loss 0, not NaN
  z, _ = loss.ppo_clip_loss(logp_new, logp_old, adv, 0.2, jnp.zeros(6))
  assert float(z) == 0.0
  with pytest.raises(ValueError, match="adv"):
    loss.ppo_clip_loss(logp_new, logp_old, adv[:3], 0.2)


def test_gaussian_kl_hand_and_monte_carlo():
  mt = jnp.full((2, 4, 3), 0.3)
  mr = jnp.zeros((2, 4, 3))
  std = jnp.array([0.5, 0.0])
  kl_mean = loss.gaussian_kl(mt, mr, std, "mean")
  kl_sum = loss.gaussian_kl(mt, mr, std, "sum")
  np.testing.assert_allclose(np.asarray(kl_mean), [0.09 / (2 * 0.25), 0.0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(kl_sum), [12 * 0.09 / (2 * 0.25), 0.0], rtol=1e-6)
  # Monte Carlo: E_{x~N(μθ,s²)}[log pθ(x) − log pref(x)] with the same log-density as the sampler
  k = jax.random.key(0)
  mt = jax.random.normal(k, (1, 8, 3))
  mr = mt + 0.2 * jax.random.normal(jax.random.key(1), (1, 8, 3))
  s = jnp.array([0.4])
  x = mt + s[:, None, None] * jax.random.normal(jax.random.key(2), (20000, 8, 3))
  lp_t = sde.gaussian_log_prob(x, jnp.broadcast_to(mt, x.shape), jnp.full((20000,), 0.4), "sum")
  lp_r = sde.gaussian_log_prob(x, jnp.broadcast_to(mr, x.shape), jnp.full((20000,), 0.4), "sum")
  mc = float(jnp.mean(lp_t - lp_r))
  exact = float(loss.gaussian_kl(mt, mr, s, "sum")[0])
  assert abs(mc - exact) < 0.05 * exact + 0.02, (mc, exact)


# ------------------------------------------------------------------ timestep selection


def test_timestep_selection_kinds():
  T_ = 10
  sel = timesteps.TimestepSelection("all_but_last")
  assert timesteps.num_selected(sel, T_) == 9
  np.testing.assert_array_equal(
      np.asarray(timesteps.select_timesteps(sel, T_, None, 0)), np.arange(9)
  )
  np.testing.assert_array_equal(np.asarray(timesteps.sde_step_mask(sel, T_, 0)), np.arange(10) < 9)

  sel = timesteps.TimestepSelection("random_fraction", fraction=0.3)
  assert timesteps.num_selected(sel, T_) == 2  # ⌊0.3·9⌋
  f = jax.jit(lambda key: timesteps.select_timesteps(sel, T_, key, 0))
  draws = {tuple(np.asarray(f(jax.random.key(i)))) for i in range(20)}
  assert len(draws) > 3
  for d in draws:
    assert len(set(d)) == 2 and all(0 <= i < 9 for i in d) and list(d) == sorted(d)
  assert (
      timesteps.num_selected(timesteps.TimestepSelection("random_fraction", fraction=1.0), T_) == 9
  )
  assert (
      timesteps.num_selected(timesteps.TimestepSelection("random_fraction", fraction=0.01), T_) == 1
  )

  sel = timesteps.TimestepSelection("fixed_window", window_start=2, window_size=3)
  np.testing.assert_array_equal(np.asarray(timesteps.select_timesteps(sel, T_, None, 5)), [2, 3, 4])
  np.testing.assert_array_equal(
      np.asarray(timesteps.sde_step_mask(sel, T_, 5)), [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
  )


def test_sliding_window_moves_and_wraps_under_jit():
  sel = timesteps.TimestepSelection("sliding_window", window_start=0, window_size=3, slide_every=2)
  T_ = 6  # trainable steps 0..4, window of 3 -> starts 0, 1, 2
  idx = jax.jit(lambda step: timesteps.select_timesteps(sel, T_, None, step))
  mask = jax.jit(lambda step: timesteps.sde_step_mask(sel, T_, step))
  starts = [int(idx(jnp.int32(s))[0]) for s in range(8)]
  assert starts == [0, 0, 1, 1, 2, 2, 0, 0]
  np.testing.assert_array_equal(np.asarray(idx(jnp.int32(4))), [2, 3, 4])
  np.testing.assert_array_equal(np.asarray(mask(jnp.int32(4))), [0, 0, 1, 1, 1, 0])


def test_timestep_selection_validation():
  with pytest.raises(ValueError, match="does not fit"):
    timesteps.num_selected(
        timesteps.TimestepSelection("fixed_window", window_start=8, window_size=3), 10
    )
  with pytest.raises(ValueError, match="kind"):
    timesteps.TimestepSelection("every_other")
  with pytest.raises(ValueError, match="fraction"):
    timesteps.TimestepSelection("random_fraction", fraction=0.0)
  with pytest.raises(ValueError, match="T >= 2"):
    timesteps.num_selected(timesteps.TimestepSelection(), 1)


# ------------------------------------------------------------------ the objective and the ratio test

VARIANTS = [
    dict(guidance_scale=None, norm_rescale=False),
    dict(guidance_scale=4.0, norm_rescale=False),
    dict(guidance_scale=4.0, norm_rescale=True),
]


def _rollout(kind, guidance_scale, norm_rescale, reduce="mean", sde_steps=None, key=3):
  uncond = toy_cond(2) if guidance_scale is not None else None
  steps = np.arange(T) < T - 1 if sde_steps is None else sde_steps
  tr = sampler.sample_jit(
      toy_velocity,
      toy_params(),
      toy_cond(1),
      SIGMAS,
      jax.random.key(key),
      latent_shape=(B, N, C),
      sde_cfg=sde.SDEConfig(kind=kind, logprob_reduce=reduce),
      sde_steps=steps,
      guidance_scale=guidance_scale,
      uncond=uncond,
      norm_rescale=norm_rescale,
  )
  return tr, uncond


_objective_jit = jax.jit(
    objective.grpo_objective,
    static_argnames=(
        "velocity_fn",
        "sde_cfg",
        "clip_range",
        "kl_beta",
        "norm_rescale",
        "step_loop",
    ),
)
_logps_jit = jax.jit(
    objective.step_log_probs,
    static_argnames=("velocity_fn", "sde_cfg", "norm_rescale", "step_loop"),
)


def _assert_ratio_one(kind, variant, reduce, step_loops):
  v = VARIANTS[variant]
  tr, uncond = _rollout(kind, v["guidance_scale"], v["norm_rescale"], reduce)
  # stochastic steps really carry a log-prob (the last step is Euler)
  assert np.all(np.asarray(tr.log_probs[: T - 1]) != 0.0)
  cfg = sde.SDEConfig(kind=kind, logprob_reduce=reduce)
  for step_loop in step_loops:
    logp_new, _, _ = _logps_jit(
        toy_velocity,
        toy_params(),
        tr,
        toy_cond(1),
        jnp.arange(T, dtype=jnp.int32),
        sde_cfg=cfg,
        guidance_scale=v["guidance_scale"],
        uncond=uncond,
        norm_rescale=v["norm_rescale"],
        step_loop=step_loop,
    )
    dlogp = np.asarray(logp_new, np.float64) - np.asarray(tr.log_probs, np.float64)
    if reduce == "sum":
      # The sum is D × the per-element mean, and so is its float32 rounding: hold the
      # per-element log-density to the same 1e-5 (vmap evaluates v on a K·B batch, whose
      # matmuls round differently in the last bit from the rollout's B batch).
      dlogp = dlogp / (N * C)
    ratio = np.exp(dlogp)
    assert np.abs(ratio - 1).max() <= 1e-5, (step_loop, np.abs(ratio - 1).max())
  return tr, uncond, cfg


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_ratio_is_one_before_any_update(kind, variant):
  """THE ratio test: recomputing the stored trajectory's log-probs with unchanged params through
  the training path (vmap and scan over steps) gives exp(logp_new − logp_old) = 1 within 1e-5
  at every step of every sample; the objective then sees ρ = 1 and loss −mean_valid(A)."""
  tr, uncond, cfg = _assert_ratio_one(kind, variant, "mean", ("vmap", "scan"))
  v = VARIANTS[variant]
  adv = jnp.array([1.0, -0.5, 0.25, -2.0])
  valid = jnp.array([True, True, True, False])
  val, m = _objective_jit(
      toy_velocity,
      toy_params(),
      tr,
      toy_cond(1),
      adv,
      valid,
      jnp.arange(T - 1, dtype=jnp.int32),
      sde_cfg=cfg,
      clip_range=1e-4,
      guidance_scale=v["guidance_scale"],
      uncond=uncond,
      norm_rescale=v["norm_rescale"],
  )
  assert float(m["ratio_max_dev"]) <= 1e-5
  assert float(m["clip_frac"]) == 0.0
  np.testing.assert_allclose(float(val), -(1.0 - 0.5 + 0.25) / 3, rtol=1e-4)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_ratio_is_one_with_sum_reduce(kind):
  _assert_ratio_one(kind, 2, "sum", ("vmap",))


def test_ratio_one_with_sde_window_and_changed_params_moves_it():
  mask = np.array([False, True, True, False, False, False])
  tr, _ = _rollout("flow_grpo", None, False, sde_steps=mask)
  cfg = sde.SDEConfig()
  logp, _, _ = _logps_jit(toy_velocity, toy_params(), tr, toy_cond(1), jnp.arange(T), sde_cfg=cfg)
  assert np.abs(np.exp(np.asarray(logp) - np.asarray(tr.log_probs)) - 1).max() <= 1e-5
  np.testing.assert_array_equal(np.asarray(logp)[~mask], 0.0)
  # a different policy gives a different log-prob (the test above can fail)
  other = jax.tree_util.tree_map(lambda a: a * 1.05, toy_params())
  logp2, _, _ = _logps_jit(toy_velocity, other, tr, toy_cond(1), jnp.arange(T), sde_cfg=cfg)
  assert np.abs(np.asarray(logp2) - np.asarray(logp))[mask].max() > 1e-3


def test_sum_vs_mean_reduce_differ_by_latent_size():
  tr_mean, _ = _rollout("flow_grpo", 4.0, True, "mean")
  tr_sum, _ = _rollout("flow_grpo", 4.0, True, "sum")
  # the reduction does not change sampling
  np.testing.assert_array_equal(np.asarray(tr_mean.latents), np.asarray(tr_sum.latents))
  np.testing.assert_allclose(
      np.asarray(tr_sum.log_probs), N * C * np.asarray(tr_mean.log_probs), rtol=1e-5, atol=1e-5
  )
  x, v = jnp.asarray(tr_mean.latents[1]), toy_velocity(
      toy_params(), tr_mean.latents[1], jnp.full((B,), SIGMAS[1]), toy_cond(1)
  )
  for kind in ("flow_grpo", "dance", "cps"):
    lm = sde.sde_log_prob(tr_mean.latents[2], x, v, SIGMAS[1], SIGMAS[2], sde.SDEConfig(kind=kind))
    ls = sde.sde_log_prob(
        tr_mean.latents[2],
        x,
        v,
        SIGMAS[1],
        SIGMAS[2],
        sde.SDEConfig(kind=kind, logprob_reduce="sum"),
    )
    np.testing.assert_allclose(np.asarray(ls), N * C * np.asarray(lm), rtol=1e-5)


def test_objective_gradient_finite_and_vmap_equals_scan():
  tr, uncond = _rollout("flow_grpo", 4.0, True)
  adv, valid = advantages.grpo_advantages(jnp.array([0.1, 0.9, 0.3, 0.3]), 2)
  ref = toy_params(0)
  params = jax.tree_util.tree_map(lambda a: a + 0.01, toy_params(0))  # as after an update
  sel = jnp.array([0, 2, 4], jnp.int32)
  kw = dict(
      sde_cfg=sde.SDEConfig(),
      clip_range=0.2,
      kl_beta=0.5,
      ref_params=ref,
      guidance_scale=4.0,
      uncond=uncond,
      norm_rescale=True,
  )
  grads = {}
  for step_loop in ("vmap", "scan"):
    f = jax.jit(
        jax.value_and_grad(
            lambda p: objective.grpo_objective(
                toy_velocity, p, tr, toy_cond(1), adv, valid, sel, step_loop=step_loop, **kw
            ),
            has_aux=True,
        )
    )
    (val, m), g = f(params)
    leaves = jax.tree_util.tree_leaves(g)
    assert all(np.all(np.isfinite(np.asarray(l))) for l in leaves)
    assert sum(float(jnp.abs(l).sum()) for l in leaves) > 0
    assert float(m["kl"]) > 0 and np.isfinite(float(val))
    grads[step_loop] = (float(val), g)
  assert grads["vmap"][0] == pytest.approx(grads["scan"][0], rel=1e-5, abs=1e-6)
  for a, b in zip(
      jax.tree_util.tree_leaves(grads["vmap"][1]), jax.tree_util.tree_leaves(grads["scan"][1])
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  # the KL term is zero when params == ref, and its gradient then vanishes
  _, m0 = jax.jit(
      lambda p: objective.grpo_objective(toy_velocity, p, tr, toy_cond(1), adv, valid, sel, **kw)
  )(ref)
  assert abs(float(m0["kl"])) < 1e-10
  with pytest.raises(ValueError, match="ref_params"):
    objective.grpo_objective(
        toy_velocity,
        ref,
        tr,
        toy_cond(1),
        adv,
        valid,
        sel,
        sde_cfg=sde.SDEConfig(),
        clip_range=0.2,
        kl_beta=0.1,
    )


def test_fragment_losses_sum_to_full_batch_with_global_denominator():
  """GAP accumulates per-fragment gradients; with the logical batch's weight as denominator the
  fragment losses add up to the full-batch loss."""
  tr, _ = _rollout("dance", None, False)
  params = jax.tree_util.tree_map(lambda a: a * 1.02, toy_params())
  adv = jnp.array([1.0, -1.0, 0.5, -0.5])
  valid = jnp.array([True, True, True, True])
  sel = jnp.arange(T - 1, dtype=jnp.int32)
  kw = dict(sde_cfg=sde.SDEConfig(kind="dance"), clip_range=0.2)
  obj = jax.jit(functools.partial(objective.grpo_objective, toy_velocity, **kw))
  full, _ = obj(params, tr, toy_cond(1), adv, valid, sel)
  den = float(B * (T - 1))
  parts = 0.0
  for lo in (0, 2):
    frag = jax.tree_util.tree_map(lambda a: a, tr).replace(
        latents=tr.latents[:, lo : lo + 2],
        log_probs=tr.log_probs[:, lo : lo + 2],
        stds=tr.stds[:, lo : lo + 2],
    )
    cond = jax.tree_util.tree_map(lambda a: a[lo : lo + 2], toy_cond(1))
    part, _ = obj(params, frag, cond, adv[lo : lo + 2], valid[lo : lo + 2], sel, denominator=den)
    parts += float(part)
  assert parts == pytest.approx(float(full), rel=1e-5, abs=1e-7)
