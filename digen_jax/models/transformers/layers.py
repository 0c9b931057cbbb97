"""Transformer building blocks shared by every family (QwenImage's MMDiT, FLUX, Wan).

Pure functions (norms, the sinusoidal timestep embedding, AdaLN modulation, the q/k/v projection
with per-head RMSNorm and RoPE) and the small modules built from them: `linear`, `RMSNorm`,
`TimestepEmbedder`, `TextPoolEmbedder`, `MLP` and `QKVProjection`. Their params carry
diffusers' names where diffusers' modules have them, so a family's key table reads one-to-one;
`embedder_linears` and `feed_forward_linears` give those tables' entries.

Precision: matmuls run in the params' dtype (activations are cast to it on entry); norm
statistics, the RoPE rotation and the attention softmax run in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from digen_jax.models.attention import kernels as attention_lib
from digen_jax.models.transformers import rope
from digen_jax.models.attention import sequence_parallel
from digen_jax.models.io.tensor_source import LinearEntries

# Fixed by diffusers' Timesteps / TimestepEmbedding / FeedForward (not config options there).
TIMESTEP_CHANNELS = 256  # Timesteps(num_channels=256, flip_sin_to_cos=True, shift=0)
# The pipelines pass sigma = timestep / 1000; the embedding multiplies it back.
TIMESTEP_SCALE = 1000.0
TIMESTEP_MAX_PERIOD = 10000.0
MLP_RATIO = 4  # FeedForward(mult=4, activation_fn="gelu-approximate")


# ----------------------------------------------------------------------------------------------
# Pure functions.


def timestep_embedding(sigma: jax.Array, scale: float = TIMESTEP_SCALE) -> jax.Array:
  """Sinusoidal embedding of scale*sigma, diffusers Timesteps(256, flip_sin_to_cos=True, shift=0,
  scale=scale).

  sigma [B] -> [B, 256] float32, order (cos, sin). QwenImage embeds sigma with scale=1000; FLUX
  multiplies sigma by 1000 itself and embeds the product with scale=1 (the two round differently
  in float32, hence the argument).
  """
  half = TIMESTEP_CHANNELS // 2
  # Same op order as diffusers' get_timestep_embedding so float32 results agree bit-for-bit or
  # nearly.
  exponent = (
      np.float32(-math.log(TIMESTEP_MAX_PERIOD))
      * np.arange(half, dtype=np.float32)
      / np.float32(half)
  )
  # exp in float64, rounded once: torch's float32 exp is (nearly always) correctly rounded,
  # numpy's is not (1 ulp off for ~40% of these); at FLUX's guidance 3.5 * 1000 one ulp of a
  # frequency moves a sinusoid by ~2e-4.
  freqs = jnp.asarray(np.exp(exponent.astype(np.float64)).astype(np.float32))
  args = sigma.astype(jnp.float32)[:, None] * freqs[None, :]
  if scale != 1.0:
    args = scale * args
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def layer_norm(x: jax.Array, eps: float) -> jax.Array:
  """LayerNorm without affine params over the last axis; statistics in float32, returns x.dtype."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis with scale [dim]; statistics and result in float32."""
  xf = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  return xf * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """x [..., in] @ kernel [in, out] + bias [out], as nnx.Linear computes it (inputs already in
  the params' dtype)."""
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
  return y + bias


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  """AdaLN modulation of tokens x [B, S, D] by per-sample shift, scale [B, D]."""
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


