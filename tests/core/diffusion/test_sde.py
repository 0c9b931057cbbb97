"""digen_jax.diffusion.sde: Euler vs diffusers, SDE means/stds vs float64 references, log-probs, CFG."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import sigmas as sigmas_lib, sde

B, N, C = 3, 5, 4


def _rand(seed, shape=(B, N, C)):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _ref_mean_std(x, v, s, sn, kind, a):
  """float64 references written from the papers' formulas (not from our code)."""
  x, v = x.astype(np.float64), v.astype(np.float64)
  s, sn = float(s), float(sn)
  dt = sn - s
  if kind == "flow_grpo":
    std_t = a * math.sqrt(s / (1 - (sn if s == 1 else s)))
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_t * math.sqrt(-dt)
  if kind == "dance":
    # DanceGRPO flux_step(sde_solver=True): Euler mean plus the score correction.
    x0 = x - s * v
    score = -(x - x0 * (1 - s)) / s**2
    mean = x + dt * v + (-0.5 * a**2 * score) * dt
    return mean, a * math.sqrt(s - sn)
  # cps
  std = sn * math.sin(a * math.pi / 2)
  x0 = x - s * v
  eps = x + v * (1 - s)
  return x0 * (1 - sn) + eps * math.sqrt(sn**2 - std**2), std


def _ref_logp(xn, mean, std, reduce):
  lp = (
      -((xn.astype(np.float64) - mean) ** 2) / (2 * std**2)
      - math.log(std)
      - 0.5 * math.log(2 * math.pi)
  )
  return (
      lp.reshape(lp.shape[0], -1).mean(1)
      if reduce == "mean"
      else lp.reshape(lp.shape[0], -1).sum(1)
  )


@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_euler_step_matches_diffusers_step(num_steps):
  import torch  # a missing test dependency must fail, not skip
  from diffusers import FlowMatchEulerDiscreteScheduler

  cfg = sigmas_lib.qwenimage_scheduler_config()
  sig = sigmas_lib.sigmas(
      dataclasses.replace(cfg, shift_terminal=None), num_steps, image_seq_len=1024
  )
  sched = FlowMatchEulerDiscreteScheduler(
      base_shift=cfg.base_shift,
      max_shift=cfg.max_shift,
      base_image_seq_len=cfg.base_image_seq_len,
      max_image_seq_len=cfg.max_image_seq_len,
      use_dynamic_shifting=True,
  )
  mu = sigmas_lib.calculate_shift(1024, cfg)
  sched.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
  np.testing.assert_array_equal(sched.sigmas.numpy(), sig)
  x = _rand(0)
  xt = torch.from_numpy(x.copy())
  for i, t in enumerate(sched.timesteps):
    v = _rand(100 + i)
    ref = sched.step(torch.from_numpy(v), t, xt, return_dict=False)[0]
    x = np.asarray(sde.euler_step(x, v, sig[i], sig[i + 1]))
    np.testing.assert_allclose(x, ref.numpy(), rtol=0, atol=1e-6)
    xt = ref


