"""Wan2.1 video transformer (text-to-video) in flax NNX.

Matches diffusers' ``WanTransformer3DModel`` (0.42.1; the Wan2.1 T2V layout: no image
conditioning) to float32 rounding; see tests/core/models/test_wan_parity.py. Weights are loaded from diffusers
checkpoints by ``digen_jax.models.io.wan_convert``.

A video latent [B, F, H, W, C] enters as packed tokens [B, F*(H/p)*(W/p), C*p*p]
(latents.pack_frames: frame-major, then rows and columns, channel-major inside a token, as every
family packs), so
diffusers' 1 x p x p Conv3d patch embedding is one Linear over a token. Each of the num_layers
blocks runs:

  * self-attention over all video tokens: q/k/v projections, RMSNorm on q and k across all heads
    (not per head), 3-D RoPE over (frame, row, column), no mask;
  * cross-attention from the video tokens to the projected umT5 text: q/k RMS-normed across heads,
    no RoPE and no mask (WanPipeline pads the text with zero embeddings to 512 tokens and every
    position is attended), after an affine LayerNorm (cross_attn_norm);
  * a tanh-GELU feed-forward of width ffn_dim.

Self-attention and feed-forward are modulated (shift, scale, gate) by the timestep: each block adds
its own learned table [1, 6, D] to one shared projection of the time embedding (time_proj, D -> 6D);
the output head does the same with a [1, 2, D] table (shift, scale) and the time embedding itself.

Layout of our parameters (diffusers name in brackets):

  img_in.kernel [C, p, p, D], .bias   [patch_embedding] Conv3d weight [D, C, 1, p, p]
  time_embed.linear_1 / linear_2      [condition_embedder.time_embedder] 256 -> D -> D
  time_proj                           [condition_embedder.time_proj] D -> 6D
  text_embed.linear_1 / linear_2      [condition_embedder.text_embedder] text_dim -> D -> D
  blocks.*                            [blocks.{i}] ONE WanBlock stacked over num_layers
    attn1, attn2                      to_q, to_k, to_v, to_out [to_out.0], norm_q, norm_k [D]
    norm2.scale / .bias               [norm2.weight / .bias] only with cross_attn_norm
    ffn.fc1 / fc2                     [ffn.net.0.proj / ffn.net.2]
    scale_shift_table [1, 6, D]
  proj_out                            D -> p*p*out_channels (outputs in diffusers' (row,
                                      column, channel) order; the forward returns them
                                      channel-major, as tokens are packed)
  scale_shift_table [1, 2, D]

Precision as in mmdit.py: matmuls in the params' dtype, norms / RoPE / softmax statistics and the
modulation in float32, float32 output; the timestep stays float32 before the sinusoidal embedding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from digen_jax.models.transformers import dit
from digen_jax.models.attention import sequence_parallel
from digen_jax.models.transformers.layers import (
    MLP,
    TIMESTEP_CHANNELS,
    TIMESTEP_SCALE,
    QKVProjection,
    TextPoolEmbedder,
    TimestepEmbedder,
    dense,
    layer_norm,
    linear,
    linear_param_count,
    modulate,
    multihead_attention,
    rms_norm,
)
from digen_jax.models.transformers.rope import rope_tables
from digen_jax.models.transformers.stacking import stacked_blocks

# diffusers' WanTransformerBlock reads the time projection as (shift, scale, gate) for the
# self-attention, then the same for the feed-forward.
MODULATION_CHUNKS = 6


def rope_axes(head_dim: int) -> tuple[int, int, int]:
  """WanRotaryPosEmbed's split of the head dims over (frame, height, width): height and width get
  2 * (head_dim // 6) each, frames the rest (44, 42, 42 for head_dim 128)."""
  hw = 2 * (head_dim // 6)
  return head_dim - 2 * hw, hw, hw


@dataclasses.dataclass(frozen=True)
class WanConfig(dit.TransformerConfig):
  """Architecture of a Wan2.1 transformer. Defaults are diffusers' (the 14B model; 1.3B is
  num_layers=30, num_attention_heads=12, ffn_dim=8960). Field names are diffusers' config keys
  except joint_attention_dim (diffusers' text_dim, as every family names the text width) and
  patch_size (the spatial p of diffusers' (1, p, p)). axes_dims_rope is derived from the head dim
  (None: rope_axes(attention_head_dim)); eps and the execution options are
  dit.TransformerConfig's."""

  SIZE_FIELDS = (
      "patch_size",
      "in_channels",
      "out_channels",
      "num_layers",
      "attention_head_dim",
      "num_attention_heads",
      "joint_attention_dim",
      "ffn_dim",
      "rope_max_seq_len",
  )
  BOOL_FIELDS = ("cross_attn_norm",)
  ROPE_AXES = "frame, height, width"

  patch_size: int = 2
  in_channels: int = 16  # the VAE latent's channels (diffusers' meaning; tokens hold p*p of them)
  out_channels: int = 16
  num_layers: int = 40
  attention_head_dim: int = 128
  num_attention_heads: int = 40
  joint_attention_dim: int = 4096  # umT5-XXL's width
  ffn_dim: int = 13824
  cross_attn_norm: bool = True
  # Positions per axis that diffusers' RoPE table covers (frames, rows, columns of tokens).
  rope_max_seq_len: int = 1024
  axes_dims_rope: tuple[int, int, int] | None = None

  def __post_init__(self):
    derived = rope_axes(self.attention_head_dim)
    if self.axes_dims_rope is None:
      object.__setattr__(self, "axes_dims_rope", derived)
    elif tuple(self.axes_dims_rope) != derived:
      raise ValueError(
          f"WanConfig.axes_dims_rope is fixed by attention_head_dim={self.attention_head_dim}: "
          f"{derived} (diffusers' WanRotaryPosEmbed), got {tuple(self.axes_dims_rope)}"
      )
    super().__post_init__()

  @property
  def token_channels(self) -> int:
    """Channels per packed input token: p*p latent pixels of in_channels each."""
    return self.patch_size * self.patch_size * self.in_channels


def rope_cos_sin(
    img_shape: tuple[int, int, int], axes_dims: tuple[int, int, int], theta: float = 10000.0
) -> tuple[np.ndarray, np.ndarray]:
  """WanRotaryPosEmbed tables for a (frames, h_tokens, w_tokens) grid, tokens frame-major: (cos,
  sin) [F*H*W, head_dim/2] float32, positions counted from 0 on every axis, angles in float64."""
  grid = np.stack(np.meshgrid(*(np.arange(n) for n in img_shape), indexing="ij"), axis=-1)
  return rope_tables(grid.reshape(-1, 3), axes_dims, theta, freqs_dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# Modules.


class PatchEmbedding(nnx.Module):
  """diffusers' Conv3d(in_channels, D, kernel=stride=(1, p, p)) on packed tokens: a Linear whose
  kernel is held as [C, p, p, D] (the checkpoint's [D, C, 1, p, p] transposed, the size-1 time
  axis dropped), flattened channel-major as latents.pack orders a token."""

  def __init__(self, config: WanConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    p, d = config.patch_size, config.inner_dim
    init = nnx.initializers.lecun_normal(in_axis=(0, 1, 2), out_axis=3)
    self.kernel = nnx.Param(init(rngs.params(), (config.in_channels, p, p, d), param_dtype))
    self.bias = nnx.Param(jnp.zeros((d,), param_dtype))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """[B, N, C*p*p] -> [B, N, D] in the params' dtype."""
    kernel = self.kernel[...]
    return dense(tokens.astype(kernel.dtype), kernel.reshape(-1, kernel.shape[-1]), self.bias[...])


class TextProjection(TextPoolEmbedder):
  """diffusers PixArtAlphaTextProjection(act_fn='gelu_tanh') on every text token: linear_1 ->
  tanh-GELU -> linear_2 (TextPoolEmbedder's layers; FLUX's pooled projection uses SiLU)."""

  def __call__(self, text: jax.Array) -> jax.Array:
    """[B, L, text_dim] -> [B, L, D]."""
    h = self.linear_1(text.astype(self.linear_1.kernel.dtype))
    return self.linear_2(jax.nn.gelu(h, approximate=True))


class AffineLayerNorm(nnx.Module):
  """diffusers FP32LayerNorm(elementwise_affine=True): statistics and affine in float32."""

  def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = layer_norm(x.astype(jnp.float32), self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...]).astype(x.dtype)


class WanAttention(QKVProjection):
  """WanAttention: q/k/v projections, RMSNorm on q and k across all heads, softmax attention
  (models/attention/kernels.py, no mask), to_out. Self-attention rotates q and k (RoPE); cross-attention
  takes k and v from the text and rotates nothing."""

  def __init__(self, config: WanConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    super().__init__(config, rngs=rngs, param_dtype=param_dtype, norm_across_heads=True)
    self.to_out = linear(config.inner_dim, config.inner_dim, rngs, param_dtype)

  def self_attention(
      self, x: jax.Array, cos: jax.Array, sin: jax.Array, token_mesh: Mesh | None = None
  ) -> jax.Array:
    """x [B, S, D], RoPE tables [S, Dh/2] -> [B, S, D]; token_mesh as
    layers.multihead_attention."""
    q, k, v = self.project(x, cos, sin)
    return self.to_out(multihead_attention(q, k, v, None, self.implementation, token_mesh))

  def cross_attention(
      self, x: jax.Array, context: jax.Array, token_mesh: Mesh | None = None
  ) -> jax.Array:
    """x [B, S, D] queries, context [B, L, D] keys and values -> [B, S, D]; token_mesh as
    layers.multihead_attention (the queries split, the keys whole)."""

    def heads(y):
      return y.reshape(*y.shape[:-1], self.heads, -1)

    head_dim = self.to_q.kernel.shape[-1] // self.heads
    q = rms_norm(self.to_q(x), self.norm_q.scale[...], self.norm_q.eps)
    q = (q * (1.0 / math.sqrt(head_dim))).astype(x.dtype)
    k = rms_norm(self.to_k(context), self.norm_k.scale[...], self.norm_k.eps).astype(x.dtype)
    v = heads(self.to_v(context))
    out = multihead_attention(heads(q), heads(k), v, None, self.implementation, token_mesh)
    return self.to_out(out)


class WanBlock(nnx.Module):
  """WanTransformerBlock: modulated self-attention, cross-attention to the text, modulated
  feed-forward; the modulation is the block's table plus the shared time projection."""

  def __init__(self, config: WanConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    d = config.inner_dim
    self.eps = config.eps
    self.attn1 = WanAttention(config, rngs=rngs, param_dtype=param_dtype)
    self.attn2 = WanAttention(config, rngs=rngs, param_dtype=param_dtype)
    self.norm2 = (
        AffineLayerNorm(d, config.eps, param_dtype=param_dtype) if config.cross_attn_norm else None
    )
    self.ffn = MLP(d, rngs=rngs, param_dtype=param_dtype, hidden_dim=config.ffn_dim)
    table = jax.random.normal(rngs.params(), (1, MODULATION_CHUNKS, d)) / math.sqrt(d)
    self.scale_shift_table = nnx.Param(table.astype(param_dtype))

  def __call__(self, x, context, time_proj, rope, token_mesh: Mesh | None = None):
    """x [B, N, D] video tokens, context [B, L, D] projected text, time_proj [B, 6, D] float32,
    rope = (cos, sin) [N, Dh/2] -> [B, N, D]; token_mesh as layers.multihead_attention."""
    mod = self.scale_shift_table[...].astype(jnp.float32) + time_proj
    shift1, scale1, gate1, shift2, scale2, gate2 = (mod[:, i] for i in range(MODULATION_CHUNKS))
    dtype = x.dtype

    def modulated_norm(y, shift, scale):
      return modulate(layer_norm(y.astype(jnp.float32), self.eps), shift, scale).astype(dtype)

    def gated_residual(y, branch, gate):
      return (y.astype(jnp.float32) + branch.astype(jnp.float32) * gate[:, None, :]).astype(dtype)

    x = gated_residual(
        x, self.attn1.self_attention(modulated_norm(x, shift1, scale1), *rope, token_mesh), gate1
    )
    h = x if self.norm2 is None else self.norm2(x)
    x = x + self.attn2.cross_attention(h, context, token_mesh).astype(dtype)
    return gated_residual(x, self.ffn(modulated_norm(x, shift2, scale2)), gate2)


class Wan(dit.TransformerModel):
  """Wan2.1 transformer: predicts the flow velocity for packed video latent tokens."""

  CONFIG = WanConfig

  def __init__(self, config: WanConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    super().__init__(config)
    d = config.inner_dim
    self.img_in = PatchEmbedding(config, rngs=rngs, param_dtype=param_dtype)
    self.time_embed = TimestepEmbedder(d, rngs=rngs, param_dtype=param_dtype)
    self.time_proj = linear(d, MODULATION_CHUNKS * d, rngs, param_dtype)
    self.text_embed = TextProjection(
        config.joint_attention_dim, d, rngs=rngs, param_dtype=param_dtype
    )
    self.blocks = stacked_blocks(
        lambda r: WanBlock(config, rngs=r, param_dtype=param_dtype), config.num_layers, rngs
    )
    self.proj_out = linear(d, config.out_dim, rngs, param_dtype)
    table = jax.random.normal(rngs.params(), (1, 2, d)) / math.sqrt(d)
    self.scale_shift_table = nnx.Param(table.astype(param_dtype))

  def __call__(
      self,
      latents: jax.Array,
      sigma: jax.Array,
      text: jax.Array,
      *,
      img_shape: tuple[int, int, int],
      token_mesh: Mesh | None = None,
  ) -> jax.Array:
    """latents [B, N_img, p*p*in_channels] packed video tokens (latents.pack_frames); sigma [B] in
    [0, 1] (the pipeline's timestep / 1000); text [B, L, joint_attention_dim] umT5 embeddings,
    zero past each prompt's length, every position attended (WanPipeline passes no mask);
    img_shape = (frames, h_tokens, w_tokens) static ints with product N_img; token_mesh: the
    (samples, tokens) mesh each sample's tokens are split over (models/attention/sequence_parallel.py;
    None: no split). Returns [B, N_img, p*p*out_channels] float32, tokens in the same order."""
    cfg = self.config
    b, _, _ = self._check_inputs(latents, sigma, text, img_shape)
    cos, sin = rope_cos_sin(img_shape, cfg.axes_dims_rope, cfg.rope_theta)
    rope = (jnp.asarray(cos), jnp.asarray(sin))

    # With a token mesh, each sample's tokens lie split over devices between the attentions too.
    x = sequence_parallel.constrain(self.img_in(latents), token_mesh)
    # diffusers: the pipeline's timestep (1000 sigma), then Timesteps(scale=1).
    temb = self.time_embed(TIMESTEP_SCALE * sigma.astype(jnp.float32), scale=1.0)
    time_proj = self.time_proj(jax.nn.silu(temb)).astype(jnp.float32)
    time_proj = time_proj.reshape(b, MODULATION_CHUNKS, cfg.inner_dim)
    context = self.text_embed(text)
    x = self.run_blocks(
        self.blocks,
        x,
        lambda block, x: sequence_parallel.constrain(
            block(x, context, time_proj, rope, token_mesh), token_mesh
        ),
        cfg.num_layers,
    )
    return self.output(x, temb)

  def output(self, tokens: jax.Array, temb: jax.Array) -> jax.Array:
    """The output head: LayerNorm modulated by (shift, scale) = table + temb, then proj_out.
    tokens [B, N, D], temb [B, D] -> [B, N, out_dim] float32."""
    mod = self.scale_shift_table[...].astype(jnp.float32) + temb.astype(jnp.float32)[:, None]
    x = modulate(layer_norm(tokens.astype(jnp.float32), self.config.eps), mod[:, 0], mod[:, 1])
    out = self.proj_out(x.astype(tokens.dtype)).astype(jnp.float32)
    # diffusers' proj_out orders a token's outputs (row, column, channel); the packed layout every
    # family shares (latents.pack) is channel-major.
    p = self.config.patch_size
    out = out.reshape(*out.shape[:2], p, p, self.config.out_channels)
    return jnp.moveaxis(out, -1, -3).reshape(*out.shape[:2], -1)

  def _check_inputs(self, latents, sigma, text, img_shape):
    cfg = self.config
    b, n_img, n_txt = dit.check_token_inputs(cfg, latents, sigma, text)
    if not dit.is_static_shape(img_shape, 3):
      raise ValueError(
          "img_shape must be 3 positive static ints (frames, h_tokens, w_tokens), "
          f"got {img_shape!r}"
      )
    if int(np.prod(img_shape)) != n_img:
      raise ValueError(
          f"img_shape {tuple(img_shape)} has {int(np.prod(img_shape))} tokens but latents has "
          f"N_img={n_img}; pass img_shape=(frames, h_tokens, w_tokens) of the packed latents"
      )
    if max(img_shape) > cfg.rope_max_seq_len:
      raise ValueError(
          f"img_shape {tuple(img_shape)} exceeds rope_max_seq_len={cfg.rope_max_seq_len} "
          "positions on an axis (diffusers' RoPE table ends there)"
      )
    return b, n_img, n_txt


# ----------------------------------------------------------------------------------------------
# Analytic sizes.


def block_param_count(config: WanConfig) -> int:
  """Number of parameters of one WanBlock."""
  d = config.inner_dim
  attention = 4 * linear_param_count(d, d) + 2 * d  # q, k, v, out; q/k norms across heads
  return (
      2 * attention
      + (2 * d if config.cross_attn_norm else 0)
      + linear_param_count(d, config.ffn_dim)
      + linear_param_count(config.ffn_dim, d)
      + MODULATION_CHUNKS * d
  )


def count_params(config: WanConfig) -> int:
  """Number of parameters of Wan(config) (equals diffusers' model for the same config)."""
  d = config.inner_dim
  return (
      linear_param_count(config.token_channels, d)  # patch embedding
      + TimestepEmbedder.param_count(d)
      + linear_param_count(d, MODULATION_CHUNKS * d)
      + linear_param_count(config.joint_attention_dim, d)
      + linear_param_count(d, d)  # text projection
      + config.num_layers * block_param_count(config)
      + linear_param_count(d, config.out_dim)
      + 2 * d  # output scale_shift_table
  )


def flops_per_forward(config: WanConfig, batch: int, n_img: int, n_txt: int) -> float:
  """Analytic matmul FLOPs (2 per multiply-add) of one forward on `batch` samples of n_img video
  tokens and n_txt text tokens: every Linear plus the attention matmuls (QK^T, PV); norms, RoPE,
  softmax and activations excluded (as mmdit.flops_per_forward)."""
  d = config.inner_dim
  per_sample = (
      n_img * config.token_channels * d
      + TIMESTEP_CHANNELS * d
      + d * d
      + d * MODULATION_CHUNKS * d  # time embedding and projection (one row per sample)
      + n_txt * (config.joint_attention_dim * d + d * d)
  )
  block = (
      n_img * 4 * d * d
      + 2 * n_img * n_img * d  # self-attention
      + n_img * 2 * d * d
      + n_txt * 2 * d * d
      + 2 * n_img * n_txt * d  # cross-attention
      + n_img * 2 * d * config.ffn_dim
  )
  per_sample += config.num_layers * block + n_img * d * config.out_dim
  return 2.0 * batch * per_sample