def masked_mean(tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
  """[B, L, C] tokens, [B, L] mask (None = all real) -> [B, C] mean over the real tokens
  (float32)."""
  t = tokens.astype(jnp.float32)
  if mask is None:
    return jnp.mean(t, axis=1)
  m = mask.astype(jnp.float32)[..., None]
  return jnp.sum(t * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def output_head(
    x: jax.Array, temb: jax.Array, norm_out: nnx.Linear, proj_out: nnx.Linear, eps: float
) -> jax.Array:
  """diffusers AdaLayerNormContinuous (norm_out: D -> 2D, chunk order scale, shift) then proj_out:
  tokens x [B, S, D], temb [B, D] -> [B, S, out] float32."""
  scale, shift = jnp.split(norm_out(jax.nn.silu(temb)), 2, axis=-1)
  x = modulate(layer_norm(x, eps), shift, scale)
  return proj_out(x).astype(jnp.float32)


def output_layers(
    dim: int, out_dim: int, rngs: nnx.Rngs, param_dtype: Any
) -> tuple[nnx.Linear, nnx.Linear]:
  """(norm_out, proj_out) of ``output_head``: D -> 2D and D -> out_dim Linears, made in that
  order."""
  return linear(dim, 2 * dim, rngs, param_dtype), linear(dim, out_dim, rngs, param_dtype)


def linear_param_count(n_in: int, n_out: int) -> int:
  """Parameters of a Linear layer with bias."""
  return n_in * n_out + n_out


# ----------------------------------------------------------------------------------------------
# Modules.


def linear(n_in: int, n_out: int, rngs: nnx.Rngs, param_dtype: Any) -> nnx.Linear:
  # dtype=None: compute in the promoted dtype of input and params; we cast inputs to the params'
  # dtype.
  return nnx.Linear(n_in, n_out, use_bias=True, param_dtype=param_dtype, rngs=rngs)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned scale; statistics in float32 (diffusers RMSNorm)."""

  def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps).astype(x.dtype)


class TimestepEmbedder(nnx.Module):
  """diffusers TimestepEmbedding: linear_1 -> SiLU -> linear_2, on the 256-channel sinusoidal
  embedding."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.linear_1 = linear(TIMESTEP_CHANNELS, dim, rngs, param_dtype)
    self.linear_2 = linear(dim, dim, rngs, param_dtype)

  def __call__(self, sigma: jax.Array, scale: float = TIMESTEP_SCALE) -> jax.Array:
    """sigma [B] -> [B, dim]; `scale` as in ``timestep_embedding``."""
    emb = timestep_embedding(sigma, scale).astype(self.linear_1.kernel.dtype)
    return self.linear_2(jax.nn.silu(self.linear_1(emb)))

  @staticmethod
  def param_count(dim: int) -> int:
    return linear_param_count(TIMESTEP_CHANNELS, dim) + linear_param_count(dim, dim)


class TextPoolEmbedder(nnx.Module):
  """Pooled prompt -> timestep-embedding offset: linear_1 -> SiLU -> linear_2 (FLUX's
  PixArtAlphaTextProjection; mmdit.MMDiTConfig.pooled_text)."""

  def __init__(self, in_dim: int, dim: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.linear_1 = linear(in_dim, dim, rngs, param_dtype)
    self.linear_2 = linear(dim, dim, rngs, param_dtype)

  def __call__(self, pooled: jax.Array) -> jax.Array:
    return self.linear_2(jax.nn.silu(self.linear_1(pooled.astype(self.linear_1.kernel.dtype))))


class MLP(nnx.Module):
  """diffusers FeedForward(activation_fn='gelu-approximate'): Linear(D, hidden) -> tanh-GELU ->
  Linear(hidden, D); hidden = MLP_RATIO * D unless given."""

  def __init__(
      self,
      dim: int,
      *,
      rngs: nnx.Rngs,
      param_dtype: Any = jnp.float32,
      hidden_dim: int | None = None,
  ):
    hidden_dim = MLP_RATIO * dim if hidden_dim is None else hidden_dim
    self.fc1 = linear(dim, hidden_dim, rngs, param_dtype)
    self.fc2 = linear(hidden_dim, dim, rngs, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


def embedder_linears(diffusers_path: str, ours: str) -> LinearEntries:
  """Key-table entries of a TimestepEmbedder / TextPoolEmbedder held by diffusers at
  `diffusers_path` (its linear_1 / linear_2) and by us at `ours`."""
  return tuple((f'{diffusers_path}.{n}', (ours, n)) for n in ('linear_1', 'linear_2'))


def feed_forward_linears(diffusers_path: str, ours: str) -> LinearEntries:
  """Key-table entries of an MLP: diffusers FeedForward's net.0.proj / net.2 -> our fc1 / fc2."""
  return (
      (f'{diffusers_path}.net.0.proj', (ours, 'fc1')),
      (f'{diffusers_path}.net.2', (ours, 'fc2')),
  )


# ----------------------------------------------------------------------------------------------
# Attention with per-head q/k RMSNorm and RoPE.


def project_qkv(
    x: jax.Array,
    to_q: nnx.Linear,
    to_k: nnx.Linear,
    to_v: nnx.Linear,
    norm_q: RMSNorm,
    norm_k: RMSNorm,
    cos: jax.Array,
    sin: jax.Array,
    heads: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [B, S, D] -> q, k, v [B, S, heads, Dh] in x.dtype: Linear projections, RMSNorm on q and k,
  RoPE (tables [S, Dh/2]) on q and k, q pre-multiplied by the softmax scale 1/sqrt(Dh).

  The RMSNorm runs over its scale's width: per head (scale [Dh]: QwenImage, FLUX) or across all
  heads (scale [heads * Dh]: Wan's rms_norm_across_heads). q and k come out in the half-split
  head-dim order (rope.to_half_split): RMSNorm over head dims is order-free once its scale is
  permuted the same way, and RoPE becomes two contiguous halves. Attention scores are the same as
  with diffusers' interleaved layout; v keeps the original order, so the attention output does
  too. Folding the softmax scale into q is exact for power-of-two head dims (one rounding
  otherwise)."""
  hd = to_q.kernel.shape[-1] // heads
  cos2, sin2 = rope.half_split_tables(cos, sin)

  def split_heads(y):
    return y.reshape(*y.shape[:-1], heads, hd)

  def qk(proj, norm, mult):
    y = dense(x, rope.to_half_split(proj.kernel[...], hd), rope.to_half_split(proj.bias[...], hd))
    scale = rope.to_half_split(norm.scale[...], hd)
    if scale.shape[-1] == hd:
      y = rms_norm(split_heads(y), scale, norm.eps)
    else:
      y = split_heads(rms_norm(y, scale, norm.eps))
    y = rope.apply_rope_half(y, cos2, sin2)
    return (y * mult if mult != 1.0 else y).astype(x.dtype)

  return qk(to_q, norm_q, 1.0 / math.sqrt(hd)), qk(to_k, norm_k, 1.0), split_heads(to_v(x))


def multihead_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_mask: jax.Array | None,
    implementation: str = 'auto',
    token_mesh: Mesh | None = None,
) -> jax.Array:
  """q, k, v [B, S, H, Dh] (q pre-scaled, as from project_qkv), key_mask [B, S] bool or None ->
  [B, S, H*Dh]: the shared attention (models/attention/kernels.py, `implementation` as there), heads
  merged back in order; each sample's tokens split over `token_mesh`'s devices
  (models/attention/sequence_parallel.py; None: no split).
  """
  attend = functools.partial(attention_lib.attention, implementation=implementation)
  out = sequence_parallel.attention(q, k, v, key_mask, attend, token_mesh)
  return out.reshape(*out.shape[:2], -1)


class QKVProjection(nnx.Module):
  """Q/K/V projections of one token stream with per-head RMSNorm on Q and K and RoPE, under
  diffusers' attention names (to_q, to_k, to_v, norm_q, norm_k). The attentions build on it:
  flux.SingleStreamAttention (one stream, no output projection), mmdit.JointAttention (a second
  stream and the output projections).

  config: any transformer config with inner_dim, attention_head_dim, num_attention_heads, eps and
  attention (models/attention/kernels.py's implementation). norm_across_heads: q and k are RMS-normed over
  all heads at once (Wan) instead of per head."""

  def __init__(
      self,
      config: Any,
      *,
      rngs: nnx.Rngs,
      param_dtype: Any = jnp.float32,
      norm_across_heads: bool = False,
  ):
    d, hd = config.inner_dim, config.attention_head_dim
    self.heads = config.num_attention_heads
    self.implementation = config.attention
    self.to_q = linear(d, d, rngs, param_dtype)
    self.to_k = linear(d, d, rngs, param_dtype)
    self.to_v = linear(d, d, rngs, param_dtype)
    norm_width = d if norm_across_heads else hd
    self.norm_q = RMSNorm(norm_width, config.eps, param_dtype=param_dtype)
    self.norm_k = RMSNorm(norm_width, config.eps, param_dtype=param_dtype)

  def project(
      self, x: jax.Array, cos: jax.Array, sin: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, S, D], tables [S, Dh/2] -> q, k, v [B, S, H, Dh] (``project_qkv``)."""
    return project_qkv(
        x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, cos, sin, self.heads
    )
