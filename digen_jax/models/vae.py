"""Qwen-Image VAE (diffusers ``AutoencoderKLQwenImage``, the Wan2.1 causal 3-D VAE) in flax NNX, for
single images.

Images are channels-last [B, H, W, C] in [-1, 1]; latents are [B, h, w, z_dim] with h = H / 8
(8 = 2 ** len(temperal_downsample)). Only one frame (T = 1) is modelled: diffusers pads every
causal 3-D conv with 2 * pad zero frames in front, so for one frame only the LAST temporal tap of
a kernel sees data, and the `time_conv` layers of the 3-D resamplers are skipped on the first
chunk. We keep the full 3-D kernels (and the unused `time_conv` params) so that loading is a pure
key table over the diffusers keys and a video variant needs no new layout.

    model = vae.load_vae_folder('/ckpt/Qwen-Image', param_dtype=jnp.bfloat16)   # or .../vae
    images = vae.decode_packed(model, tokens, latent_hw=(166, 166))            # [B, 1328, 1328, 3]
    tokens = vae.encode_packed(model, images)                                  # normalised, packed

Parameter layout (names mirror diffusers, so the key table is mechanical):
  causal 3-D convs   kernel [kt, kh, kw, in, out]  <- weight [out, in, kt, kh, kw]
  resample convs     kernel [3, 3, in, out]        <- `resample.1.weight` [out, in, 3, 3]
  attention 1x1s     kernel [in, out]              <- weight [out, in, 1, 1]
  RMS norm gammas    gamma [C]                     <- gamma [C, 1, 1(, 1)]

Precision: convs and attention matmuls run in the params' dtype (inputs are cast on entry);
norm statistics and the attention softmax run in float32; outputs are float32.

What is not Qwen-Image's own comes from vae_blocks.py, shared with flux_vae.py (FLUX.1's
AutoencoderKL): the convs and resamplers, the attention, the 1x1-conv leaf, the residual block's
forward, encode / decode with batch chunking and tiled decode (ImageVAE), and the packed entry
points; the load path is models/loading.py's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import config_checks
from digen_jax.models import loading
from digen_jax.models.tensor_source import TensorSource, weight_and_bias
from digen_jax.models.vae_blocks import (
    ImageVAE,
    KernelBias,
    Pointwise,
    PreNormResidual,
    TileConfig as TileConfig,  # re-exported: the decode tiling of both VAEs
    apply_in_order,
    conv2d,
    decode_packed as decode_packed,  # re-exported: this VAE's packed entry points
    downsample_conv,
    encode_packed as encode_packed,
    spatial_attention,
    upsample_conv,
)

DIFFUSERS_CLASS_NAME = 'AutoencoderKLQwenImage'

# F.normalize's default eps (diffusers' QwenImageRMS_norm divides by max(||x||_2, eps)).
NORM_EPS = 1e-12

_QWEN_LATENTS_MEAN = (
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
)
_QWEN_LATENTS_STD = (
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
)


@dataclasses.dataclass(frozen=True)
class VAEConfig:
  """Architecture of an AutoencoderKLQwenImage; defaults are diffusers' (the Qwen-Image VAE).
  Field names (including the spelling `temperal_downsample`) are diffusers' config keys."""

  base_dim: int = 96
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  attn_scales: tuple[float, ...] = ()
  temperal_downsample: tuple[bool, ...] = (False, True, True)
  dropout: float = 0.0  # inference only: dropout is the identity here, as in diffusers' eval()
  input_channels: int = 3
  latents_mean: tuple[float, ...] = _QWEN_LATENTS_MEAN
  latents_std: tuple[float, ...] = _QWEN_LATENTS_STD

  def __post_init__(self):
    for name in ('dim_mult', 'attn_scales', 'temperal_downsample', 'latents_mean', 'latents_std'):
      value = getattr(self, name)
      if not isinstance(value, (list, tuple)):
        raise ValueError(f'VAEConfig.{name} must be a list, got {value!r}')
      object.__setattr__(self, name, tuple(value))
    config_checks.require_positive_ints(
        'VAEConfig', self, ('base_dim', 'z_dim', 'num_res_blocks', 'input_channels')
    )
    if not self.dim_mult or any(
        not isinstance(m, (int, np.integer)) or m <= 0 for m in self.dim_mult
    ):
      raise ValueError(f'VAEConfig.dim_mult must be positive ints, got {self.dim_mult}')
    if len(self.temperal_downsample) != len(self.dim_mult) - 1:
      raise ValueError(
          f'VAEConfig.temperal_downsample needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} '
          f'entries (one per downsampling stage), got {self.temperal_downsample}'
      )
    if self.attn_scales:
      # diffusers' encoder calls its down-block attention with (x, feat_cache, feat_idx), which
      # QwenImageAttentionBlock.forward does not accept: no usable checkpoint has them.
      raise ValueError(
          f'VAEConfig.attn_scales={list(self.attn_scales)} is not supported '
          f'(diffusers cannot encode with it either); Qwen-Image uses []'
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'VAEConfig.dropout must be in [0, 1), got {self.dropout}')
    for name in ('latents_mean', 'latents_std'):
      if len(getattr(self, name)) != self.z_dim:
        raise ValueError(
            f'VAEConfig.{name} needs z_dim={self.z_dim} values, ' f'got {len(getattr(self, name))}'
        )
    if any(not s > 0 for s in self.latents_std):
      raise ValueError(f'VAEConfig.latents_std must all be > 0, got {self.latents_std}')

  @property
  def latent_channels(self) -> int:
    """The latent's channels (z_dim; FluxVAEConfig's name, so weights.py reads either)."""
    return self.z_dim

  @property
  def image_channels(self) -> int:
    """The image's channels (input_channels)."""
    return self.input_channels

  @property
  def spatial_compression(self) -> int:
    """Pixels per latent along each spatial axis (diffusers' spatial_compression_ratio)."""
    return 2 ** len(self.temperal_downsample)


