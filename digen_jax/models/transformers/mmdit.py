"""QwenImage double-stream MMDiT transformer in flax NNX.

Matches diffusers' ``QwenImageTransformer2DModel`` (0.42.1, default variant: no guidance
embedding, no ``zero_cond_t``, no additional timestep condition, plain ``QwenEmbedRope``) to
float32 rounding; see tests/core/models/test_mmdit_parity.py. Weights are loaded from diffusers checkpoints
by ``digen_jax.models.io.convert``.

Layout of our parameters (names mirror diffusers so the converter table reads one-to-one):

  time_embed.linear_1 / linear_2  TimestepEmbedding MLP (256 -> D -> D)
  txt_norm.scale                  RMSNorm over joint_attention_dim
  text_pool.linear_1 / linear_2   only with MMDiTConfig.pooled_text (not QwenImage): pooled
                                  prompt -> D -> D
  img_in, txt_in                  input projections to D = heads * head_dim
  blocks.*                        ONE MMDiTBlock whose params carry a leading [num_layers] axis;
                                  the forward pass runs it under lax.scan (one compiled block
                                  instead of num_layers copies) or, with scan_layers=False, as
                                  num_layers unrolled calls (stacking.py)
  norm_out                        AdaLayerNormContinuous projection (D -> 2D, chunk order: scale,
                                  shift)
  proj_out                        D -> patch_size**2 * out_channels

Linear kernels are [in, out] (torch stores [out, in]).

The pieces every family shares live in their own modules: layers.py (norms, embedders, MLP,
modulation, the q/k/v projection, the output head), rope.py, stacking.py (block stacks) and
dit.py (the config and model bases, input checks). FLUX.1 (digen_jax.models.transformers.flux) reuses
MMDiTBlock as its double-stream block. Attention itself is models/attention/kernels.py's, shared by every
family.

Precision: matmuls run in the params' dtype (activations are cast to it on entry), so casting
every param to bfloat16 gives a bf16 forward. RMSNorm/LayerNorm statistics, RoPE rotation and the
attention softmax run in float32; the output is float32. One deliberate difference from
diffusers: diffusers rounds the timestep to the compute dtype before the sinusoidal embedding; we
keep sigma in float32 there (identical in a float32 forward).
"""

from __future__ import annotations

import dataclasses
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
    MLP_RATIO,
    TIMESTEP_CHANNELS,
    RMSNorm,
    QKVProjection,
    TextPoolEmbedder,
    TimestepEmbedder,
    layer_norm,
    linear,
    linear_param_count,
    masked_mean,
    modulate,
    multihead_attention,
    output_layers,
    project_qkv,
)
from digen_jax.models.transformers.rope import rope_tables
from digen_jax.models.transformers.stacking import stacked_blocks


@dataclasses.dataclass(frozen=True)
class MMDiTConfig(dit.TransformerConfig):
  """Architecture of a QwenImage transformer. Defaults are diffusers' (the 20B QwenImage release);
  rotary axes, eps and the execution options are dit.TransformerConfig's."""

  SIZE_FIELDS = (
      "patch_size",
      "in_channels",
      "out_channels",
      "num_layers",
      "attention_head_dim",
      "num_attention_heads",
      "joint_attention_dim",
  )
  ROPE_AXES = "frame, height, width"

  patch_size: int = 2
  in_channels: int = 64
  out_channels: int = 16
  num_layers: int = 60
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 3584
  # Diffusers flags that change the math; only the default (False) variant is implemented.
  guidance_embeds: bool = False
  zero_cond_t: bool = False
  use_additional_t_cond: bool = False
  use_layer3d_rope: bool = False
  # Not a QwenImage flag: FLUX-style pooled text conditioning. The masked mean of the (RMS-normed)
  # text tokens goes through a linear-SiLU-linear projection (``text_pool``, FLUX's
  # PixArtAlphaTextProjection shape) and is added to the timestep embedding, so every block's
  # modulation sees the prompt directly instead of only through attention. False (the default) is
  # diffusers' QwenImage exactly.
  pooled_text: bool = False

  def __post_init__(self):
    super().__post_init__()
    if self.guidance_embeds:
      raise ValueError(
          "MMDiTConfig.guidance_embeds=True (FLUX-style guidance embedding) is not supported; "
          "QwenImage checkpoints use guidance_embeds=False (FLUX.1 is digen_jax.models.transformers.flux)"
      )
    for name in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
      if getattr(self, name):
        raise ValueError(
            f"MMDiTConfig.{name}=True (a QwenImage edit/layered variant) is not supported; "
            f"set {name}=False"
        )


