"""digen_jax.rl.awm (Advantage Weighted Matching) against a direct per-sample, per-level numpy
transcription of the published loss: the weighted matching log-likelihood, the advantage rescale,
the per-pair PPO ratio clip, the velocity KLs, their gradient through a tiny linear model,
fragment denominators, masks, the on-policy update's sign, and the stratified noise levels."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.rl import awm, nft

K, B, N, C = 3, 4, 5, 3
P = 0.25


# ------------------------------------------------------------------ direct references (float64)


def ref_rho(mse, t, weighting, p=P):
  """(ρ(mse, t), dρ/dmse): logp = −ρ (the official compute_log_prob_awm)."""
  e = 1e-10
  if weighting == "Uniform":
    return mse, 1.0
  if weighting == "t":
    return t * mse, t
  if weighting == "t**2":
    return t * t * mse, t * t
  if weighting == "huber":
    return t * (math.sqrt(mse + e) - 1e-5), t * 0.5 / math.sqrt(mse + e)
  return t * ((mse + e) ** p - e**p) / p, t * (mse + e) ** (p - 1)


def ref_adv(a, m, amax):
  a = min(max(float(a), -m), m)
  return a if amax is None else a / m * amax


def ref_awm(
    v, x0, eps, t, adv, w, *, weighting, clip, m=5.0, amax=1.0, logp_old=None, v_ref=None,
    v_ema=None, kl=0.0, ema_kl=0.0, den=None,
):  # fmt: skip
  """(loss, dloss/dv, per-pair logp), loop over (level, sample)."""
  v, x0, eps, t, w = (np.asarray(x, np.float64) for x in (v, x0, eps, t, w))
  den = w.sum() if den is None else den
  total, grad, logps = 0.0, np.zeros_like(v), np.zeros(t.shape)
  for k in range(v.shape[0]):
    for b in range(v.shape[1]):
      u = eps[k, b] - x0[b]
      d = u.size
      mse = np.mean((v[k, b] - u) ** 2)
      rho, drho = ref_rho(mse, t[k, b], weighting)
      logp = -rho
      logps[k, b] = logp
      old = logp if logp_old is None else float(logp_old[k, b])
      ratio = math.exp(logp - old)
      a = ref_adv(adv[b], m, amax)
      unclipped = -a * ratio
      clipped = -a * min(max(ratio, 1 - clip), 1 + clip)
      ell = max(unclipped, clipped)
      dlogp = -drho * 2 * (v[k, b] - u) / d
      # The clipped branch is constant in v; the unclipped one has d(−a·ρ)/dv = −a·ρ·dlogp/dv.
      g = -a * ratio * dlogp if unclipped >= clipped else np.zeros_like(dlogp)
      if v_ref is not None:
        ell += kl * np.mean((v[k, b] - v_ref[k, b]) ** 2)
        g = g + kl * 2 * (v[k, b] - v_ref[k, b]) / d
      if v_ema is not None:
        ell += ema_kl * np.mean((v[k, b] - v_ema[k, b]) ** 2)
        g = g + ema_kl * 2 * (v[k, b] - v_ema[k, b]) / d
      total += w[k, b] * ell
      grad[k, b] = w[k, b] * g / den
  return total / den, grad, logps


# ------------------------------------------------------------------ fixtures


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x0 = rng.normal(size=(B, N, C)).astype(np.float32)
  eps = rng.normal(size=(K, B, N, C)).astype(np.float32)
  t = rng.uniform(0.05, 0.95, size=(K, B)).astype(np.float32)
  xt = np.asarray(nft.forward_noise(x0, t, eps))
  adv = np.array([2.0, -1.0, 7.0, -0.4], np.float32)
  return rng, x0, eps, t, xt, adv


def _linear(p, x):
  return jnp.einsum("...nc,cd->...nd", x, p["w"]) + p["b"]


def _params(rng, scale=0.3):
  return {
      "w": jnp.asarray(np.eye(C) * 0.5 + scale * rng.normal(size=(C, C)), jnp.float32),
      "b": jnp.asarray(scale * rng.normal(size=(C,)), jnp.float32),
  }


# ------------------------------------------------------------------ log-prob and advantages


@pytest.mark.parametrize("weighting", awm.WEIGHTINGS)
def test_awm_log_prob_matches_reference(weighting):
  rng, x0, eps, t, _, adv = _data(1)
  v = eps - x0[None] + 0.6 * rng.normal(size=eps.shape).astype(np.float32)
  got = np.asarray(awm.awm_log_prob(v, x0, eps, t, weighting=weighting, ghuber_power=P))
  _, _, want = ref_awm(v, x0, eps, t, adv, np.ones((K, B)), weighting=weighting, clip=1.0)
  assert got.shape == (K, B) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  assert np.all(got <= 0), "a matching loss as log-likelihood is never positive"


def test_scale_advantages():
  a = np.array([-9.0, -5.0, -1.0, 0.0, 2.5, 5.0, 11.0], np.float32)
  np.testing.assert_allclose(
      np.asarray(awm.scale_advantages(a, 5.0, 1.0)), [-1, -1, -0.2, 0, 0.5, 1, 1]
  )
  np.testing.assert_allclose(
      np.asarray(awm.scale_advantages(a, 5.0, None)), [-5, -5, -1, 0, 2.5, 5, 5]
  )
  np.testing.assert_allclose(
      np.asarray(awm.scale_advantages(a, 1.0, 1.0)), [-1, -1, -1, 0, 1, 1, 1]
  )
  with pytest.raises(ValueError, match="adv_clip_max"):
    awm.scale_advantages(a, 0.0)
  with pytest.raises(ValueError, match="advantage_max"):
    awm.scale_advantages(a, 5.0, -1.0)


# ------------------------------------------------------------------ the loss


def _off_policy_case(seed, weighting="ghuber"):
  rng, x0, eps, t, xt, adv = _data(seed)
  v = eps - x0[None] + 0.6 * rng.normal(size=eps.shape).astype(np.float32)
  logp = np.asarray(awm.awm_log_prob(v, x0, eps, t, weighting=weighting, ghuber_power=P))
  # Old log-probs off by up to ±0.15: with clip_range 0.05 both clip sides and the inside occur.
  logp_old = (logp + rng.uniform(-0.15, 0.15, size=logp.shape)).astype(np.float32)
  return rng, x0, eps, t, xt, adv, v, logp_old


@pytest.mark.parametrize("weighting", awm.WEIGHTINGS)
@pytest.mark.parametrize("weights_kind", ["none", "mask_b", "kb"])
def test_awm_loss_matches_reference(weighting, weights_kind):
  rng, x0, eps, t, _, adv, v, logp_old = _off_policy_case(2, weighting)
  v_ref = v + 0.3 * rng.normal(size=v.shape).astype(np.float32)
  v_ema = v + 0.2 * rng.normal(size=v.shape).astype(np.float32)
  w_in = {
      "none": None,
      "mask_b": np.array([True, True, False, True]),
      "kb": rng.uniform(0.0, 2.0, size=(K, B)).astype(np.float32),
  }[weights_kind]
  w = np.ones((K, B)) if w_in is None else np.broadcast_to(np.asarray(w_in, np.float64), (K, B))
  kw = dict(weighting=weighting, ghuber_power=P, clip_range=0.05, adv_clip_max=5.0)
  loss, m = awm.awm_loss(
      v, x0, eps, t, adv, w_in, logp_old=logp_old, v_ref=v_ref, v_ema=v_ema, kl_beta=0.01,
      ema_kl_beta=0.5, **kw,
  )  # fmt: skip
  want, _, logp = ref_awm(
      v, x0, eps, t, adv, w, weighting=weighting, clip=0.05, logp_old=logp_old, v_ref=v_ref,
      v_ema=v_ema, kl=0.01, ema_kl=0.5,
  )  # fmt: skip
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(float(m["loss"]), want, rtol=2e-5, atol=1e-7)
  pol, _, _ = ref_awm(v, x0, eps, t, adv, w, weighting=weighting, clip=0.05, logp_old=logp_old)
  np.testing.assert_allclose(float(m["policy_loss"]), pol, rtol=2e-5, atol=1e-7)
  pair = lambda a, b: ((a - b) ** 2).mean(axis=(2, 3))
  np.testing.assert_allclose(float(m["kl_div"]), (w * pair(v, v_ref)).sum() / w.sum(), rtol=2e-5)
  np.testing.assert_allclose(
      float(m["ema_kl_div"]), (w * pair(v, v_ema)).sum() / w.sum(), rtol=2e-5
  )
  np.testing.assert_allclose(
      float(m["mse"]), (w * pair(v, eps - x0[None])).sum() / w.sum(), rtol=2e-5
  )
  np.testing.assert_allclose(float(m["logp"]), (w * logp).sum() / w.sum(), rtol=2e-5)
  ratio = np.exp(logp - logp_old)
  np.testing.assert_allclose(float(m["ratio_mean"]), (w * ratio).sum() / w.sum(), rtol=2e-5)
  clipped = (np.abs(ratio - 1) > 0.05).astype(np.float64)
  np.testing.assert_allclose(float(m["clip_frac"]), (w * clipped).sum() / w.sum(), rtol=1e-5)
  if weights_kind == "none":
    assert 0 < float(m["clip_frac"]) < 1, "the case must exercise both clipped and unclipped pairs"
  assert all(np.shape(x) == () for x in m.values())


@pytest.mark.parametrize("on_policy", [True, False])
def test_awm_grad_through_linear_model_matches_reference(on_policy):
  rng, x0, eps, t, xt, adv = _data(3)
  p, p_ref, p_ema, p_old = (_params(rng) for _ in range(4))
  v_ref, v_ema = _linear(p_ref, xt), _linear(p_ema, xt)
  w = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
  kw = dict(weighting="ghuber", ghuber_power=P, clip_range=0.2, kl_beta=0.01, ema_kl_beta=0.5)
  logp_old = None
  if not on_policy:
    logp_old = awm.awm_log_prob(_linear(p_old, xt), x0, eps, t, weighting="ghuber", ghuber_power=P)

  @jax.jit
  def f(params):
    v = _linear(params, xt)
    return awm.awm_loss(v, x0, eps, t, adv, w, logp_old=logp_old, v_ref=v_ref, v_ema=v_ema, **kw)

  g, m = jax.grad(lambda q: f(q)[0])(p), f(p)[1]
  v = np.asarray(_linear(p, xt), np.float64)
  _, dv, logp_at_v = ref_awm(
      v, x0, eps, t, adv, np.broadcast_to(w, (K, B)), weighting="ghuber", clip=0.2,
      logp_old=None if logp_old is None else np.asarray(logp_old), v_ref=np.asarray(v_ref),
      v_ema=np.asarray(v_ema), kl=0.01, ema_kl=0.5,
  )  # fmt: skip
  np.testing.assert_allclose(
      np.asarray(g["w"]), np.einsum("kbnc,kbnd->cd", xt, dv), rtol=2e-4, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(g["b"]), dv.sum(axis=(0, 1, 2)), rtol=2e-4, atol=1e-6)
  if on_policy:
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, rtol=0, atol=0)
    assert float(m["clip_frac"]) == 0.0

  # The reference's hand derivative agrees with central differences of the reference loss (with
  # the old log-probs held fixed: on-policy at their value at v).
  h = 1e-6
  lo = logp_at_v if logp_old is None else np.asarray(logp_old)
  ref = lambda vv: ref_awm(
      vv, x0, eps, t, adv, np.broadcast_to(w, (K, B)), weighting="ghuber", clip=0.2,
      logp_old=lo, v_ref=np.asarray(v_ref), v_ema=np.asarray(v_ema), kl=0.01, ema_kl=0.5,
  )[0]  # fmt: skip
  for idx in [(0, 0, 1, 2), (2, 3, 4, 0), (1, 2, 0, 1)]:
    vp, vm = v.copy(), v.copy()
    vp[idx] += h
    vm[idx] -= h
    np.testing.assert_allclose((ref(vp) - ref(vm)) / (2 * h), dv[idx], rtol=1e-4, atol=1e-9)


def test_awm_fragments_sum_to_full_batch():
  rng, x0, eps, t, xt, adv = _data(4)
  p, p_old = _params(rng), _params(rng)
  logp_old = awm.awm_log_prob(_linear(p_old, xt), x0, eps, t)
  w = jnp.array([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])

  @jax.jit
  @jax.value_and_grad
  def f(params, xt_, x0_, eps_, t_, adv_, w_, lo_, den):
    return awm.awm_loss(
        _linear(params, xt_), x0_, eps_, t_, adv_, w_, logp_old=lo_, clip_range=0.2, denominator=den
    )[0]

  frag = lambda sl, den: f(
      p, xt[:, sl], x0[sl], eps[:, sl], t[:, sl], adv[sl], w[:, sl], logp_old[:, sl], den
  )
  full, g_full = frag(slice(None), jnp.sum(w))
  parts = [frag(sl, jnp.sum(w)) for sl in (slice(0, 3), slice(3, 4))]
  np.testing.assert_allclose(float(sum(l for l, _ in parts)), float(full), rtol=1e-6, atol=1e-8)
  for key in ("w", "b"):
    np.testing.assert_allclose(
        np.asarray(sum(g[key] for _, g in parts)), np.asarray(g_full[key]), rtol=1e-5, atol=1e-8
    )
  own = sum(float(frag(sl, jnp.sum(w[:, sl]))[0]) for sl in (slice(0, 3), slice(3, 4)))
  assert abs(own - float(full)) > 1e-3 * abs(float(full))


def test_awm_zero_weight_removes_pair():
  rng, x0, eps, t, xt, adv = _data(5)
  v = eps - x0[None] + 0.5 * rng.normal(size=eps.shape).astype(np.float32)
  v_ref = v + 0.1
  w = np.ones((K, B), np.float32)
  w[2, 1] = 0.0
  f = lambda vv: awm.awm_loss(vv, x0, eps, t, adv, w, v_ref=v_ref, kl_beta=0.1)[0]
  base, g = jax.value_and_grad(f)(jnp.asarray(v))
  v2 = v.copy()
  v2[2, 1] += 1e3
  np.testing.assert_allclose(float(f(jnp.asarray(v2))), float(base), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g[2, 1]), 0.0)
  assert np.all(np.abs(np.asarray(g[1, 1])) > 0)
  keep = np.array([True, True, False, True])
  masked, _ = awm.awm_loss(v, x0, eps, t, adv, keep)
  sub, _ = awm.awm_loss(v[:, keep], x0[keep], eps[:, keep], t[:, keep], adv[keep])
  np.testing.assert_allclose(float(masked), float(sub), rtol=1e-6)


@pytest.mark.parametrize("weighting", awm.WEIGHTINGS)
def test_awm_on_policy_step_follows_the_advantage(weighting):
  """On-policy, a gradient step lowers the flow-matching error of A > 0 samples (likelihood up)
  and raises it for A < 0; A = 0 samples get no gradient."""
  rng, x0, eps, t, _, _ = _data(6)
  adv = np.array([1.5, -2.0, 0.0, 0.3], np.float32)
  u = eps - x0[None]
  v0 = u + 0.8 * rng.normal(size=eps.shape).astype(np.float32)
  loss = lambda vv: awm.awm_loss(vv, x0, eps, t, adv, weighting=weighting)[0]
  g = np.asarray(jax.grad(loss)(jnp.asarray(v0)))
  np.testing.assert_array_equal(g[:, 2], 0.0)
  for k in range(K):
    for b in (0, 1, 3):
      d = (u - v0)[k, b].ravel()
      step = -g[k, b].ravel()
      cos = step @ d / (np.linalg.norm(step) * np.linalg.norm(d))
      np.testing.assert_allclose(cos, np.sign(adv[b]), atol=1e-5)
  fm = lambda vv: ((vv - u) ** 2).mean(axis=(2, 3))
  stepped = v0 - 1e-3 * g / np.abs(g).max()
  change = fm(v0) - fm(stepped)
  assert np.all(change[:, [0, 3]] > 0) and np.all(change[:, 1] < 0)


def test_awm_loss_validation():
  _, x0, eps, t, _, adv = _data()
  v = eps - x0[None]
  with pytest.raises(ValueError, match="weighting"):
    awm.awm_loss(v, x0, eps, t, adv, weighting="l2")
  with pytest.raises(ValueError, match="ghuber_power"):
    awm.awm_loss(v, x0, eps, t, adv, ghuber_power=0.0)
  with pytest.raises(ValueError, match="clip_range"):
    awm.awm_loss(v, x0, eps, t, adv, clip_range=0.0)
  with pytest.raises(ValueError, match="needs v_ref"):
    awm.awm_loss(v, x0, eps, t, adv, kl_beta=0.1)
  with pytest.raises(ValueError, match="needs v_ema"):
    awm.awm_loss(v, x0, eps, t, adv, ema_kl_beta=0.1)
  with pytest.raises(ValueError, match="adv has shape"):
    awm.awm_loss(v, x0, eps, t, adv[:2])
  with pytest.raises(ValueError, match="eps has shape"):
    awm.awm_loss(v, x0, eps[:1], t, adv)
  with pytest.raises(ValueError, match="x0 has shape"):
    awm.awm_loss(v, x0[:1], eps, t, adv)
  with pytest.raises(ValueError, match="t has shape"):
    awm.awm_loss(v, x0, eps, t[:1], adv)
  with pytest.raises(ValueError, match="logp_old has shape"):
    awm.awm_loss(v, x0, eps, t, adv, logp_old=np.zeros((K,)))
  with pytest.raises(ValueError, match="v_ema has shape"):
    awm.awm_loss(v, x0, eps, t, adv, v_ema=v[:1], ema_kl_beta=1.0)
  with pytest.raises(ValueError, match="weights has shape"):
    awm.awm_loss(v, x0, eps, t, adv, np.ones((2, 2)))


# ------------------------------------------------------------------ noise levels


def _grid(num_steps):
  return np.concatenate([np.linspace(1.0, 1.0 / num_steps, num_steps), [0.0]]).astype(np.float32)


def _indices(t, grid):
  levels = grid[:-1]
  idx = np.array([[int(np.flatnonzero(levels == x)[0]) for x in row] for row in np.asarray(t)])
  return idx


@pytest.mark.parametrize(
    "include_init, strata",
    [
        # T = 14, fraction 0.9: span [0, 12], 6 strata of 2 (the official PickScore 'discrete').
        (True, [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
        # 'discrete_wo_init': linspace(1, 12, 7) = 1, 2.83, 4.67, 6.5, 8.33, 10.17, 12, floored.
        (False, [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
    ],
)
def test_stratified_noise_levels_strata(include_init, strata):
  grid = _grid(14)
  key = jax.random.PRNGKey(0)
  t = awm.stratified_noise_levels(key, grid, 300, 6, include_init=include_init, per_sample=True)
  assert t.shape == (6, 300) and t.dtype == jnp.float32
  idx = _indices(t, grid)
  for k, stratum in enumerate(strata):
    assert set(idx[k].tolist()) == stratum, f"stratum {k}: {sorted(set(idx[k]))} vs {stratum}"
  shared = awm.stratified_noise_levels(key, grid, 5, 6, include_init=include_init)
  assert np.all(np.asarray(shared) == np.asarray(shared)[:, :1]), "one draw for all samples"
  sidx = _indices(shared, grid)[:, 0]
  assert all(i in s for i, s in zip(sidx, strata))


def test_stratified_noise_levels_validation():
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="ending in 0"):
    awm.stratified_noise_levels(key, _grid(4)[:-1], 2, 2)
  with pytest.raises(ValueError, match="empty"):
    awm.stratified_noise_levels(key, _grid(2), 2, 1, timestep_fraction=0.5, include_init=False)
  with pytest.raises(ValueError, match="timestep_fraction"):
    awm.stratified_noise_levels(key, _grid(4), 2, 2, timestep_fraction=0.0)
  with pytest.raises(ValueError, match="num_levels"):
    awm.stratified_noise_levels(key, _grid(4), 2, 0)


# ------------------------------------------------------------------ config


def test_awm_config_defaults_and_validation():
  c = awm.AWMConfig()
  assert (c.weighting, c.ghuber_power, c.clip_range) == ("ghuber", 0.25, 1.0)
  assert (c.adv_clip_max, c.advantage_max, c.kl_beta, c.ema_kl_beta) == (5.0, 1.0, 1e-4, 1.0)
  assert (c.num_levels, c.timestep_fraction, c.include_init) == (6, 0.9, True)
  np.testing.assert_allclose(
      [nft.old_policy_decay(s, c.ema_decay) for s in (0, 100, 300, 10**4)], [0, 0.1, 0.3, 0.3]
  )
  assert awm.AWMConfig(advantage_max=None).advantage_max is None
  for field, bad in (
      ("weighting", "mse"),
      ("ghuber_power", 0.0),
      ("clip_range", 0.0),
      ("adv_clip_max", -1.0),
      ("advantage_max", 0.0),
      ("kl_beta", -1e-4),
      ("ema_kl_beta", float("nan")),
      ("ema_decay", 0.3),
      ("num_levels", 0),
      ("timestep_fraction", 0.0),
  ):
    with pytest.raises(ValueError, match=f"AWMConfig.{field}="):
      awm.AWMConfig(**{field: bad})