_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(VAEConfig))


def config_from_diffusers(cfg: Mapping[str, Any]) -> VAEConfig:
  """VAEConfig from a diffusers vae/config.json dict. Keys starting with '_' are metadata; any
  other unknown key raises (it may change the math). Missing keys take diffusers' defaults."""
  loading.check_config_keys(cfg, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, kind='VAE', what='VAEConfig')
  return VAEConfig(**{k: cfg[k] for k in _CONFIG_KEYS if k in cfg})


# ---------------------------------------------------------------------------------------------
# Pure functions.


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
  """diffusers QwenImageRMS_norm over the channel (last) axis, in float32: x / max(|x|, eps) *
  sqrt(C) * gamma. [..., C] -> [..., C] in x's dtype."""
  x32 = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
  scale = math.sqrt(x.shape[-1])
  return (x32 / jnp.maximum(norm, NORM_EPS) * scale * gamma.astype(jnp.float32)).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Leaves (vae_blocks.py: each gives its diffusers `sources`) and blocks.


class CausalConv(KernelBias):
  """diffusers QwenImageCausalConv3d on one frame: a 2-D conv with the kernel's last temporal tap
  (the earlier taps only ever see the causal zero padding). [B, H, W, in] -> [B, H, W, out]."""

  def __init__(
      self, cin: int, cout: int, kernel: tuple[int, int, int], *, param_dtype, rngs: nnx.Rngs
  ):
    super().__init__((*kernel, cin, cout), param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...][-1]
    pads = [((kernel.shape[0] - 1) // 2,) * 2, ((kernel.shape[1] - 1) // 2,) * 2]
    return conv2d(x, kernel, self.bias[...], padding=pads)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, path, perm=(2, 3, 4, 1, 0))


class ResampleConv(KernelBias):
  """The 3x3 Conv2d of a QwenImageResample; diffusers wraps it as nn.Sequential(pad or upsample,
  conv), hence its keys `<path>.1.weight`. Applied by Resample (padding and stride differ)."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    super().__init__((3, 3, cin, cout), param_dtype=param_dtype, rngs=rngs)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, f'{path}.1', perm=(2, 3, 1, 0))


class RMSNorm(nnx.Module):
  """diffusers QwenImageRMS_norm (no bias in any AutoencoderKLQwenImage norm)."""

  def __init__(self, dim: int, *, param_dtype):
    self.gamma = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.gamma[...])

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    return {f'{path}.gamma': TensorSource((f'{path}.gamma',), shape=shapes[f'{path}.gamma'])}


_LEAVES = (CausalConv, ResampleConv, Pointwise, RMSNorm)


class ResidualBlock(PreNormResidual):
  """diffusers QwenImageResidualBlock: shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    self.norm1 = RMSNorm(cin, param_dtype=param_dtype)
    self.conv1 = CausalConv(cin, cout, (3, 3, 3), param_dtype=param_dtype, rngs=rngs)
    self.norm2 = RMSNorm(cout, param_dtype=param_dtype)
    self.conv2 = CausalConv(cout, cout, (3, 3, 3), param_dtype=param_dtype, rngs=rngs)
    self.conv_shortcut = (
        CausalConv(cin, cout, (1, 1, 1), param_dtype=param_dtype, rngs=rngs)
        if cin != cout
        else None
    )


class AttentionBlock(nnx.Module):
  """diffusers QwenImageAttentionBlock: x + proj(attn(to_qkv(norm(x)))), one head over h*w."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.norm = RMSNorm(dim, param_dtype=param_dtype)
    self.to_qkv = Pointwise(dim, 3 * dim, param_dtype=param_dtype, rngs=rngs)
    self.proj = Pointwise(dim, dim, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    qkv = self.to_qkv(self.norm(x)).reshape(b, h * w, 3 * c)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    return x + self.proj(spatial_attention(q, k, v).reshape(b, h, w, c))


class Resample(nnx.Module):
  """diffusers QwenImageResample for one frame. down: zero-pad right/bottom by 1, 3x3 stride-2
  conv (H -> H/2). up: nearest 2x, 3x3 conv to dim // 2 channels. The 3-D modes' `time_conv`
  only acts from the second frame on; its params are kept (unused) for an exact key table."""

  def __init__(self, dim: int, mode: str, *, param_dtype, rngs: nnx.Rngs):
    self.mode = mode
    cout = dim // 2 if mode.startswith('upsample') else dim
    self.resample = ResampleConv(dim, cout, param_dtype=param_dtype, rngs=rngs)
    if mode == 'upsample3d':
      self.time_conv = CausalConv(dim, 2 * dim, (3, 1, 1), param_dtype=param_dtype, rngs=rngs)
    elif mode == 'downsample3d':
      self.time_conv = CausalConv(dim, dim, (3, 1, 1), param_dtype=param_dtype, rngs=rngs)
    else:
      self.time_conv = None

  def __call__(self, x: jax.Array) -> jax.Array:
    conv = self.resample
    resample = upsample_conv if self.mode.startswith('upsample') else downsample_conv
    return resample(x, conv.kernel[...], conv.bias[...])


class MidBlock(nnx.Module):
  """diffusers QwenImageMidBlock (num_layers=1): resnet, attention, resnet."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.resnets = nnx.List(
        [ResidualBlock(dim, dim, param_dtype=param_dtype, rngs=rngs) for _ in range(2)]
    )
    self.attentions = nnx.List([AttentionBlock(dim, param_dtype=param_dtype, rngs=rngs)])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.resnets[0](x)
    for attn, resnet in zip(self.attentions, list(self.resnets)[1:]):
      x = resnet(attn(x))
    return x


