"""QwenImage double-stream MMDiT transformer in flax NNX.

Matches diffusers' ``QwenImageTransformer2DModel`` (0.42.1, default variant: no guidance embedding, no
``zero_cond_t``, no additional timestep condition, plain ``QwenEmbedRope``) to float32 rounding; see
tests/test_mmdit_parity.py. Weights are loaded from diffusers checkpoints by ``digen_jax.models.convert``.

Layout of our parameters (names mirror diffusers so the converter table reads one-to-one):

  time_embed.linear_1 / linear_2      TimestepEmbedding MLP (256 -> D -> D)
  txt_norm.scale                      RMSNorm over joint_attention_dim
  text_pool.linear_1 / linear_2       only with MMDiTConfig.pooled_text (not QwenImage): pooled prompt -> D -> D
  img_in, txt_in                      input projections to D = heads * head_dim
  blocks.*                            ONE MMDiTBlock whose params carry a leading [num_layers] axis; the forward
                                      pass runs it under lax.scan (one compiled block instead of num_layers copies)
                                      or, with MMDiTConfig.scan_layers=False, as num_layers unrolled calls
  norm_out                            AdaLayerNormContinuous projection (D -> 2D, chunk order: scale, shift)
  proj_out                            D -> patch_size**2 * out_channels

Linear kernels are [in, out] (torch stores [out, in]).

FLUX.1 (digen_jax.models.flux) reuses MMDiTBlock as its double-stream block and the helpers here (embedders, norms,
RoPE, project_qkv / multihead_attention, stacked_blocks / run_stacked). Attention itself is models/attention.py's,
shared by every family.

Precision: matmuls run in the params' dtype (activations are cast to it on entry), so casting every param to
bfloat16 gives a bf16 forward. RMSNorm/LayerNorm statistics, RoPE rotation and the attention softmax run in
float32; the output is float32. One deliberate difference from diffusers: diffusers rounds the timestep to the
compute dtype before the sinusoidal embedding; we keep sigma in float32 there (identical in a float32 forward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from digen_jax.models import attention as attention_lib

# Fixed by diffusers' QwenTimestepProjEmbeddings / FeedForward (not config options there either).
TIMESTEP_CHANNELS = (
    256  # Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)
)
TIMESTEP_SCALE = (
    1000.0  # the pipeline passes sigma = timestep / 1000; the embedding multiplies it back
)
TIMESTEP_MAX_PERIOD = 10000.0
MLP_RATIO = 4  # FeedForward(mult=4, activation_fn="gelu-approximate")


@dataclasses.dataclass(frozen=True)
class MMDiTConfig:
  """Architecture of a QwenImage transformer. Defaults are diffusers' (the 20B QwenImage release)."""

  patch_size: int = 2
  in_channels: int = 64
  out_channels: int = 16
  num_layers: int = 60
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 3584
  axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
  # Hard-coded in diffusers (QwenEmbedRope(theta=10000), eps=1e-6 for every norm); kept as fields so that a
  # variant that changes them is one config line away.
  rope_theta: float = 10000.0
  eps: float = 1e-6
  # Diffusers flags that change the math; only the default (False) variant is implemented.
  guidance_embeds: bool = False
  zero_cond_t: bool = False
  use_additional_t_cond: bool = False
  use_layer3d_rope: bool = False
  # Not a QwenImage flag: FLUX-style pooled text conditioning. The masked mean of the (RMS-normed) text tokens goes
  # through a linear-SiLU-linear projection (``text_pool``, FLUX's PixArtAlphaTextProjection shape) and is added
  # to the timestep embedding, so every block's modulation sees the prompt directly instead of only through
  # attention. False (the default) is diffusers' QwenImage exactly.
  pooled_text: bool = False
  # Execution options; none changes the math or the params.
  # remat: rematerialise each block in the backward pass (jax.checkpoint).
  remat: bool = False
  # scan_layers: run the blocks under lax.scan (one compiled block: compile time independent of num_layers).
  # False unrolls them into a Python loop: compile time grows with num_layers, but under autodiff nothing is
  # stacked across layers (a scan zero-fills [num_layers, ...] residual buffers, writes each layer's residuals
  # into them and slices them back out in the backward pass), which is much of a CPU update's time without remat.
  scan_layers: bool = True
  # attention: models/attention.py's implementation ("auto": cuDNN's fused kernel on a GPU in bf16, the portable
  # XLA path elsewhere; "portable"; "fused"). Same math either way.
  attention: str = "auto"

  def __post_init__(self):
    object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
    for name in (
        "patch_size",
        "in_channels",
        "out_channels",
        "num_layers",
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MMDiTConfig.{name} must be a positive int, got {value!r}")
    if len(self.axes_dims_rope) != 3 or any(a <= 0 or a % 2 for a in self.axes_dims_rope):
      raise ValueError(
          f"MMDiTConfig.axes_dims_rope must be 3 positive even ints (frame, height, width), "
          f"got {self.axes_dims_rope}"
      )
    if sum(self.axes_dims_rope) != self.attention_head_dim:
      raise ValueError(
          f"MMDiTConfig.axes_dims_rope must sum to attention_head_dim={self.attention_head_dim}, "
          f"got sum({self.axes_dims_rope}) = {sum(self.axes_dims_rope)}"
      )
    if not self.rope_theta > 0:
      raise ValueError(f"MMDiTConfig.rope_theta must be > 0, got {self.rope_theta}")
    if not self.eps > 0:
      raise ValueError(f"MMDiTConfig.eps must be > 0, got {self.eps}")
    for name in ("remat", "scan_layers"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"MMDiTConfig.{name} must be a bool, got {getattr(self, name)!r}")
    check_attention_choice("MMDiTConfig", self.attention)
    if self.guidance_embeds:
      raise ValueError(
          "MMDiTConfig.guidance_embeds=True (FLUX-style guidance embedding) is not supported; "
          "QwenImage checkpoints use guidance_embeds=False (FLUX.1 is digen_jax.models.flux)"
      )
    for name in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
      if getattr(self, name):
        raise ValueError(
            f"MMDiTConfig.{name}=True (a QwenImage edit/layered variant) is not supported; "
            f"set {name}=False"
        )

  @property
  def inner_dim(self) -> int:
    return self.num_attention_heads * self.attention_head_dim

  @property
  def out_dim(self) -> int:
    """Channels per output token: patch_size**2 * out_channels."""
    return self.patch_size * self.patch_size * self.out_channels


# ----------------------------------------------------------------------------------------------------------------
# Pure helpers (numpy at trace time for anything that only depends on static shapes).


def timestep_embedding(sigma: jax.Array, scale: float = TIMESTEP_SCALE) -> jax.Array:
  """Sinusoidal embedding of scale*sigma, diffusers Timesteps(256, flip_sin_to_cos=True, shift=0, scale=scale).

  sigma [B] -> [B, 256] float32, order (cos, sin). QwenImage embeds sigma with scale=1000; FLUX multiplies sigma by
  1000 itself and embeds the product with scale=1 (the two round differently in float32, hence the argument).
  """
  half = TIMESTEP_CHANNELS // 2
  # Same op order as diffusers' get_timestep_embedding so float32 results agree bit-for-bit or nearly.
  exponent = (
      np.float32(-math.log(TIMESTEP_MAX_PERIOD))
      * np.arange(half, dtype=np.float32)
      / np.float32(half)
  )
  # exp in float64, rounded once: torch's float32 exp is (nearly always) correctly rounded, numpy's is not (1 ulp
  # off for ~40% of these); at FLUX's guidance 3.5 * 1000 one ulp of a frequency moves a sinusoid by ~2e-4.
  freqs = jnp.asarray(np.exp(exponent.astype(np.float64)).astype(np.float32))
  args = sigma.astype(jnp.float32)[:, None] * freqs[None, :]
  if scale != 1.0:
    args = scale * args
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def _axis_inv_freq(dim: int, theta: float, dtype: Any = np.float32) -> np.ndarray:
  """1 / theta^(2i/dim), i < dim/2, computed in `dtype`: float32 like QwenEmbedRope.rope_params, float64 like
  FluxPosEmbed (get_1d_rotary_pos_embed with freqs_dtype=float64)."""
  return (1.0 / np.power(dtype(theta), np.arange(0, dim, 2, dtype=dtype) / dtype(dim))).astype(
      dtype
  )


def check_attention_choice(owner: str, choice: str) -> None:
  """A model config's `attention` field: a config choice ('auto', 'portable', 'fused') or an implementation of
  models/attention.py ('cudnn', 'xla')."""
  known = tuple(dict.fromkeys(attention_lib.CONFIG_CHOICES + attention_lib.IMPLEMENTATIONS))
  if choice not in known:
    raise ValueError(f"{owner}.attention must be one of {known}, got {choice!r}")


def rope_positions(img_shape: tuple[int, int, int], n_txt: int) -> tuple[np.ndarray, np.ndarray]:
  """QwenEmbedRope positions (scale_rope=True).

  Image token (f, y, x) (row-major over img_shape) gets (f, y - (h - h//2), x - (w - w//2)): height and width
  centred on zero. Text token j gets j + max(h//2, w//2) on all three axes, i.e. text starts after the largest
  image position. Returns (img_pos [F*H*W, 3], txt_pos [n_txt, 3]) int64.
  """
  frames, h, w = img_shape
  f_pos = np.arange(frames)
  h_pos = np.arange(h) - (h - h // 2)
  w_pos = np.arange(w) - (w - w // 2)
  grid = np.stack(np.meshgrid(f_pos, h_pos, w_pos, indexing="ij"), axis=-1).reshape(-1, 3)
  start = max(h // 2, w // 2)
  txt = np.repeat((start + np.arange(n_txt))[:, None], 3, axis=1)
  return grid.astype(np.int64), txt.astype(np.int64)


def rope_cos_sin(
    img_shape: tuple[int, int, int],
    n_txt: int,
    axes_dims: tuple[int, int, int],
    theta: float = 10000.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Rotation tables for image and text tokens, deterministic numpy, float32.

  Returns (img_cos, img_sin [N_img, head_dim/2], txt_cos, txt_sin [n_txt, head_dim/2]); entry i rotates the
  interleaved pair (x[2i], x[2i+1]); the half-dims are split over axes (frame, height, width) as axes_dims/2.
  """
  img_pos, txt_pos = rope_positions(img_shape, n_txt)
  return (*rope_tables(img_pos, axes_dims, theta), *rope_tables(txt_pos, axes_dims, theta))


def rope_tables(
    pos: np.ndarray, axes_dims: tuple[int, ...], theta: float, freqs_dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
  """(cos, sin) [S, sum(axes_dims)/2] float32 for positions pos [S, len(axes_dims)], deterministic numpy.

  Axis a owns axes_dims[a]/2 consecutive entries. Angles are pos * inv_freq in `freqs_dtype` (float32 like
  torch.outer(index, inv_freq) in QwenEmbedRope; float64 in FluxPosEmbed), then cos/sin in float64, rounded once.
  """
  inv = [_axis_inv_freq(d, theta, freqs_dtype) for d in axes_dims]
  ang = np.concatenate(
      [pos[:, a : a + 1].astype(freqs_dtype) * inv[a][None, :] for a in range(len(axes_dims))],
      axis=1,
  )
  ang = ang.astype(np.float64)
  return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate interleaved pairs of x [B, S, H, Dh] by tables [S, Dh/2]; computed in float32, returns x.dtype.

  Reference form of diffusers' rotation (pairs (x[2i], x[2i+1])). The model itself runs the equivalent
  half-split form (``to_half_split`` + ``apply_rope_half``), which needs no stride-2 gathers."""
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  xr, xi = xf[..., 0], xf[..., 1]
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  out = jnp.stack([xr * c - xi * s, xr * s + xi * c], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


def to_half_split(a: jax.Array, head_dim: int) -> jax.Array:
  """Reorder the last axis of `a` (heads * head_dim, or head_dim) within each head from the interleaved RoPE pair
  order (r0, i0, r1, i1, ...) to the half-split order (r0, r1, ..., i0, i1, ...).

  Applied to the Q/K projection kernels and biases and to the Q/K RMSNorm scales it permutes the head dims of q
  and k alike. Attention scores are dot products over the head dims, so they do not change, and the rotation
  becomes two contiguous halves (``apply_rope_half``) instead of stride-2 pairs. A reshape + transpose, so its
  gradient is the inverse transpose."""
  lead, n = a.shape[:-1], a.shape[-1]
  a = a.reshape(*lead, n // head_dim, head_dim // 2, 2)
  return jnp.swapaxes(a, -1, -2).reshape(*lead, n)


def half_split_tables(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[S, Dh/2] rotation tables -> ([cos, cos], [-sin, sin]) [S, Dh] for ``apply_rope_half``."""
  return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def apply_rope_half(x: jax.Array, cos2: jax.Array, sin2: jax.Array) -> jax.Array:
  """RoPE on x [B, S, H, Dh] whose head dims are in half-split order (``to_half_split``), float32:
  (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), with tables [S, Dh] from ``half_split_tables``.
  Equals ``apply_rope`` on the interleaved layout element for element (same products and sums)."""
  half = x.shape[-1] // 2
  swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
  return x * cos2[None, :, None, :] + swapped * sin2[None, :, None, :]


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
  """x [..., in] @ kernel [in, out] + bias [out], as nnx.Linear computes it (inputs already in the params' dtype)."""
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
  return y + bias


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
  """x [B, S, D] -> q, k, v [B, S, heads, Dh] in x.dtype: Linear projections, per-head RMSNorm on q and k, RoPE
  (tables [S, Dh/2]) on q and k, q pre-multiplied by the softmax scale 1/sqrt(Dh).

  q and k come out in the half-split head-dim order (to_half_split): RMSNorm over head dims is order-free once its
  scale is permuted the same way, and RoPE becomes two contiguous halves. Attention scores are the same as with
  diffusers' interleaved layout; v keeps the original order, so the attention output does too. Folding the softmax
  scale into q is exact for power-of-two head dims (one rounding otherwise)."""
  hd = norm_q.scale.shape[-1]
  cos2, sin2 = half_split_tables(cos, sin)

  def split_heads(y):
    return y.reshape(*y.shape[:-1], heads, hd)

  def qk(proj, norm, mult):
    y = dense(x, to_half_split(proj.kernel[...], hd), to_half_split(proj.bias[...], hd))
    y = rms_norm(split_heads(y), to_half_split(norm.scale[...], hd), norm.eps)
    y = apply_rope_half(y, cos2, sin2)
    return (y * mult if mult != 1.0 else y).astype(x.dtype)

  return qk(to_q, norm_q, 1.0 / math.sqrt(hd)), qk(to_k, norm_k, 1.0), split_heads(to_v(x))


def multihead_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_mask: jax.Array | None,
    implementation: str = "auto",
) -> jax.Array:
  """q, k, v [B, S, H, Dh] (q pre-scaled, as from project_qkv), key_mask [B, S] bool or None -> [B, S, H*Dh]:
  the shared attention (models/attention.py, `implementation` as there), heads merged back in order.
  """
  out = attention_lib.attention(q, k, v, key_mask, implementation=implementation)
  return out.reshape(*out.shape[:2], -1)


def stacked_blocks(
    make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs
) -> nnx.Module:
  """ONE module whose params carry a leading [num_layers] axis: make(rngs) vmapped over split rngs (each layer its
  own init). Run it with ``run_stacked``."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_blocks(block_rngs):
    return make(block_rngs)

  return make_blocks(rngs)


def run_stacked(
    blocks: nnx.Module,
    carry: Any,
    call: Callable[[nnx.Module, Any], Any],
    *,
    num_layers: int,
    remat: bool,
    scan_layers: bool,
) -> Any:
  """carry = call(block_i, carry) for the layers i of `blocks` (from ``stacked_blocks``), in order.

  scan_layers: under lax.scan (one compiled block: compile time independent of num_layers), else unrolled.
  remat: rematerialise each layer in the backward pass (jax.checkpoint). See MMDiTConfig for the trade-offs.
  """
  graphdef, block_state = nnx.split(blocks)

  def body(carry, layer_state):
    return call(nnx.merge(graphdef, layer_state), carry), None

  if remat:
    body = jax.checkpoint(body)
  if scan_layers:
    carry, _ = jax.lax.scan(body, carry, block_state)
    return carry
  # One split per stacked param (its transpose is one concatenate of the layers' gradients; indexing a[i] instead
  # would transpose to a zero-padded full-stack gradient per layer).
  parts = jax.tree.map(lambda a: jnp.split(a, num_layers, axis=0), block_state)
  for i in range(num_layers):
    layer_state = jax.tree.map(lambda p: p[i][0], parts, is_leaf=lambda x: isinstance(x, list))
    carry, _ = body(carry, layer_state)
  return carry


# ----------------------------------------------------------------------------------------------------------------
# Modules.


def linear(n_in: int, n_out: int, rngs: nnx.Rngs, param_dtype: Any) -> nnx.Linear:
  # dtype=None: compute in the promoted dtype of input and params; we cast inputs to the params' dtype.
  return nnx.Linear(n_in, n_out, use_bias=True, param_dtype=param_dtype, rngs=rngs)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned scale; statistics in float32 (diffusers RMSNorm)."""

  def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps).astype(x.dtype)


class TimestepEmbedder(nnx.Module):
  """diffusers TimestepEmbedding: linear_1 -> SiLU -> linear_2, on the 256-channel sinusoidal embedding."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.linear_1 = linear(TIMESTEP_CHANNELS, dim, rngs, param_dtype)
    self.linear_2 = linear(dim, dim, rngs, param_dtype)

  def __call__(self, sigma: jax.Array, scale: float = TIMESTEP_SCALE) -> jax.Array:
    """sigma [B] -> [B, dim]; `scale` as in ``timestep_embedding``."""
    emb = timestep_embedding(sigma, scale).astype(self.linear_1.kernel.dtype)
    return self.linear_2(jax.nn.silu(self.linear_1(emb)))


def masked_mean(tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
  """[B, L, C] tokens, [B, L] mask (None = all real) -> [B, C] mean over the real tokens (float32)."""
  t = tokens.astype(jnp.float32)
  if mask is None:
    return jnp.mean(t, axis=1)
  m = mask.astype(jnp.float32)[..., None]
  return jnp.sum(t * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


class TextPoolEmbedder(nnx.Module):
  """Pooled prompt -> timestep-embedding offset: linear_1 -> SiLU -> linear_2 (see MMDiTConfig.pooled_text)."""

  def __init__(self, in_dim: int, dim: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.linear_1 = linear(in_dim, dim, rngs, param_dtype)
    self.linear_2 = linear(dim, dim, rngs, param_dtype)

  def __call__(self, pooled: jax.Array) -> jax.Array:
    return self.linear_2(jax.nn.silu(self.linear_1(pooled.astype(self.linear_1.kernel.dtype))))


class MLP(nnx.Module):
  """diffusers FeedForward(activation_fn='gelu-approximate'): Linear(D, 4D) -> tanh-GELU -> Linear(4D, D)."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.fc1 = linear(dim, MLP_RATIO * dim, rngs, param_dtype)
    self.fc2 = linear(MLP_RATIO * dim, dim, rngs, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class JointAttention(nnx.Module):
  """Joint text+image attention (QwenDoubleStreamAttnProcessor2_0): separate Q/K/V/out projections per stream,
  per-head RMSNorm on Q and K, RoPE, one softmax over the concatenated [text, image] sequence."""

  def __init__(self, config: MMDiTConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    # config: MMDiTConfig, or any config with inner_dim, attention_head_dim, num_attention_heads and eps
    # (flux.FluxConfig: FLUX's double-stream attention is the same computation).
    d, hd = config.inner_dim, config.attention_head_dim
    self.heads = config.num_attention_heads
    self.implementation = config.attention
    self.to_q = linear(d, d, rngs, param_dtype)
    self.to_k = linear(d, d, rngs, param_dtype)
    self.to_v = linear(d, d, rngs, param_dtype)
    self.add_q_proj = linear(d, d, rngs, param_dtype)
    self.add_k_proj = linear(d, d, rngs, param_dtype)
    self.add_v_proj = linear(d, d, rngs, param_dtype)
    self.to_out = linear(d, d, rngs, param_dtype)
    self.to_add_out = linear(d, d, rngs, param_dtype)
    self.norm_q = RMSNorm(hd, config.eps, param_dtype=param_dtype)
    self.norm_k = RMSNorm(hd, config.eps, param_dtype=param_dtype)
    self.norm_added_q = RMSNorm(hd, config.eps, param_dtype=param_dtype)
    self.norm_added_k = RMSNorm(hd, config.eps, param_dtype=param_dtype)

  def __call__(self, img, txt, rope, key_mask):
    """img [B, N, D], txt [B, L, D]; rope = (img_cos, img_sin, txt_cos, txt_sin) [S, Dh/2] tables; key_mask
    [B, L+N] bool (False = padded text key) or None. Returns (img_out [B, N, D],
    txt_out [B, L, D])."""
    img_cos, img_sin, txt_cos, txt_sin = rope
    iq, ik, iv = project_qkv(
        img, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, img_cos, img_sin, self.heads
    )
    tq, tk, tv = project_qkv(
        txt,
        self.add_q_proj,
        self.add_k_proj,
        self.add_v_proj,
        self.norm_added_q,
        self.norm_added_k,
        txt_cos,
        txt_sin,
        self.heads,
    )

    # Order [text, image], as diffusers; the concatenation and the move to head-major [B, H, S, Dh] fuse into
    # one copy.
    def joint(t, i):
      return jnp.concatenate([t, i], axis=1)

    out = multihead_attention(
        joint(tq, iq), joint(tk, ik), joint(tv, iv), key_mask, self.implementation
    )
    n_txt = txt.shape[1]
    return self.to_out(out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


def modulate(x, shift, scale):
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


class MMDiTBlock(nnx.Module):
  """One double-stream block (QwenImageTransformerBlock): AdaLN(shift, scale, gate) x2 per stream.

  Also FLUX's FluxTransformerBlock (same math: AdaLayerNormZero chunks in this order, LayerNorm eps 1e-6, tanh-GELU
  FeedForward x4); its diffusers names differ and are mapped by the FLUX key table (digen_jax.models.flux).
  """

  def __init__(self, config: MMDiTConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    d = config.inner_dim
    self.eps = config.eps
    self.img_mod = linear(d, 6 * d, rngs, param_dtype)
    self.txt_mod = linear(d, 6 * d, rngs, param_dtype)
    self.attn = JointAttention(config, rngs=rngs, param_dtype=param_dtype)
    self.img_mlp = MLP(d, rngs=rngs, param_dtype=param_dtype)
    self.txt_mlp = MLP(d, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, img, txt, temb, rope, key_mask):
    """img [B, N, D], txt [B, L, D], temb [B, D]; rope and key_mask as JointAttention -> (img, txt)."""
    # Chunk order along the 6D axis: (shift1, scale1, gate1, shift2, scale2, gate2).
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = jnp.split(self.img_mod(jax.nn.silu(temb)), 6, axis=-1)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = jnp.split(self.txt_mod(jax.nn.silu(temb)), 6, axis=-1)

    img_attn, txt_attn = self.attn(
        modulate(layer_norm(img, self.eps), i_sh1, i_sc1),
        modulate(layer_norm(txt, self.eps), t_sh1, t_sc1),
        rope,
        key_mask,
    )
    img = img + i_g1[:, None, :] * img_attn
    txt = txt + t_g1[:, None, :] * txt_attn
    img = img + i_g2[:, None, :] * self.img_mlp(modulate(layer_norm(img, self.eps), i_sh2, i_sc2))
    txt = txt + t_g2[:, None, :] * self.txt_mlp(modulate(layer_norm(txt, self.eps), t_sh2, t_sc2))
    return img, txt


class MMDiT(nnx.Module):
  """QwenImage transformer: predicts the flow velocity for packed latent patch tokens."""

  def __init__(self, config: MMDiTConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    if not isinstance(config, MMDiTConfig):
      raise ValueError(f"config must be an MMDiTConfig, got {type(config).__name__}")
    self.config = config
    d = config.inner_dim
    self.time_embed = TimestepEmbedder(d, rngs=rngs, param_dtype=param_dtype)
    self.txt_norm = RMSNorm(config.joint_attention_dim, config.eps, param_dtype=param_dtype)
    self.img_in = linear(config.in_channels, d, rngs, param_dtype)
    self.txt_in = linear(config.joint_attention_dim, d, rngs, param_dtype)
    if config.pooled_text:
      self.text_pool = TextPoolEmbedder(
          config.joint_attention_dim, d, rngs=rngs, param_dtype=param_dtype
      )

    # Stacked blocks: every param gets a leading [num_layers] axis (lax.scan in __call__).
    self.blocks = stacked_blocks(
        lambda r: MMDiTBlock(config, rngs=r, param_dtype=param_dtype), config.num_layers, rngs
    )
    self.norm_out = linear(d, 2 * d, rngs, param_dtype)
    self.proj_out = linear(d, config.out_dim, rngs, param_dtype)

  def __call__(
      self,
      latents: jax.Array,
      sigma: jax.Array,
      text: jax.Array,
      text_mask: jax.Array | None,
      *,
      img_shape: tuple[int, int, int],
  ) -> jax.Array:
    """latents [B, N_img, in_channels] packed patch tokens; sigma [B] in [0, 1]; text [B, L, joint_attention_dim];
    text_mask [B, L] (1 = real token, 0 = padding) or None (all real); img_shape = (frames, h_tokens, w_tokens)
    static ints with frames*h*w == N_img. Returns [B, N_img, patch_size**2 * out_channels] float32.
    """
    cfg = self.config
    b, n_img, n_txt = self._check_inputs(latents, sigma, text, text_mask, img_shape)
    dtype = self.img_in.kernel.dtype

    img = self.img_in(latents.astype(dtype))
    txt_normed = self.txt_norm(text.astype(dtype))
    txt = self.txt_in(txt_normed)
    temb = self.time_embed(sigma)
    if cfg.pooled_text:
      temb = temb + self.text_pool(masked_mean(txt_normed, text_mask))

    rope = tuple(
        jnp.asarray(t) for t in rope_cos_sin(img_shape, n_txt, cfg.axes_dims_rope, cfg.rope_theta)
    )
    if text_mask is None:
      key_mask = None
    else:
      # Padded text keys are hidden from every query; image keys are always visible, so no row is empty.
      key_mask = jnp.concatenate([text_mask.astype(bool), jnp.ones((b, n_img), bool)], axis=1)

    img, _ = run_stacked(
        self.blocks,
        (img, txt),
        lambda block, c: block(*c, temb, rope, key_mask),
        num_layers=cfg.num_layers,
        remat=cfg.remat,
        scan_layers=cfg.scan_layers,
    )

    scale, shift = jnp.split(self.norm_out(jax.nn.silu(temb)), 2, axis=-1)
    img = modulate(layer_norm(img, cfg.eps), shift, scale)
    return self.proj_out(img).astype(jnp.float32)

  def _check_inputs(self, latents, sigma, text, text_mask, img_shape):
    cfg = self.config
    if latents.ndim != 3 or latents.shape[-1] != cfg.in_channels:
      raise ValueError(
          f"latents must be [B, N_img, in_channels={cfg.in_channels}], got {latents.shape}"
      )
    b, n_img = latents.shape[:2]
    if (
        not isinstance(img_shape, (tuple, list))
        or len(img_shape) != 3
        or any(not isinstance(s, (int, np.integer)) or s <= 0 for s in img_shape)
    ):
      raise ValueError(
          f"img_shape must be 3 positive static ints (frames, h_tokens, w_tokens), got {img_shape!r}"
      )
    if int(np.prod(img_shape)) != n_img:
      raise ValueError(
          f"img_shape {tuple(img_shape)} has {int(np.prod(img_shape))} tokens but latents has "
          f"N_img={n_img}; pass img_shape=(frames, h_tokens, w_tokens) of the packed latents"
      )
    if sigma.shape != (b,):
      raise ValueError(f"sigma must be [B={b}], got {sigma.shape}")
    if text.ndim != 3 or text.shape[0] != b or text.shape[-1] != cfg.joint_attention_dim:
      raise ValueError(
          f"text must be [B={b}, L, joint_attention_dim={cfg.joint_attention_dim}], "
          f"got {text.shape}"
      )
    if text_mask is not None and text_mask.shape != text.shape[:2]:
      raise ValueError(f"text_mask must be [B, L]={text.shape[:2]}, got {text_mask.shape}")
    return b, n_img, text.shape[1]


# ----------------------------------------------------------------------------------------------------------------
# Analytic sizes.


def count_params(config: MMDiTConfig) -> int:
  """Number of parameters of MMDiT(config) (equals diffusers' model for the same config)."""
  d, j, hd = config.inner_dim, config.joint_attention_dim, config.attention_head_dim

  def lin(i, o):
    return i * o + o

  return (
      lin(TIMESTEP_CHANNELS, d)
      + lin(d, d)
      + j
      + lin(config.in_channels, d)
      + lin(j, d)
      + config.num_layers * block_param_count(d, hd)
      + lin(d, 2 * d)
      + lin(d, config.out_dim)
  )


def block_param_count(d: int, head_dim: int) -> int:
  """Number of parameters of one MMDiTBlock of width d."""

  def lin(i, o):
    return i * o + o

  return (
      2 * lin(d, 6 * d)  # img_mod, txt_mod
      + 8 * lin(d, d)  # q/k/v/out for both streams
      + 4 * head_dim  # q/k RMSNorm scales, both streams
      + 2 * (lin(d, MLP_RATIO * d) + lin(MLP_RATIO * d, d))
  )


def flops_per_forward(config: MMDiTConfig, batch: int, n_img: int, n_txt: int) -> float:
  """Analytic matmul FLOPs (2 per multiply-add) of one forward on `batch` samples with n_img image and n_txt text
  tokens: every Linear plus the two attention matmuls (QK^T, PV). Norms, RoPE, softmax and activations are
  excluded (they are O(tokens * D), negligible next to the matmuls)."""
  d, j = config.inner_dim, config.joint_attention_dim
  s = n_img + n_txt
  per_sample = (
      TIMESTEP_CHANNELS * d
      + d * d  # time embedding (one row per sample)
      + n_img * config.in_channels * d
      + n_txt * j * d
  )
  per_sample += config.num_layers * block_macs(d, s) + d * 2 * d + n_img * d * config.out_dim
  return 2.0 * batch * per_sample


def block_macs(d: int, s: int) -> int:
  """Matmul multiply-adds of one MMDiTBlock of width d on one sample of s = n_img + n_txt tokens."""
  return (
      2 * d * 6 * d  # modulation (one row per sample per stream)
      + s * 4 * d * d  # q, k, v, out projections, either stream
      + s * 2 * MLP_RATIO * d * d  # MLP fc1 + fc2
      + 2 * s * s * d
  )  # QK^T and PV over all heads
