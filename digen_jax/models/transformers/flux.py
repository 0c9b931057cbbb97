"""FLUX.1 transformer (double-stream + single-stream MMDiT) in flax NNX.

Matches diffusers' ``FluxTransformer2DModel`` (0.42.1; FLUX.1-dev with guidance_embeds=True,
FLUX.1-schnell with False) to float32 rounding; see tests/core/models/test_flux_parity.py. Weights are loaded
from diffusers checkpoints by ``digen_jax.models.io.flux_convert``.

Most of the model is QwenImage's (``digen_jax.models.transformers.mmdit``) with other diffusers names: the
double-stream FluxTransformerBlock is exactly ``MMDiTBlock`` (AdaLayerNormZero x2 per stream,
joint attention with per-head q/k RMSNorm, text tokens first, tanh-GELU FeedForward); the
timestep embedder, the pooled-text projection (PixArtAlphaTextProjection, linear-SiLU-linear) and
the single-stream q/k/v projection are layers.py's ``TimestepEmbedder``, ``TextPoolEmbedder`` and
``QKVProjection``; the RoPE rotation is rope.py's (the same interleaved-pair rotation, run in the
half-split form). What is FLUX's own:

  * no RMSNorm on the text input; a pooled (CLIP) text vector and, for -dev, the guidance scale
    are added to the timestep embedding;
  * timestep and guidance are multiplied by 1000 before a scale-1 sinusoidal embedding
    (FluxPipeline passes sigma in [0, 1] and the raw guidance scale);
  * RoPE positions are 3-axis ids (text all zero; image (0, row, col)), angles computed in
    float64 (FluxPosEmbed);
  * after the double-stream blocks, single-stream blocks run on the joint [text, image] sequence:
    AdaLayerNormZeroSingle (shift, scale, gate), attention and an MLP in parallel from the same
    normed input, one proj_out over their concatenation.

Layout of our parameters (diffusers name in brackets):

  time_embed.linear_1 / linear_2      [time_text_embed.timestep_embedder] 256 -> D -> D
  guidance_embed.linear_1 / linear_2  [time_text_embed.guidance_embedder] only with guidance_embeds
  text_pool.linear_1 / linear_2       [time_text_embed.text_embedder] pooled_projection_dim -> D
                                      -> D
  txt_in, img_in                      [context_embedder, x_embedder]
  blocks.*                            [transformer_blocks.{i}] ONE MMDiTBlock stacked over
                                      num_layers
  single_blocks.*                     [single_transformer_blocks.{i}] ONE SingleStreamBlock stacked
                                      over num_single_layers (both stacks run under lax.scan, or
                                      unrolled: TransformerConfig.scan_layers)
  norm_out                            [norm_out.linear] AdaLayerNormContinuous (D -> 2D, chunk
                                      order: scale, shift)
  proj_out                            D -> patch_size**2 * out_channels

Precision as in mmdit.py: matmuls in the params' dtype, norms / RoPE / softmax statistics in
float32, float32 output; the timestep and guidance stay float32 before the sinusoidal embedding
(diffusers rounds them to the compute dtype first; identical in a float32 forward).
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
    MLP_RATIO,
    TIMESTEP_CHANNELS,
    TIMESTEP_SCALE,
    QKVProjection,
    TextPoolEmbedder,
    TimestepEmbedder,
    layer_norm,
    linear,
    linear_param_count,
    modulate,
    multihead_attention,
    output_layers,
)
from digen_jax.models.transformers.mmdit import MMDiTBlock, block_macs, block_param_count
from digen_jax.models.transformers.rope import rope_tables
from digen_jax.models.transformers.stacking import stacked_blocks


@dataclasses.dataclass(frozen=True)
class FluxConfig(dit.TransformerConfig):
  """Architecture of a FLUX.1 transformer. Defaults are diffusers' (FLUX.1-schnell; -dev sets
  guidance_embeds); rotary axes, eps and the execution options (which apply to both block stacks)
  are dit.TransformerConfig's.
  """

  SIZE_FIELDS = (
      "patch_size",
      "in_channels",
      "out_channels",
      "num_layers",
      "num_single_layers",
      "attention_head_dim",
      "num_attention_heads",
      "joint_attention_dim",
      "pooled_projection_dim",
  )
  BOOL_FIELDS = ("guidance_embeds",)
  ROPE_AXES = "one per id axis"

  patch_size: int = 1
  in_channels: int = 64  # the 16-channel VAE latent packed 2x2 by the pipeline
  out_channels: int | None = None  # None: in_channels (diffusers' meaning)
  num_layers: int = 19  # double-stream blocks
  num_single_layers: int = 38
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 4096  # T5 hidden size
  pooled_projection_dim: int = 768  # CLIP pooled size
  guidance_embeds: bool = False

  def __post_init__(self):
    if self.out_channels is None:
      object.__setattr__(self, "out_channels", self.in_channels)
    super().__post_init__()


def image_ids(h: int, w: int) -> np.ndarray:
  """FluxPipeline._prepare_latent_image_ids: token (row, col) of an h x w grid (row-major) -> (0,
  row, col). Returns [h*w, 3] int64."""
  rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  return np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3).astype(np.int64)


def rope_cos_sin(
    ids: np.ndarray, axes_dims: tuple[int, ...], theta: float = 10000.0
) -> tuple[np.ndarray, np.ndarray]:
  """FluxPosEmbed tables for position ids [S, 3]: (cos, sin) [S, head_dim/2] float32, entry i
  rotating the interleaved pair (x[2i], x[2i+1]) (diffusers repeats each entry twice; mmdit's RoPE
  takes them once).
  """
  return rope_tables(np.asarray(ids), axes_dims, theta, freqs_dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# Modules.


class SingleStreamAttention(QKVProjection):
  """FluxAttention(pre_only=True): Q/K/V with per-head RMSNorm on Q and K and RoPE, one softmax over
  the joint sequence, no output projection (the block's proj_out mixes it with the MLP branch)."""

  def __call__(
      self, x: jax.Array, cos: jax.Array, sin: jax.Array, token_mesh: Mesh | None = None
  ) -> jax.Array:
    """x [B, S, D], tables [S, Dh/2] -> [B, S, D]; token_mesh as layers.multihead_attention."""
    return multihead_attention(*self.project(x, cos, sin), None, self.implementation, token_mesh)


class SingleStreamBlock(nnx.Module):
  """FluxSingleTransformerBlock: x + gate * proj_out([attn(h), gelu_tanh(proj_mlp(h))]) with
  h = AdaLN(x)."""

  def __init__(self, config: FluxConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    d = config.inner_dim
    self.eps = config.eps
    # AdaLayerNormZeroSingle.linear: (shift, scale, gate).
    self.mod = linear(d, 3 * d, rngs, param_dtype)
    self.proj_mlp = linear(d, MLP_RATIO * d, rngs, param_dtype)
    self.attn = SingleStreamAttention(config, rngs=rngs, param_dtype=param_dtype)
    self.proj_out = linear(d + MLP_RATIO * d, d, rngs, param_dtype)

  def __call__(self, x, temb, rope, token_mesh: Mesh | None = None):
    """x [B, S, D] joint [text, image] tokens, temb [B, D], rope = (cos, sin) [S, Dh/2]
    -> [B, S, D]; token_mesh as layers.multihead_attention."""
    shift, scale, gate = jnp.split(self.mod(jax.nn.silu(temb)), 3, axis=-1)
    h = modulate(layer_norm(x, self.eps), shift, scale)
    mlp = jax.nn.gelu(self.proj_mlp(h), approximate=True)
    out = self.proj_out(jnp.concatenate([self.attn(h, *rope, token_mesh), mlp], axis=-1))
    return x + gate[:, None, :] * out


class Flux(dit.TransformerModel):
  """FLUX.1 transformer: predicts the flow velocity for packed latent tokens."""

  CONFIG = FluxConfig

  def __init__(self, config: FluxConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    super().__init__(config)
    d = config.inner_dim
    self.time_embed = TimestepEmbedder(d, rngs=rngs, param_dtype=param_dtype)
    if config.guidance_embeds:
      self.guidance_embed = TimestepEmbedder(d, rngs=rngs, param_dtype=param_dtype)
    self.text_pool = TextPoolEmbedder(
        config.pooled_projection_dim, d, rngs=rngs, param_dtype=param_dtype
    )
    self.txt_in = linear(config.joint_attention_dim, d, rngs, param_dtype)
    self.img_in = linear(config.in_channels, d, rngs, param_dtype)
    # Both stacks: every param gets a leading layer axis (lax.scan in __call__).
    self.blocks = stacked_blocks(
        lambda r: MMDiTBlock(config, rngs=r, param_dtype=param_dtype), config.num_layers, rngs
    )
    self.single_blocks = stacked_blocks(
        lambda r: SingleStreamBlock(config, rngs=r, param_dtype=param_dtype),
        config.num_single_layers,
        rngs,
    )
    self.norm_out, self.proj_out = output_layers(d, config.out_dim, rngs, param_dtype)

  def __call__(
      self,
      latents: jax.Array,
      sigma: jax.Array,
      text: jax.Array,
      pooled: jax.Array,
      guidance: jax.Array | None = None,
      *,
      img_shape: tuple[int, int] | None = None,
      img_ids: np.ndarray | None = None,
      txt_ids: np.ndarray | None = None,
      token_mesh: Mesh | None = None,
  ) -> jax.Array:
    """latents [B, N_img, in_channels] packed latent tokens; sigma [B] in [0, 1] (FluxPipeline's
    timestep / 1000); text [B, L, joint_attention_dim] (T5, no mask: every token attends); pooled
    [B, pooled_projection_dim] (CLIP); guidance [B] raw guidance scale, required iff
    guidance_embeds.

    Positions: img_shape = (h_tokens, w_tokens) static ints for FluxPipeline's grid ids
    ``image_ids(h, w)``, or img_ids [N_img, 3] given directly; txt_ids [L, 3] (default all zero).
    Ids must be concrete numpy (the RoPE tables are built at trace time): under jit, close over
    them. token_mesh: the (samples, tokens) mesh each sample's tokens are split over
    (models/attention/sequence_parallel.py; None: no split). Returns [B, N_img, out_dim] float32.
    """
    cfg = self.config
    b, n_img, n_txt = self._check_inputs(latents, sigma, text, pooled, guidance)
    ids = np.concatenate([self._txt_ids(txt_ids, n_txt), self._img_ids(img_shape, img_ids, n_img)])
    cos, sin = rope_cos_sin(ids, cfg.axes_dims_rope, cfg.rope_theta)
    joint_rope = (jnp.asarray(cos), jnp.asarray(sin))
    # MMDiTBlock takes (img_cos, img_sin, txt_cos, txt_sin); the joint sequence is [text, image].
    double_rope = tuple(
        jnp.asarray(t) for t in (cos[n_txt:], sin[n_txt:], cos[:n_txt], sin[:n_txt])
    )
    dtype = self.img_in.kernel.dtype

    img = self.img_in(latents.astype(dtype))
    txt = self.txt_in(text.astype(dtype))
    # diffusers: timestep * 1000 (and guidance * 1000), then Timesteps(scale=1).
    temb = self.time_embed(TIMESTEP_SCALE * sigma.astype(jnp.float32), scale=1.0)
    if cfg.guidance_embeds:
      temb = temb + self.guidance_embed(TIMESTEP_SCALE * guidance.astype(jnp.float32), scale=1.0)
    temb = temb + self.text_pool(pooled)

    img, txt = self.run_blocks(
        self.blocks,
        (img, txt),
        lambda block, c: tuple(
            sequence_parallel.constrain(y, token_mesh)
            for y in block(*c, temb, double_rope, None, token_mesh)
        ),
        cfg.num_layers,
    )
    # diffusers concatenates and splits the streams around every single-stream block; once is the
    # same.
    x = jnp.concatenate([txt, img], axis=1)
    x = self.run_blocks(
        self.single_blocks,
        x,
        lambda block, x: sequence_parallel.constrain(
            block(x, temb, joint_rope, token_mesh), token_mesh
        ),
        cfg.num_single_layers,
    )
    img = x[:, n_txt:]
    return self.output(img, temb)

  def _check_inputs(self, latents, sigma, text, pooled, guidance):
    cfg = self.config
    b, n_img, n_txt = dit.check_token_inputs(cfg, latents, sigma, text)
    if pooled.shape != (b, cfg.pooled_projection_dim):
      raise ValueError(
          f"pooled must be [B={b}, pooled_projection_dim={cfg.pooled_projection_dim}], "
          f"got {pooled.shape}"
      )
    if cfg.guidance_embeds:
      if guidance is None or guidance.shape != (b,):
        raise ValueError(
            f"guidance_embeds=True: guidance must be [B={b}] (the guidance scale), "
            f"got {None if guidance is None else guidance.shape}"
        )
    elif guidance is not None:
      raise ValueError(
          "guidance was given but the model has no guidance embedding (guidance_embeds=False)"
      )
    return b, n_img, n_txt

  @staticmethod
  def _img_ids(img_shape, img_ids, n_img):
    if (img_shape is None) == (img_ids is None):
      raise ValueError("pass exactly one of img_shape=(h_tokens, w_tokens) and img_ids [N_img, 3]")
    if img_ids is None:
      if not dit.is_static_shape(img_shape, 2):
        raise ValueError(
            f"img_shape must be 2 positive static ints (h_tokens, w_tokens), got {img_shape!r}"
        )
      if img_shape[0] * img_shape[1] != n_img:
        raise ValueError(
            f"img_shape {tuple(img_shape)} has {img_shape[0] * img_shape[1]} tokens but "
            f"latents has N_img={n_img}"
        )
      return image_ids(*img_shape)
    return _concrete_ids(img_ids, n_img, "img_ids")

  @staticmethod
  def _txt_ids(txt_ids, n_txt):
    if txt_ids is None:
      return np.zeros((n_txt, 3), np.int64)
    return _concrete_ids(txt_ids, n_txt, "txt_ids")


def _concrete_ids(ids, n, name):
  try:
    ids = np.asarray(ids)
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(
        f"{name} must be concrete (numpy, not traced): the RoPE tables are built at trace time; "
        f"close over them instead of passing them through jit"
    ) from e
  if ids.shape != (n, 3):
    raise ValueError(f"{name} must be [{n}, 3], got {ids.shape}")
  return ids


# ----------------------------------------------------------------------------------------------
# Analytic sizes.


def count_params(config: FluxConfig) -> int:
  """Number of parameters of Flux(config) (equals diffusers' model for the same config)."""
  d, hd = config.inner_dim, config.attention_head_dim
  single = (
      linear_param_count(d, 3 * d)  # AdaLayerNormZeroSingle
      + 3 * linear_param_count(d, d)  # q, k, v
      + 2 * hd  # q/k RMSNorm scales
      + linear_param_count(d, MLP_RATIO * d)  # proj_mlp
      + linear_param_count((1 + MLP_RATIO) * d, d)  # proj_out
  )
  return (
      TimestepEmbedder.param_count(d) * (2 if config.guidance_embeds else 1)
      + linear_param_count(config.pooled_projection_dim, d)
      + linear_param_count(d, d)  # text_pool
      + linear_param_count(config.joint_attention_dim, d)
      + linear_param_count(config.in_channels, d)
      + config.num_layers * block_param_count(d, hd)
      + config.num_single_layers * single
      + linear_param_count(d, 2 * d)  # norm_out
      + linear_param_count(d, config.out_dim)
  )


def flops_per_forward(config: FluxConfig, batch: int, n_img: int, n_txt: int) -> float:
  """Analytic matmul FLOPs (2 per multiply-add) of one forward on `batch` samples with n_img image
  and n_txt text tokens: every Linear plus the two attention matmuls (QK^T, PV); norms, RoPE,
  softmax and activations excluded (as mmdit.flops_per_forward)."""
  d = config.inner_dim
  s = n_img + n_txt
  embed = TIMESTEP_CHANNELS * d + d * d  # one row per sample
  per_sample = (
      embed * (2 if config.guidance_embeds else 1)
      + config.pooled_projection_dim * d
      + d * d
      + n_img * config.in_channels * d
      + n_txt * config.joint_attention_dim * d
  )
  single = (
      d * 3 * d  # modulation (one row per sample)
      + s * 3 * d * d  # q, k, v
      + s * MLP_RATIO * d * d
      + s * (1 + MLP_RATIO) * d * d  # proj_mlp, proj_out
      + 2 * s * s * d
  )  # QK^T and PV over all heads
  per_sample += (
      config.num_layers * block_macs(d, s)
      + config.num_single_layers * single
      + d * 2 * d
      + n_img * d * config.out_dim
  )
  return 2.0 * batch * per_sample