class Encoder(nnx.Module):
  """diffusers QwenImageEncoder3d for one frame: [B, H, W, C] -> [B, H/8, W/8, 2 * z_dim]."""

  def __init__(self, config: VAEConfig, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    dims = [config.base_dim * u for u in (1, *config.dim_mult)]
    self.conv_in = CausalConv(config.input_channels, dims[0], (3, 3, 3), **kw)
    blocks = []
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
      for _ in range(config.num_res_blocks):
        blocks.append(ResidualBlock(cin, cout, **kw))
        cin = cout
      if i != len(config.dim_mult) - 1:
        mode = 'downsample3d' if config.temperal_downsample[i] else 'downsample2d'
        blocks.append(Resample(cout, mode, **kw))
    self.down_blocks = nnx.List(blocks)
    self.mid_block = MidBlock(dims[-1], **kw)
    self.norm_out = RMSNorm(dims[-1], param_dtype=param_dtype)
    self.conv_out = CausalConv(dims[-1], 2 * config.z_dim, (3, 3, 3), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = apply_in_order(x, [self.conv_in], self.down_blocks, [self.mid_block])
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class UpBlock(nnx.Module):
  """diffusers QwenImageUpBlock: num_res_blocks + 1 resnets, then an optional upsampler."""

  def __init__(
      self,
      cin: int,
      cout: int,
      num_res_blocks: int,
      mode: str | None,
      *,
      param_dtype,
      rngs: nnx.Rngs,
  ):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List(
        [ResidualBlock(cin if i == 0 else cout, cout, **kw) for i in range(num_res_blocks + 1)]
    )
    self.upsamplers = nnx.List([Resample(cout, mode, **kw)] if mode else [])

  def __call__(self, x: jax.Array) -> jax.Array:
    return apply_in_order(x, self.resnets, self.upsamplers)


class Decoder(nnx.Module):
  """diffusers QwenImageDecoder3d for one frame: [B, h, w, z_dim] -> [B, 8h, 8w, C] (unclipped)."""

  def __init__(self, config: VAEConfig, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    mult = config.dim_mult
    dims = [config.base_dim * u for u in (mult[-1], *mult[::-1])]
    temperal_upsample = config.temperal_downsample[::-1]
    self.conv_in = CausalConv(config.z_dim, dims[0], (3, 3, 3), **kw)
    self.mid_block = MidBlock(dims[0], **kw)
    blocks = []
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
      if i > 0:
        cin //= 2  # every upsampler halves the channels
      mode = None
      if i != len(mult) - 1:
        mode = 'upsample3d' if temperal_upsample[i] else 'upsample2d'
      blocks.append(UpBlock(cin, cout, config.num_res_blocks, mode, **kw))
    self.up_blocks = nnx.List(blocks)
    self.norm_out = RMSNorm(dims[-1], param_dtype=param_dtype)
    self.conv_out = CausalConv(dims[-1], config.input_channels, (3, 3, 3), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = apply_in_order(x, [self.conv_in, self.mid_block], self.up_blocks)
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class QwenImageVAE(ImageVAE):
  """AutoencoderKLQwenImage for single images (channels-last); encode / decode are ImageVAE's.
  See the module docstring."""

  def __init__(self, config: VAEConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.config = config
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.encoder = Encoder(config, **kw)
    self.quant_conv = CausalConv(2 * config.z_dim, 2 * config.z_dim, (1, 1, 1), **kw)
    self.post_quant_conv = CausalConv(config.z_dim, config.z_dim, (1, 1, 1), **kw)
    self.decoder = Decoder(config, **kw)

  def normalize(self, z: jax.Array) -> jax.Array:
    """Latent means -> the transformer's latent space (normalize_latents)."""
    return normalize_latents(z, self.config)

  def denormalize(self, z: jax.Array) -> jax.Array:
    """The transformer's latent space -> what decode takes (denormalize_latents)."""
    return denormalize_latents(z, self.config)

  def encode_mean(self, x: jax.Array) -> jax.Array:
    """Images in the compute dtype -> the posterior's mean [B, H/8, W/8, z_dim]."""
    return self.quant_conv(self.encoder(x))[..., : self.config.z_dim]

  def decode_raw(self, z: jax.Array) -> jax.Array:
    """Latents (not normalised) -> unclipped images."""
    return self.decoder(self.post_quant_conv(z))


# ---------------------------------------------------------------------------------------------
# Latent normalisation.


def normalize_latents(z: jax.Array, config: VAEConfig) -> jax.Array:
  """(z - mean) / std per channel (last axis), as QwenImage's img2img/edit pipelines encode."""
  mean = jnp.asarray(config.latents_mean, jnp.float32)
  std = jnp.asarray(config.latents_std, jnp.float32)
  return (z.astype(jnp.float32) - mean) / std


def denormalize_latents(z: jax.Array, config: VAEConfig) -> jax.Array:
  """Inverse of normalize_latents, as QwenImagePipeline writes it: z / (1 / std) + mean."""
  mean = jnp.asarray(config.latents_mean, jnp.float32)
  inv_std = 1.0 / jnp.asarray(config.latents_std, jnp.float32)
  return z.astype(jnp.float32) / inv_std + mean


# ---------------------------------------------------------------------------------------------
# Loading (models/loading.py's load path).


LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME, 'vae', config_from_diffusers, QwenImageVAE, 'VAE', leaves=_LEAVES
)
# The interface of family.vae (models/family.py): config, abstract module and key table.
read_vae_config = LOADER.read_config
abstract_vae = LOADER.abstract
vae_key_table = LOADER.table
# QwenImageVAE with weights streamed from a diffusers folder (vae/ or a pipeline folder holding
# it) onto the first local device.
load_vae_folder = LOADER.load_folder
