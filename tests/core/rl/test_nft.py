"""digen_jax.rl.nft (DiffusionNFT) against a direct per-sample, per-level numpy transcription of the
published formulas: optimality probability, the implicit-policy x0 losses with adaptive weights,
their gradient through a tiny linear velocity model, fragment denominators, masks, the sign of the
update at v_θ = v_old, the old policy's decay schedule and soft update, and the noise levels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.rl import nft

K, B, N, C = 3, 4, 5, 3
BETA, M, KL = 0.3, 5.0, 0.05


# ------------------------------------------------------------------ direct references (float64)


def ref_r(adv, m, mode="all"):
  out = []
  for a in np.asarray(adv, np.float64):
    a = min(max(a, -m), m)
    if mode == "positive_only":
      a = min(max(a, 0.0), m)
    elif mode == "negative_only":
      a = min(max(a, -m), 0.0)
    elif mode == "one_only":
      a = 1.0 if a > 0 else 0.0
    elif mode == "binary":
      a = float(np.sign(a))
    out.append(min(max(a / m / 2 + 0.5, 0.0), 1.0))
  return np.array(out)


def ref_pair(v, v_old, x0, xt, t, r, beta, m, v_ref, kl_beta, v_w=None):
  """One (level, sample) pair: (ℓ, dℓ/dv, L⁺, L⁻), written from the paper / official script.

  The adaptive weights are constants of the loss: v_w (default v) is the velocity they are
  evaluated at, so that a finite difference in v with v_w fixed checks dℓ/dv exactly."""
  d = v.size
  x0_pos = lambda vv: xt - t * (beta * vv + (1 - beta) * v_old)
  x0_neg = lambda vv: xt - t * ((1 + beta) * v_old - beta * vv)
  v_w = v if v_w is None else v_w
  wp = max(np.mean(np.abs(x0_pos(v_w) - x0)), 1e-5)
  wn = max(np.mean(np.abs(x0_neg(v_w) - x0)), 1e-5)
  ep = x0_pos(v) - x0
  en = x0_neg(v) - x0
  lp = np.mean(ep**2) / wp
  ln = np.mean(en**2) / wn
  ell = m * (r * lp + (1 - r) * ln) / beta
  # d/dv with the adaptive weights held constant: d ep/dv = −tβ, d en/dv = +tβ.
  g = m / beta * (r * 2 * ep * (-t * beta) / (d * wp) + (1 - r) * 2 * en * (t * beta) / (d * wn))
  if v_ref is not None:
    ell += kl_beta * np.mean((v - v_ref) ** 2)
    g = g + kl_beta * 2 * (v - v_ref) / d
  return ell, g, lp, ln


def ref_loss(v, v_old, x0, xt, t, r, w, beta, m, den=None, v_ref=None, kl_beta=0.0, v_w=None):
  v, v_old, x0, xt, t, r, w = (np.asarray(a, np.float64) for a in (v, v_old, x0, xt, t, r, w))
  v_ref = None if v_ref is None else np.asarray(v_ref, np.float64)
  v_w = v if v_w is None else v_w
  den = w.sum() if den is None else den
  total, grad = 0.0, np.zeros_like(v)
  lps, lns = 0.0, 0.0
  for k in range(v.shape[0]):
    for b in range(v.shape[1]):
      vr = None if v_ref is None else v_ref[k, b]
      ell, g, lp, ln = ref_pair(
          v[k, b], v_old[k, b], x0[b], xt[k, b], t[k, b], r[b], beta, m, vr, kl_beta, v_w[k, b]
      )
      total += w[k, b] * ell
      grad[k, b] = w[k, b] * g / den
      lps += w[k, b] * lp
      lns += w[k, b] * ln
  return total / den, grad, lps / w.sum(), lns / w.sum()


# ------------------------------------------------------------------ fixtures


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x0 = rng.normal(size=(B, N, C)).astype(np.float32)
  eps = rng.normal(size=(K, B, N, C)).astype(np.float32)
  t = rng.uniform(0.05, 0.95, size=(K, B)).astype(np.float32)
  xt = np.asarray(nft.forward_noise(x0, t, eps))
  adv = np.array([2.0, -1.0, 7.0, 0.4], np.float32)
  return rng, x0, eps, t, xt, adv


def _linear(p, x):
  return jnp.einsum("...nc,cd->...nd", x, p["w"]) + p["b"]


def _params(rng, scale=0.3):
  return {
      "w": jnp.asarray(np.eye(C) * 0.5 + scale * rng.normal(size=(C, C)), jnp.float32),
      "b": jnp.asarray(scale * rng.normal(size=(C,)), jnp.float32),
  }


# ------------------------------------------------------------------ optimality probability


@pytest.mark.parametrize("mode", nft.ADV_MODES)
def test_optimality_probability_matches_reference(mode):
  adv = np.array([-9.0, -5.0, -2.5, -1e-3, 0.0, 1e-3, 1.0, 4.99, 5.0, 12.0], np.float32)
  r = np.asarray(nft.optimality_probability(adv, M, mode))
  assert r.dtype == np.float32
  np.testing.assert_allclose(r, ref_r(adv, M, mode), rtol=0, atol=1e-7)
  assert np.all((r >= 0) & (r <= 1))
  assert np.all(np.diff(r) >= 0), "r must be non-decreasing in A"


def test_optimality_probability_values_and_strict_monotonicity():
  r = np.asarray(nft.optimality_probability(jnp.array([-5.0, -2.5, 0.0, 2.5, 5.0, 100.0]), 5.0))
  np.testing.assert_allclose(r, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0], atol=1e-7)
  a = np.linspace(-4.9, 4.9, 50, dtype=np.float32)
  assert np.all(np.diff(np.asarray(nft.optimality_probability(a, 5.0))) > 0)
  with pytest.raises(ValueError, match="adv_clip_max"):
    nft.optimality_probability(a, 0.0)
  with pytest.raises(ValueError, match="adv_mode"):
    nft.optimality_probability(a, 5.0, "positive")
  with pytest.raises(ValueError, match=r"expected \[B\]"):
    nft.optimality_probability(np.zeros((2, 2)), 5.0)


# ------------------------------------------------------------------ the loss


def test_forward_noise_matches_loop_and_inverts():
  _, x0, eps, t, xt, _ = _data()
  for k in range(K):
    for b in range(B):
      np.testing.assert_allclose(xt[k, b], (1 - t[k, b]) * x0[b] + t[k, b] * eps[k, b], rtol=1e-6)
  # The x0 prediction of the true velocity ε − x0 is x0 itself.
  x0_hat = xt - t[..., None, None] * (eps - x0[None])
  np.testing.assert_allclose(x0_hat, np.broadcast_to(x0, xt.shape), atol=1e-5)
  with pytest.raises(ValueError, match="eps has shape"):
    nft.forward_noise(x0, t, eps[:, :2])
  with pytest.raises(ValueError, match="t has shape"):
    nft.forward_noise(x0, t[:, :2], eps)


@pytest.mark.parametrize("weights_kind", ["none", "mask_b", "kb"])
def test_nft_loss_matches_reference(weights_kind):
  rng, x0, eps, t, xt, adv = _data(1)
  v = (eps - x0[None]) + 0.7 * rng.normal(size=xt.shape).astype(np.float32)
  v_old = (eps - x0[None]) + 0.7 * rng.normal(size=xt.shape).astype(np.float32)
  v_ref = v_old + 0.2 * rng.normal(size=xt.shape).astype(np.float32)
  r = np.asarray(nft.optimality_probability(adv, M))
  w_in = {
      "none": None,
      "mask_b": np.array([True, False, True, True]),
      "kb": rng.uniform(0.0, 2.0, size=(K, B)).astype(np.float32),
  }[weights_kind]
  w = np.ones((K, B)) if w_in is None else np.broadcast_to(np.asarray(w_in, np.float64), (K, B))
  loss, m = nft.nft_loss(
      v, v_old, x0, xt, t, r, w_in, beta=BETA, adv_clip_max=M, v_ref=v_ref, kl_beta=KL
  )
  want, _, lp, ln = ref_loss(v, v_old, x0, xt, t, r, w, BETA, M, v_ref=v_ref, kl_beta=KL)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  np.testing.assert_allclose(float(m["loss"]), want, rtol=2e-5)
  want_pol, *_ = ref_loss(v, v_old, x0, xt, t, r, w, BETA, M)
  np.testing.assert_allclose(float(m["policy_loss"]), want_pol, rtol=2e-5)
  np.testing.assert_allclose(float(m["positive_loss"]), lp, rtol=2e-5)
  np.testing.assert_allclose(float(m["negative_loss"]), ln, rtol=2e-5)
  np.testing.assert_allclose(float(m["weight_sum"]), w.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(m["r_mean"]), (w * r[None]).sum() / w.sum(), rtol=1e-6)
  kl = ((v - v_ref) ** 2).mean(axis=(2, 3))
  np.testing.assert_allclose(float(m["kl_div"]), (w * kl).sum() / w.sum(), rtol=2e-5)
  dev = ((v - v_old) ** 2).mean(axis=(2, 3))
  np.testing.assert_allclose(float(m["old_deviate"]), (w * dev).sum() / w.sum(), rtol=2e-5)
  assert all(np.shape(x) == () for x in m.values())


def test_nft_loss_adaptive_weight_floor():
  # x_t − t·v⁺ = x0 exactly: the adaptive weight hits its 1e-5 floor and the loss stays finite.
  _, x0, eps, t, xt, _ = _data(2)
  u = eps - x0[None]
  r = np.full((B,), 0.5, np.float32)
  loss, _ = nft.nft_loss(u, u, x0, xt, t, r, beta=1.0, adv_clip_max=M)
  want, *_ = ref_loss(u, u, x0, xt, t, r, np.ones((K, B)), 1.0, M)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), want, atol=1e-6)


def test_nft_grad_through_linear_model_matches_reference():
  rng, x0, eps, t, xt, adv = _data(3)
  p, p_old, p_ref = _params(rng), _params(rng), _params(rng)
  r = np.asarray(nft.optimality_probability(adv, M))
  w = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
  v_old = _linear(p_old, xt)
  v_ref = _linear(p_ref, xt)

  def f(params):
    return nft.nft_loss(
        _linear(params, xt),
        v_old,
        x0,
        xt,
        t,
        r,
        w,
        beta=BETA,
        adv_clip_max=M,
        v_ref=v_ref,
        kl_beta=KL,
    )[0]

  g = jax.grad(f)(p)
  v = np.asarray(_linear(p, xt), np.float64)
  wk = np.broadcast_to(w, (K, B))
  _, dv, _, _ = ref_loss(v, v_old, x0, xt, t, r, wk, BETA, M, v_ref=v_ref, kl_beta=KL)
  want_w = np.einsum("kbnc,kbnd->cd", np.asarray(xt, np.float64), dv)
  want_b = dv.sum(axis=(0, 1, 2))
  np.testing.assert_allclose(np.asarray(g["w"]), want_w, rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g["b"]), want_b, rtol=2e-4, atol=1e-6)

  # The reference's hand derivative agrees with central differences of the reference loss with
  # the adaptive weights held at v (so a wrong derivation cannot make both sides agree).
  h = 1e-6
  for idx in [(0, 1, 2, 0), (2, 3, 4, 2), (1, 0, 0, 1)]:
    vp, vm = v.copy(), v.copy()
    vp[idx] += h
    vm[idx] -= h
    lp_, *_ = ref_loss(vp, v_old, x0, xt, t, r, wk, BETA, M, v_ref=v_ref, kl_beta=KL, v_w=v)
    lm_, *_ = ref_loss(vm, v_old, x0, xt, t, r, wk, BETA, M, v_ref=v_ref, kl_beta=KL, v_w=v)
    np.testing.assert_allclose((lp_ - lm_) / (2 * h), dv[idx], rtol=1e-5, atol=1e-9)


def test_nft_fragments_sum_to_full_batch():
  rng, x0, eps, t, xt, adv = _data(4)
  p, p_old = _params(rng), _params(rng)
  r = nft.optimality_probability(adv, M)
  w = jnp.array([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
  v_old = _linear(p_old, xt)

  @jax.jit
  @jax.value_and_grad
  def f(params, xt_, v_old_, x0_, t_, r_, w_, den):
    return nft.nft_loss(
        _linear(params, xt_),
        v_old_,
        x0_,
        xt_,
        t_,
        r_,
        w_,
        beta=BETA,
        adv_clip_max=M,
        denominator=den,
    )[0]

  frag = lambda sl, den: f(p, xt[:, sl], v_old[:, sl], x0[sl], t[:, sl], r[sl], w[:, sl], den)
  full, g_full = frag(slice(None), jnp.sum(w))
  ref, _, _, _ = ref_loss(_linear(p, xt), v_old, x0, xt, t, r, w, BETA, M)
  np.testing.assert_allclose(float(full), ref, rtol=2e-5)
  parts = [frag(sl, jnp.sum(w)) for sl in (slice(0, 1), slice(1, 4))]
  np.testing.assert_allclose(float(sum(l for l, _ in parts)), float(full), rtol=1e-6)
  for key in ("w", "b"):
    np.testing.assert_allclose(
        np.asarray(sum(g[key] for _, g in parts)), np.asarray(g_full[key]), rtol=1e-5, atol=1e-7
    )
  # With each fragment's own sum(weights) each is its own mean: the sum is not the batch's.
  own = sum(float(frag(sl, jnp.sum(w[:, sl]))[0]) for sl in (slice(0, 1), slice(1, 4)))
  assert abs(own - float(full)) > 1e-3 * abs(float(full))


def test_nft_zero_weight_removes_pair():
  rng, x0, eps, t, xt, adv = _data(5)
  v = eps - x0[None] + 0.5 * rng.normal(size=xt.shape).astype(np.float32)
  v_old = eps - x0[None] + 0.5 * rng.normal(size=xt.shape).astype(np.float32)
  r = nft.optimality_probability(adv, M)
  w = np.ones((K, B), np.float32)
  w[1, 2] = 0.0
  f = lambda vv: nft.nft_loss(vv, v_old, x0, xt, t, r, w, beta=BETA, adv_clip_max=M)[0]
  base, g = jax.value_and_grad(f)(jnp.asarray(v))
  v2 = v.copy()
  v2[1, 2] += 1e3  # anything at the removed pair
  np.testing.assert_allclose(float(f(jnp.asarray(v2))), float(base), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g[1, 2]), 0.0)
  assert np.all(np.abs(np.asarray(g[1, 1])) > 0)
  # A [B] mask drops the sample at every level: equal to the loss on the remaining samples.
  keep = np.array([True, False, True, True])
  masked, _ = nft.nft_loss(v, v_old, x0, xt, t, r, keep, beta=BETA, adv_clip_max=M)
  sub, _ = nft.nft_loss(
      v[:, keep],
      v_old[:, keep],
      x0[keep],
      xt[:, keep],
      t[:, keep],
      r[keep],
      beta=BETA,
      adv_clip_max=M,
  )
  np.testing.assert_allclose(float(masked), float(sub), rtol=1e-6)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_gradient_direction_at_old_policy(beta):
  """At v_θ = v_old, r = 1 moves v toward ε − x0 (lower flow-matching error: likelihood up),
  r = 0 away from it, r = 1/2 not at all."""
  rng, x0, eps, t, xt, _ = _data(6)
  u = eps - x0[None]
  v0 = u + 0.8 * rng.normal(size=xt.shape).astype(np.float32)

  def grad_at(r_value):
    r = jnp.full((B,), r_value, jnp.float32)
    return np.asarray(
        jax.grad(lambda vv: nft.nft_loss(vv, v0, x0, xt, t, r, beta=beta, adv_clip_max=M)[0])(
            jnp.asarray(v0)
        )
    )

  fm = lambda vv: ((vv - u) ** 2).mean(axis=(2, 3))  # per-pair flow-matching error
  for r_value, sign in ((1.0, 1.0), (0.0, -1.0), (0.8, 1.0), (0.2, -1.0)):
    g = grad_at(r_value)
    # −∇ is a positive (r > 1/2) or negative (r < 1/2) multiple of u − v, pair by pair.
    for k in range(K):
      for b in range(B):
        d = (u - v0)[k, b].ravel()
        step = -g[k, b].ravel()
        cos = step @ d / (np.linalg.norm(step) * np.linalg.norm(d))
        np.testing.assert_allclose(cos, sign, atol=1e-5)
    stepped = v0 - 1e-3 * g / np.abs(g).max()
    assert np.all(np.sign(fm(v0) - fm(stepped)) == sign)
  np.testing.assert_allclose(grad_at(0.5), 0.0, atol=1e-7)


def test_nft_loss_validation():
  _, x0, eps, t, xt, adv = _data()
  v = eps - x0[None]
  r = nft.optimality_probability(adv, M)
  kw = dict(beta=BETA, adv_clip_max=M)
  with pytest.raises(ValueError, match="beta"):
    nft.nft_loss(v, v, x0, xt, t, r, beta=0.0, adv_clip_max=M)
  with pytest.raises(ValueError, match="adv_clip_max"):
    nft.nft_loss(v, v, x0, xt, t, r, beta=BETA, adv_clip_max=-1.0)
  with pytest.raises(ValueError, match="v_old has shape"):
    nft.nft_loss(v, v[:, :2], x0, xt, t, r, **kw)
  with pytest.raises(ValueError, match="x0 has shape"):
    nft.nft_loss(v, v, x0[:2], xt, t, r, **kw)
  with pytest.raises(ValueError, match="t has shape"):
    nft.nft_loss(v, v, x0, xt, t[0], r, **kw)
  with pytest.raises(ValueError, match="r has shape"):
    nft.nft_loss(v, v, x0, xt, t, r[:2], **kw)
  with pytest.raises(ValueError, match="weights has shape"):
    nft.nft_loss(v, v, x0, xt, t, r, np.ones(7), **kw)
  with pytest.raises(ValueError, match="needs v_ref"):
    nft.nft_loss(v, v, x0, xt, t, r, kl_beta=0.1, **kw)
  with pytest.raises(ValueError, match="v_ref has shape"):
    nft.nft_loss(v, v, x0, xt, t, r, v_ref=v[:1], kl_beta=0.1, **kw)


# ------------------------------------------------------------------ old policy


def test_decay_schedule_values():
  d = nft.old_policy_decay
  assert [d(s, 0) for s in (0, 1, 500, 10**5)] == [0.0] * 4
  np.testing.assert_allclose(
      [d(s, 1) for s in (0, 1, 250, 499, 500, 5000)], [0, 0.001, 0.25, 0.499, 0.5, 0.5]
  )
  np.testing.assert_allclose(
      [d(s, 2) for s in (0, 74, 75, 76, 100, 208, 209, 10**4)],
      [0, 0, 0, 0.0075, 0.1875, 0.9975, 0.999, 0.999],
  )
  custom = nft.DecaySchedule(flat=10, uprate=0.1, uphold=0.3)
  np.testing.assert_allclose(
      [d(s, custom) for s in (9, 10, 11, 12, 13, 50)], [0, 0, 0.1, 0.2, 0.3, 0.3]
  )
  assert nft.DECAY_TYPES[1] == nft.DecaySchedule()  # the default is the recipe's type 1
  with pytest.raises(ValueError, match="decay types"):
    d(3, 7)
  with pytest.raises(ValueError, match="step"):
    d(-1, 1)
  with pytest.raises(ValueError, match="uphold"):
    nft.DecaySchedule(uphold=1.5)
  with pytest.raises(ValueError, match="flat"):
    nft.DecaySchedule(flat=-1)
  with pytest.raises(ValueError, match="uprate"):
    nft.DecaySchedule(uprate=-0.1)


def test_soft_update_arithmetic():
  old = {"a": jnp.array([1.0, 2.0, -4.0]), "b": {"c": jnp.array([[8.0]], jnp.bfloat16)}}
  new = {"a": jnp.array([3.0, 2.0, 0.0]), "b": {"c": jnp.array([[0.0]], jnp.bfloat16)}}
  out = nft.soft_update(old, new, 0.25)
  np.testing.assert_allclose(np.asarray(out["a"]), [2.5, 2.0, -1.0])
  assert out["b"]["c"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out["b"]["c"], np.float32), [[2.0]])
  for decay, want in ((0.0, new), (1.0, old)):
    got = nft.soft_update(old, new, decay)
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(want["a"]))
  # Under jit with a traced decay (the trainer's step-dependent η).
  got = jax.jit(nft.soft_update)(old, new, jnp.float32(0.5))
  np.testing.assert_allclose(np.asarray(got["a"]), [2.0, 2.0, -2.0])
  with pytest.raises(ValueError, match="structure"):
    nft.soft_update(old, {"a": new["a"]}, 0.5)
  with pytest.raises(ValueError, match="leaf shapes"):
    nft.soft_update({"a": jnp.zeros(2)}, {"a": jnp.zeros(3)}, 0.5)
  with pytest.raises(ValueError, match="decay"):
    nft.soft_update(old, new, 1.5)


# ------------------------------------------------------------------ noise levels


GRID = np.array([1.0, 0.9, 0.75, 0.5, 0.3, 0.1, 0.0], np.float32)  # T = 6 levels + terminal 0


def test_num_train_levels():
  assert nft.num_train_levels(10, 0.99) == 9  # the official K for T = 10
  assert nft.num_train_levels(25, 0.99) == 24
  assert nft.num_train_levels(14, 0.9) == 12
  assert nft.num_train_levels(1, 0.5) == 1
  assert nft.num_train_levels(6, 1.0) == 6
  with pytest.raises(ValueError, match="timestep_fraction"):
    nft.num_train_levels(10, 0.0)


def test_sample_noise_levels_distinct_grid_levels_per_sample():
  t = np.asarray(nft.sample_noise_levels(jax.random.PRNGKey(0), GRID, 64, 4))
  assert t.shape == (4, 64) and t.dtype == np.float32
  levels = GRID[:-1]
  assert np.all(np.isin(t, levels)), "levels come from the rollout grid, never the terminal 0"
  for b in range(64):
    assert len(set(t[:, b].tolist())) == 4, "K distinct levels per sample"
  assert len({tuple(t[:, b]) for b in range(64)}) > 10, "samples draw their own permutations"
  full = np.asarray(nft.sample_noise_levels(jax.random.PRNGKey(1), GRID, 8, 6))
  for b in range(8):
    np.testing.assert_array_equal(np.sort(full[:, b]), np.sort(levels))
  # Uniform over levels at every position (a random permutation per sample).
  many = np.asarray(nft.sample_noise_levels(jax.random.PRNGKey(2), GRID, 6000, 2))
  for k in range(2):
    freq = np.array([(many[k] == s).mean() for s in levels])
    np.testing.assert_allclose(freq, 1 / 6, atol=0.025)


def test_sample_noise_levels_validation():
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="ending in 0"):
    nft.sample_noise_levels(key, GRID[:-1], 4, 2)
  with pytest.raises(ValueError, match="num_levels"):
    nft.sample_noise_levels(key, GRID, 4, 7)
  with pytest.raises(ValueError, match="num_levels"):
    nft.sample_noise_levels(key, GRID, 4, 0)
  with pytest.raises(ValueError, match=r"\(0, 1\]"):
    nft.sample_noise_levels(key, np.array([1.5, 0.5, 0.0]), 4, 1)


# ------------------------------------------------------------------ config


def test_nft_config_defaults_and_validation():
  c = nft.NFTConfig()
  assert (c.beta, c.adv_clip_max, c.adv_mode, c.kl_beta) == (1.0, 5.0, "all", 1e-4)
  assert c.decay == nft.DecaySchedule(flat=0, uprate=0.001, uphold=0.5)
  assert c.timestep_fraction == 0.99 and c.weight_min == 1e-5
  assert c.num_levels(10) == 9
  assert nft.NFTConfig(beta=0.1, decay=nft.DECAY_TYPES[2]).decay.flat == 75
  for field, bad in (
      ("beta", 0.0),
      ("beta", float("inf")),
      ("adv_clip_max", 0.0),
      ("adv_mode", "pos"),
      ("kl_beta", -1.0),
      ("decay", 1),
      ("timestep_fraction", 1.5),
      ("weight_min", 0.0),
  ):
    with pytest.raises(ValueError, match=f"NFTConfig.{field}="):
      nft.NFTConfig(**{field: bad})