SIGMA_PAIRS = [(1.0, 0.9), (0.9, 0.7), (0.5, 0.45), (0.2, 0.05), (0.3, 0.0)]


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("pair", SIGMA_PAIRS)
@pytest.mark.parametrize("a", [0.3, 0.7, 1.0])
def test_mean_std_match_reference(kind, pair, a):
  s, sn = pair
  x, v = _rand(1), _rand(2)
  cfg = sde.SDEConfig(kind=kind, noise_level=a)
  mean, std = sde.sde_mean_std(x, v, s, sn, cfg)
  ref_mean, ref_std = _ref_mean_std(x, v, s, sn, kind, a)
  assert mean.dtype == jnp.float32 and std.shape == (B,)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(np.asarray(std), np.full(B, ref_std), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_step_and_log_prob_match_reference(kind, reduce):
  s, sn = 0.6, 0.45
  x, v, eps = _rand(3), _rand(4), _rand(5)
  cfg = sde.SDEConfig(kind=kind, logprob_reduce=reduce)
  x_next, logp, mean, std = sde.sde_step(x, v, s, sn, eps, cfg)
  ref_mean, ref_std = _ref_mean_std(x, v, s, sn, kind, cfg.noise_level)
  np.testing.assert_allclose(np.asarray(x_next), ref_mean + ref_std * eps, rtol=1e-5, atol=1e-6)
  ref_lp = _ref_logp(np.asarray(x_next), ref_mean, ref_std, reduce)
  np.testing.assert_allclose(np.asarray(logp), ref_lp, rtol=1e-5, atol=1e-5)
  # the rollout's log-prob is sde_log_prob of the produced sample
  np.testing.assert_array_equal(
      np.asarray(logp), np.asarray(sde.sde_log_prob(x_next, x, v, s, sn, cfg))
  )


def test_dance_is_flow_grpo_drift_with_constant_std_t():
  """Documented identity: DanceGRPO's mean == Flow-GRPO's drift formula with std_t := a."""
  x, v = _rand(6), _rand(7)
  s, sn, a = 0.7, 0.55, 0.4
  mean, std = sde.sde_mean_std(x, v, s, sn, sde.SDEConfig(kind="dance", noise_level=a))
  dt = sn - s
  alt = x * (1 + a**2 / (2 * s) * dt) + v * (1 + a**2 * (1 - s) / (2 * s)) * dt
  np.testing.assert_allclose(np.asarray(mean), alt, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(std), a * math.sqrt(-dt), rtol=1e-6)


def test_sigma_one_uses_next_sigma():
  x, v = _rand(8), _rand(9)
  _, std = sde.sde_mean_std(x, v, 1.0, 0.8, sde.SDEConfig(kind="flow_grpo", noise_level=0.7))
  expected = 0.7 * math.sqrt(1.0 / (1 - 0.8)) * math.sqrt(0.2)
  np.testing.assert_allclose(np.asarray(std), expected, rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(std)))


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_last_step_no_nan(kind):
  x, v, eps = _rand(10), _rand(11), _rand(12)
  cfg = sde.SDEConfig(kind=kind)
  x_next, logp, mean, std = sde.sde_step(x, v, 0.1, 0.0, eps, cfg)
  for a in (x_next, logp, mean, std):
    assert np.all(np.isfinite(np.asarray(a)))
  g = jax.grad(lambda vv: jnp.sum(sde.sde_log_prob(x_next, x, vv, 0.1, 0.0, cfg)))(jnp.asarray(v))
  assert np.all(np.isfinite(np.asarray(g)))
  if kind == "cps":
    # Zero std: deterministic step to x0_pred (= the Euler step) and log-prob 0, zero gradient.
    np.testing.assert_array_equal(np.asarray(std), 0.0)
    np.testing.assert_allclose(np.asarray(x_next), x - 0.1 * v, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(logp), 0.0)
    np.testing.assert_array_equal(np.asarray(g), 0.0)
  else:
    # flow_grpo/dance keep noise on the σ_next = 0 step (std_t·sqrt(σ)).
    assert np.all(np.asarray(std) > 0)


def test_zero_noise_level_is_euler():
  x, v, eps = _rand(13), _rand(14), _rand(15)
  for kind in ("flow_grpo", "dance", "cps"):
    x_next, logp, _, std = sde.sde_step(
        x, v, 0.8, 0.6, eps, sde.SDEConfig(kind=kind, noise_level=0.0)
    )
    np.testing.assert_allclose(
        np.asarray(x_next), np.asarray(sde.euler_step(x, v, 0.8, 0.6)), atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(logp), 0.0)
    np.testing.assert_array_equal(np.asarray(std), 0.0)


