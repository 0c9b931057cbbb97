"""A tiny velocity model shared by the sampler and RL tests (fast to compile, reads sigma and cond)."""

import jax
import jax.numpy as jnp

B, N, C, D_COND, HID = 4, 6, 3, 5, 16
T = 6


def toy_velocity(params, x, sigma, cond):
  """2-layer MLP over tokens that reads sigma and a per-sample cond vector."""
  h = (
      x @ params["w_in"]
      + sigma[:, None, None] * params["w_sig"]
      + (cond["emb"] @ params["w_cond"])[:, None, :]
  )
  return jnp.tanh(h + params["b"]) @ params["w_out"]


def toy_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "w_in": 0.5 * jax.random.normal(k[0], (C, HID)),
      "w_sig": 0.5 * jax.random.normal(k[1], (HID,)),
      "w_cond": 0.5 * jax.random.normal(k[2], (D_COND, HID)),
      "b": jnp.zeros((HID,)),
      "w_out": 0.5 * jax.random.normal(k[3], (HID, C)),
  }


def toy_cond(seed, b=B):
  return {"emb": jax.random.normal(jax.random.key(seed), (b, D_COND))}