# ----------------------------------------------------------------------------------------------
# QwenEmbedRope positions.


def rope_positions(img_shape: tuple[int, int, int], n_txt: int) -> tuple[np.ndarray, np.ndarray]:
  """QwenEmbedRope positions (scale_rope=True).

  Image token (f, y, x) (row-major over img_shape) gets (f, y - (h - h//2), x - (w - w//2)): height
  and width centred on zero. Text token j gets j + max(h//2, w//2) on all three axes, i.e. text
  starts after the largest image position. Returns (img_pos [F*H*W, 3], txt_pos [n_txt, 3]) int64.
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

  Returns (img_cos, img_sin [N_img, head_dim/2], txt_cos, txt_sin [n_txt, head_dim/2]); entry i
  rotates the interleaved pair (x[2i], x[2i+1]); the half-dims are split over axes (frame, height,
  width) as axes_dims/2.
  """
  img_pos, txt_pos = rope_positions(img_shape, n_txt)
  return (*rope_tables(img_pos, axes_dims, theta), *rope_tables(txt_pos, axes_dims, theta))


class JointAttention(QKVProjection):
  """Joint text+image attention (QwenDoubleStreamAttnProcessor2_0): separate Q/K/V/out projections
  per stream, per-head RMSNorm on Q and K, RoPE, one softmax over the concatenated [text, image]
  sequence. The image stream's projections are QKVProjection's; the text stream's are the add_*
  ones.

  config: MMDiTConfig, or any config QKVProjection takes (flux.FluxConfig: FLUX's double-stream
  attention is the same computation)."""

  def __init__(self, config: Any, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    super().__init__(config, rngs=rngs, param_dtype=param_dtype)
    d, hd = config.inner_dim, config.attention_head_dim
    self.add_q_proj = linear(d, d, rngs, param_dtype)
    self.add_k_proj = linear(d, d, rngs, param_dtype)
    self.add_v_proj = linear(d, d, rngs, param_dtype)
    self.to_out = linear(d, d, rngs, param_dtype)
    self.to_add_out = linear(d, d, rngs, param_dtype)
    self.norm_added_q = RMSNorm(hd, config.eps, param_dtype=param_dtype)
    self.norm_added_k = RMSNorm(hd, config.eps, param_dtype=param_dtype)

  def __call__(self, img, txt, tables, key_mask, token_mesh: Mesh | None = None):
    """img [B, N, D], txt [B, L, D]; tables = (img_cos, img_sin, txt_cos, txt_sin) [S, Dh/2] RoPE
    tables; key_mask [B, L+N] bool (False = padded text key) or None; token_mesh: the devices
    each sample's tokens are split over (models/attention/sequence_parallel.py; None: no split). Returns
    (img_out [B, N, D], txt_out [B, L, D]).
    """
    img_cos, img_sin, txt_cos, txt_sin = tables
    iq, ik, iv = self.project(img, img_cos, img_sin)
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

    # Order [text, image], as diffusers; the concatenation and the move to head-major [B, H, S, Dh]
    # fuse into one copy.
    def joint(t, i):
      return jnp.concatenate([t, i], axis=1)

    out = multihead_attention(
        joint(tq, iq), joint(tk, ik), joint(tv, iv), key_mask, self.implementation, token_mesh
    )
    n_txt = txt.shape[1]
    return self.to_out(out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


class MMDiTBlock(nnx.Module):
  """One double-stream block (QwenImageTransformerBlock): AdaLN(shift, scale, gate) x2 per stream.

  Also FLUX's FluxTransformerBlock (same math: AdaLayerNormZero chunks in this order, LayerNorm eps
  1e-6, tanh-GELU FeedForward x4); its diffusers names differ and are mapped by the FLUX key table
  (digen_jax.models.transformers.flux).
  """

  def __init__(self, config: MMDiTConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    d = config.inner_dim
    self.eps = config.eps
    self.img_mod = linear(d, 6 * d, rngs, param_dtype)
    self.txt_mod = linear(d, 6 * d, rngs, param_dtype)
    self.attn = JointAttention(config, rngs=rngs, param_dtype=param_dtype)
    self.img_mlp = MLP(d, rngs=rngs, param_dtype=param_dtype)
    self.txt_mlp = MLP(d, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, img, txt, temb, tables, key_mask, token_mesh: Mesh | None = None):
    """img [B, N, D], txt [B, L, D], temb [B, D]; tables, key_mask and token_mesh as
    JointAttention -> (img, txt)."""
    # Chunk order along the 6D axis: (shift1, scale1, gate1, shift2, scale2, gate2).
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = jnp.split(self.img_mod(jax.nn.silu(temb)), 6, axis=-1)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = jnp.split(self.txt_mod(jax.nn.silu(temb)), 6, axis=-1)

    img_attn, txt_attn = self.attn(
        modulate(layer_norm(img, self.eps), i_sh1, i_sc1),
        modulate(layer_norm(txt, self.eps), t_sh1, t_sc1),
        tables,
        key_mask,
        token_mesh,
    )
    img = img + i_g1[:, None, :] * img_attn
    txt = txt + t_g1[:, None, :] * txt_attn
    img = img + i_g2[:, None, :] * self.img_mlp(modulate(layer_norm(img, self.eps), i_sh2, i_sc2))
    txt = txt + t_g2[:, None, :] * self.txt_mlp(modulate(layer_norm(txt, self.eps), t_sh2, t_sc2))
    return img, txt


class MMDiT(dit.TransformerModel):
  """QwenImage transformer: predicts the flow velocity for packed latent patch tokens."""

  CONFIG = MMDiTConfig

  def __init__(self, config: MMDiTConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    super().__init__(config)
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
    self.norm_out, self.proj_out = output_layers(d, config.out_dim, rngs, param_dtype)

  def __call__(
      self,
      latents: jax.Array,
      sigma: jax.Array,
      text: jax.Array,
      text_mask: jax.Array | None,
      *,
      img_shape: tuple[int, int, int],
      token_mesh: Mesh | None = None,
  ) -> jax.Array:
    """latents [B, N_img, in_channels] packed patch tokens; sigma [B] in [0, 1]; text [B, L,
    joint_attention_dim]; text_mask [B, L] (1 = real token, 0 = padding) or None (all real);
    img_shape = (frames, h_tokens, w_tokens) static ints with frames*h*w == N_img; token_mesh:
    the (samples, tokens) mesh each sample's tokens are split over (models/attention/sequence_parallel.py;
    None: no split). Returns [B, N_img, patch_size**2 * out_channels] float32.
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

    tables = tuple(
        jnp.asarray(t) for t in rope_cos_sin(img_shape, n_txt, cfg.axes_dims_rope, cfg.rope_theta)
    )
    if text_mask is None:
      key_mask = None
    else:
      # Padded text keys are hidden from every query; image keys are always visible, so no row is
      # empty.
      key_mask = jnp.concatenate([text_mask.astype(bool), jnp.ones((b, n_img), bool)], axis=1)

    img, _ = self.run_blocks(
        self.blocks,
        (img, txt),
        lambda block, c: tuple(
            sequence_parallel.constrain(y, token_mesh)
            for y in block(*c, temb, tables, key_mask, token_mesh)
        ),
        cfg.num_layers,
    )
    return self.output(img, temb)

  def _check_inputs(self, latents, sigma, text, text_mask, img_shape):
    b, n_img, n_txt = dit.check_token_inputs(self.config, latents, sigma, text)
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
    if text_mask is not None and text_mask.shape != text.shape[:2]:
      raise ValueError(f"text_mask must be [B, L]={text.shape[:2]}, got {text_mask.shape}")
    return b, n_img, n_txt


# ----------------------------------------------------------------------------------------------
# Analytic sizes.


def count_params(config: MMDiTConfig) -> int:
  """Number of parameters of MMDiT(config) (equals diffusers' model for the same config)."""
  d, j = config.inner_dim, config.joint_attention_dim
  return (
      TimestepEmbedder.param_count(d)
      + j  # txt_norm
      + linear_param_count(config.in_channels, d)
      + linear_param_count(j, d)
      + config.num_layers * block_param_count(d, config.attention_head_dim)
      + linear_param_count(d, 2 * d)  # norm_out
      + linear_param_count(d, config.out_dim)
  )


def block_param_count(d: int, head_dim: int) -> int:
  """Number of parameters of one MMDiTBlock of width d."""
  return (
      2 * linear_param_count(d, 6 * d)  # img_mod, txt_mod
      + 8 * linear_param_count(d, d)  # q/k/v/out for both streams
      + 4 * head_dim  # q/k RMSNorm scales, both streams
      + 2 * (linear_param_count(d, MLP_RATIO * d) + linear_param_count(MLP_RATIO * d, d))
  )


def flops_per_forward(config: MMDiTConfig, batch: int, n_img: int, n_txt: int) -> float:
  """Analytic matmul FLOPs (2 per multiply-add) of one forward on `batch` samples with n_img image
  and n_txt text tokens: every Linear plus the two attention matmuls (QK^T, PV). Norms, RoPE,
  softmax and activations are excluded (they are O(tokens * D), negligible next to the matmuls)."""
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