def test_per_sample_sigmas():
  x, v, eps = _rand(16), _rand(17), _rand(18)
  s = np.array([0.9, 0.5, 0.3], np.float32)
  sn = np.array([0.8, 0.4, 0.1], np.float32)
  cfg = sde.SDEConfig()
  x_next, logp, _, std = sde.sde_step(x, v, s, sn, eps, cfg)
  for b in range(B):
    xb, lb, _, sb = sde.sde_step(x[b : b + 1], v[b : b + 1], s[b], sn[b], eps[b : b + 1], cfg)
    np.testing.assert_allclose(np.asarray(x_next[b]), np.asarray(xb[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(logp[b]), np.asarray(lb[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(std[b]), np.asarray(sb[0]), atol=1e-7)
  with pytest.raises(ValueError, match="sigma"):
    sde.sde_mean_std(x, v, np.ones(2, np.float32), 0.5, cfg)


def test_config_validation():
  with pytest.raises(ValueError, match="kind"):
    sde.SDEConfig(kind="ddim")
  with pytest.raises(ValueError, match="logprob_reduce"):
    sde.SDEConfig(logprob_reduce="max")
  with pytest.raises(ValueError, match="noise_level"):
    sde.SDEConfig(noise_level=-0.1)
  with pytest.raises(ValueError, match="cps"):
    sde.SDEConfig(kind="cps", noise_level=1.5)


# ---------------------------------------------------------------- CFG


def _toy_velocity(calls):
  def fn(params, x, sigma, cond):
    calls.append(x.shape[0])
    h = jnp.tanh(x @ params["w"] + sigma[:, None, None] + cond["emb"][:, None, :])
    return h @ params["w2"]

  return fn


def _toy_params():
  r = np.random.default_rng(0)
  return {
      "w": jnp.asarray(r.standard_normal((C, 6)), jnp.float32),
      "w2": jnp.asarray(r.standard_normal((6, C)), jnp.float32),
  }


def test_cfg_velocity_single_batched_call_and_formula():
  calls = []
  fn = _toy_velocity(calls)
  p = _toy_params()
  x = jnp.asarray(_rand(20))
  sig = jnp.asarray([0.9, 0.5, 0.2], jnp.float32)
  cond = {"emb": jnp.asarray(_rand(21, (B, 6)))}
  uncond = {"emb": jnp.asarray(_rand(22, (B, 6)))}
  v = sde.cfg_velocity(fn, p, x, sig, cond, uncond, 4.5, False)
  assert calls == [2 * B]
  vc = np.asarray(fn(p, x, sig, cond), np.float64)
  vu = np.asarray(fn(p, x, sig, uncond), np.float64)
  np.testing.assert_allclose(np.asarray(v), vu + 4.5 * (vc - vu), rtol=1e-5, atol=1e-5)

  # QwenImage true-CFG rescale: comb·‖cond‖/‖comb‖ over the last dim.
  vr = sde.cfg_velocity(fn, p, x, sig, cond, uncond, 4.5, True)
  comb = vu + 4.5 * (vc - vu)
  ref = comb * (
      np.linalg.norm(vc, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True)
  )
  np.testing.assert_allclose(np.asarray(vr), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      np.linalg.norm(np.asarray(vr), axis=-1), np.linalg.norm(vc, axis=-1), rtol=1e-5
  )

  # no guidance: plain conditional velocity
  np.testing.assert_allclose(
      np.asarray(sde.cfg_velocity(fn, p, x, sig, cond)), vc, rtol=1e-6, atol=1e-6
  )
  with pytest.raises(ValueError, match="uncond"):
    sde.cfg_velocity(fn, p, x, sig, cond, None, 3.0)


def test_cfg_norm_rescale_zero_vector_finite():
  def zero_fn(params, x, sigma, cond):
    return jnp.zeros_like(x) * params

  x = jnp.asarray(_rand(23))
  cond = {"e": jnp.zeros((B, 1))}
  f = lambda p: jnp.sum(sde.cfg_velocity(zero_fn, p, x, 0.5, cond, cond, 3.0, True))
  assert np.isfinite(float(f(1.0)))
  assert np.isfinite(float(jax.grad(f)(1.0)))
