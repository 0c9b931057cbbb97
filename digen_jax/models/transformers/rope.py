"""Rotary position embeddings shared by every transformer family (QwenImage, FLUX, video to come).

A family turns its tokens' positions into integer ids [S, n_axes] (QwenImage: centred
(frame, row, col) for image tokens; FLUX: (0, row, col)); `rope_tables` turns ids into rotation
tables and the attention rotates q and k with them. Head dim i < head_dim/2 rotates the pair
(x[2i], x[2i+1]) (diffusers' interleaved layout); axis a owns axes_dims[a]/2 consecutive pairs.

The models run the rotation in the equivalent half-split form: `to_half_split` permutes the q/k
projections' output dims once, `half_split_tables` widens the tables, and `apply_rope_half`
rotates two contiguous halves, which needs no stride-2 gathers. `apply_rope` is the interleaved
reference form.

Tables are numpy, built at trace time from static shapes; the rotation is float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def axis_inv_freq(dim: int, theta: float, dtype: Any = np.float32) -> np.ndarray:
  """1 / theta^(2i/dim), i < dim/2, computed in `dtype`: float32 like QwenEmbedRope.rope_params,
  float64 like FluxPosEmbed (get_1d_rotary_pos_embed with freqs_dtype=float64)."""
  return (1.0 / np.power(dtype(theta), np.arange(0, dim, 2, dtype=dtype) / dtype(dim))).astype(
      dtype
  )


def rope_tables(
    pos: np.ndarray, axes_dims: tuple[int, ...], theta: float, freqs_dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
  """(cos, sin) [S, sum(axes_dims)/2] float32 for positions pos [S, len(axes_dims)].

  Axis a owns axes_dims[a]/2 consecutive entries. Angles are pos * inv_freq in `freqs_dtype`
  (float32 like torch.outer(index, inv_freq) in QwenEmbedRope; float64 in FluxPosEmbed), then
  cos/sin in float64, rounded once.
  """
  inv = [axis_inv_freq(d, theta, freqs_dtype) for d in axes_dims]
  ang = np.concatenate(
      [pos[:, a : a + 1].astype(freqs_dtype) * inv[a][None, :] for a in range(len(axes_dims))],
      axis=1,
  )
  ang = ang.astype(np.float64)
  return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate interleaved pairs of x [B, S, H, Dh] by tables [S, Dh/2]; float32 inside, x.dtype out.

  Reference form of diffusers' rotation (pairs (x[2i], x[2i+1])). The models run the equivalent
  half-split form (``to_half_split`` + ``apply_rope_half``)."""
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  xr, xi = xf[..., 0], xf[..., 1]
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  out = jnp.stack([xr * c - xi * s, xr * s + xi * c], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


def to_half_split(a: jax.Array, head_dim: int) -> jax.Array:
  """Reorder the last axis of `a` (heads * head_dim, or head_dim) within each head from the
  interleaved pair order (r0, i0, r1, i1, ...) to the half-split order (r0, r1, ..., i0, i1, ...).

  Applied to the Q/K projection kernels and biases and to the Q/K RMSNorm scales it permutes the
  head dims of q and k alike. Attention scores are dot products over the head dims, so they do
  not change, and the rotation becomes two contiguous halves (``apply_rope_half``). A reshape +
  transpose, so its gradient is the inverse transpose."""
  lead, n = a.shape[:-1], a.shape[-1]
  a = a.reshape(*lead, n // head_dim, head_dim // 2, 2)
  return jnp.swapaxes(a, -1, -2).reshape(*lead, n)


def half_split_tables(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[S, Dh/2] rotation tables -> ([cos, cos], [-sin, sin]) [S, Dh] for ``apply_rope_half``."""
  return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def apply_rope_half(x: jax.Array, cos2: jax.Array, sin2: jax.Array) -> jax.Array:
  """RoPE on x [B, S, H, Dh] whose head dims are in half-split order (``to_half_split``):
  (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), with tables [S, Dh] from
  ``half_split_tables``. Equals ``apply_rope`` on the interleaved layout element for element
  (same products and sums)."""
  half = x.shape[-1] // 2
  swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
  return x * cos2[None, :, None, :] + swapped * sin2[None, :, None, :]
