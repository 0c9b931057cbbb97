"""FLUX.1 VAE (diffusers ``AutoencoderKL`` as FLUX.1 configures it) in flax NNX.

Images are channels-last [B, H, W, C] in [-1, 1]; latents are [B, h, w, latent_channels] with
h = H / 8 (8 = 2 ** (len(block_out_channels) - 1)). FLUX.1's vae/config.json: block_out_channels
(128, 256, 512, 512), layers_per_block 2, 16 latent channels, 32 norm groups, no quant_conv /
post_quant_conv, scaling_factor 0.3611 and shift_factor 0.1159, which FluxPipeline applies as

    decode:  z = unpack(tokens) / scaling_factor + shift_factor;  images = vae.decode(z)
    encode:  tokens = pack((vae.encode(images).mean - shift_factor) * scaling_factor)

    model = flux_vae.load_vae_folder('/ckpt/FLUX.1-dev', param_dtype=jnp.bfloat16)  # or .../vae
    images = flux_vae.decode_packed(model, tokens, latent_hw=(128, 128))   # [B, 1024, 1024, 3]
    tokens = flux_vae.encode_packed(model, images)                         # [B, 4096, 64]

The blocks are diffusers' (Encoder / Decoder of models/autoencoders/vae.py): ResnetBlock2D
(GroupNorm, SiLU, 3x3 conv, twice; a 1x1 shortcut when the channels change), Downsample2D (zero-pad
right/bottom by 1, 3x3 stride-2 conv), Upsample2D (nearest 2x, 3x3 conv) and a mid block of
resnet, one-head self-attention over all h*w positions, resnet. What is the same as the Qwen-Image
VAE comes from models/vae.py: the convs and resamplers, the chunked attention, the 1x1-conv leaf,
batch chunking, tiled decode and TileConfig, the packed entry points and the streamed loader.

diffusers' AutoencoderKL.decode does not clamp; FluxPipeline's image postprocessing does
((x / 2 + 0.5).clamp(0, 1)). Our decode clips to [-1, 1], as the Qwen-Image VAE's does.

Parameter layout (names mirror diffusers, so the key table is mechanical):
  3x3 convs            kernel [3, 3, in, out]  <- weight [out, in, 3, 3]
  1x1 convs            kernel [in, out]        <- weight [out, in, 1, 1]  (shortcuts, quant convs)
  attention linears    kernel [in, out]        <- weight [out, in]
  group norms          scale [C], bias [C]     <- weight [C], bias [C]

Precision: convs and attention matmuls run in the params' dtype (inputs are cast on entry);
group-norm statistics and the attention softmax run in float32; outputs are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import streaming
from digen_jax.models import tensor_source
from digen_jax.models import vae as vae_lib
from digen_jax.models.tensor_source import TensorSource
from digen_jax.models.vae import TileConfig

DIFFUSERS_CLASS_NAME = 'AutoencoderKL'

# diffusers' Encoder / Decoder build every GroupNorm (resnets, attention, output) with eps 1e-6.
GROUP_NORM_EPS = 1e-6

_DOWN_BLOCK = 'DownEncoderBlock2D'
_UP_BLOCK = 'UpDecoderBlock2D'


@dataclasses.dataclass(frozen=True)
class FluxVAEConfig:
  """Architecture and latent scaling of an AutoencoderKL; defaults are FLUX.1's vae/config.json
  (diffusers' own defaults differ: see config_from_diffusers). Field names are diffusers' config
  keys. shift_factor None in a config (SD-style VAEs) is 0.0 here: the same latents."""

  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
  layers_per_block: int = 2
  latent_channels: int = 16
  norm_num_groups: int = 32
  scaling_factor: float = 0.3611
  shift_factor: float = 0.1159
  use_quant_conv: bool = False
  use_post_quant_conv: bool = False
  mid_block_add_attention: bool = True

  def __post_init__(self):
    if not isinstance(self.block_out_channels, (list, tuple)):
      raise ValueError(
          f'FluxVAEConfig.block_out_channels must be a list, got ' f'{self.block_out_channels!r}'
      )
    object.__setattr__(self, 'block_out_channels', tuple(self.block_out_channels))
    if self.shift_factor is None:
      object.__setattr__(self, 'shift_factor', 0.0)
    for name in (
        'in_channels',
        'out_channels',
        'layers_per_block',
        'latent_channels',
        'norm_num_groups',
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f'FluxVAEConfig.{name} must be a positive int, got {value!r}')
    if not self.block_out_channels or any(
        not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c <= 0
        for c in self.block_out_channels
    ):
      raise ValueError(
          f'FluxVAEConfig.block_out_channels must be positive ints, got '
          f'{self.block_out_channels}'
      )
    bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
    if bad:
      raise ValueError(
          f'FluxVAEConfig.block_out_channels {list(bad)} are not multiples of '
          f'norm_num_groups={self.norm_num_groups} (GroupNorm needs that)'
      )
    for name in ('scaling_factor', 'shift_factor'):
      value = getattr(self, name)
      if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
        raise ValueError(f'FluxVAEConfig.{name} must be a number, got {value!r}')
    if not self.scaling_factor > 0:
      raise ValueError(f'FluxVAEConfig.scaling_factor must be > 0, got {self.scaling_factor}')
    for name in ('use_quant_conv', 'use_post_quant_conv', 'mid_block_add_attention'):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f'FluxVAEConfig.{name} must be a bool, got {getattr(self, name)!r}')

  @property
  def spatial_compression(self) -> int:
    """Pixels per latent along each spatial axis (FluxPipeline's vae_scale_factor)."""
    return 2 ** (len(self.block_out_channels) - 1)


_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(FluxVAEConfig))
# AutoencoderKL.__init__'s defaults for our fields (a config.json missing a key means these).
_DIFFUSERS_DEFAULTS = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(64,),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    scaling_factor=0.18215,
    shift_factor=None,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
)
# Keys that do not change decode or encode: diffusers' fp16 hint and default tile size.
_IGNORED_KEYS = ('force_upcast', 'sample_size')


def config_from_diffusers(cfg: Mapping[str, Any]) -> FluxVAEConfig:
  """FluxVAEConfig from a diffusers AutoencoderKL vae/config.json dict. Keys starting with '_'
  are metadata; missing keys take diffusers' defaults. Raises for an unknown key, an act_fn other
  than silu, block types other than DownEncoderBlock2D / UpDecoderBlock2D (one per entry of
  block_out_channels), and latents_mean / latents_std that are set (FluxPipeline never uses them:
  a VAE normalised per channel is not FLUX's)."""
  cls = cfg.get('_class_name', DIFFUSERS_CLASS_NAME)
  if cls != DIFFUSERS_CLASS_NAME:
    raise ValueError(f'VAE config _class_name is {cls!r}; expected {DIFFUSERS_CLASS_NAME!r}')
  structural = ('act_fn', 'down_block_types', 'up_block_types', 'latents_mean', 'latents_std')
  unknown = sorted(
      k
      for k in cfg
      if not k.startswith('_')
      and k not in _CONFIG_KEYS
      and k not in structural
      and k not in _IGNORED_KEYS
  )
  if unknown:
    raise ValueError(
        f'unknown VAE config keys {unknown}; FluxVAEConfig understands '
        f'{list(_CONFIG_KEYS + structural + _IGNORED_KEYS)}'
    )
  if cfg.get('act_fn', 'silu') != 'silu':
    raise ValueError(f"VAE config act_fn={cfg['act_fn']!r} is not supported (only 'silu')")
  for name in ('latents_mean', 'latents_std'):
    if cfg.get(name) is not None:
      raise ValueError(
          f'VAE config {name} is set; this AutoencoderKL normalises latents with '
          'scaling_factor and shift_factor only (as FluxPipeline does)'
      )
  config = FluxVAEConfig(**{k: cfg.get(k, _DIFFUSERS_DEFAULTS[k]) for k in _CONFIG_KEYS})
  n = len(config.block_out_channels)
  for name, block in (('down_block_types', _DOWN_BLOCK), ('up_block_types', _UP_BLOCK)):
    types = cfg.get(name, (block,))
    if not isinstance(types, (list, tuple)) or list(types) != [block] * n:
      raise ValueError(
          f'VAE config {name}={types!r}: only {n} x {block!r} (one per '
          f'block_out_channels entry) is supported'
      )
  return config


# ---------------------------------------------------------------------------------------------
# Pure functions.


def group_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, groups: int, eps: float = GROUP_NORM_EPS
) -> jax.Array:
  """torch.nn.GroupNorm (affine) over channels-last x [B, H, W, C], statistics in float32 over
  (H, W, C / groups) per group; returns x's dtype."""
  b, h, w, c = x.shape
  x32 = x.astype(jnp.float32).reshape(b, h, w, groups, c // groups)
  mean = jnp.mean(x32, axis=(1, 2, 4), keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=(1, 2, 4), keepdims=True)
  y = ((x32 - mean) * jax.lax.rsqrt(var + eps)).reshape(b, h, w, c)
  return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Modules. As in models/vae.py: each leaf module knows its diffusers keys (`sources`);
# containers mirror diffusers' attribute names and list indices, so a leaf's path is its
# diffusers module path.


class Conv2d(nnx.Module):
  """A diffusers 3x3 nn.Conv2d, kernel [3, 3, in, out]. Called: stride 1, padding 1 (the
  resamplers apply the kernel through vae.downsample_conv / vae.upsample_conv instead)."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(vae_lib.kernel_init(rngs, (3, 3, cin, cout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((cout,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return vae_lib.conv2d(x, self.kernel[...], self.bias[...], padding=[(1, 1), (1, 1)])

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return {
        f'{path}.kernel': TensorSource((f'{path}.weight',), perm=(2, 3, 1, 0)),
        f'{path}.bias': TensorSource((f'{path}.bias',)),
    }


class Linear(vae_lib.Pointwise):
  """A diffusers nn.Linear held as vae.Pointwise holds a 1x1 conv: kernel [in, out] <- weight
  [out, in]."""

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return {
        f'{path}.kernel': TensorSource((f'{path}.weight',), perm=(1, 0)),
        f'{path}.bias': TensorSource((f'{path}.bias',)),
    }


class GroupNorm(nnx.Module):
  """torch.nn.GroupNorm(groups, C, eps=1e-6) with its affine scale (`weight`) and bias."""

  def __init__(self, dim: int, groups: int, *, param_dtype):
    self.groups = groups
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return group_norm(x, self.scale[...], self.bias[...], self.groups)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return {
        f'{path}.scale': TensorSource((f'{path}.weight',)),
        f'{path}.bias': TensorSource((f'{path}.bias',)),
    }


# vae.Pointwise: the 1x1 convs (conv_shortcut, quant_conv, post_quant_conv).
_LEAVES = (Conv2d, Linear, vae_lib.Pointwise, GroupNorm)


class ResnetBlock2D(nnx.Module):
  """diffusers ResnetBlock2D as the VAE builds it (no time embedding, output_scale_factor 1):
  shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

  def __init__(self, cin: int, cout: int, groups: int, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.norm1 = GroupNorm(cin, groups, param_dtype=param_dtype)
    self.conv1 = Conv2d(cin, cout, **kw)
    self.norm2 = GroupNorm(cout, groups, param_dtype=param_dtype)
    self.conv2 = Conv2d(cout, cout, **kw)
    self.conv_shortcut = vae_lib.Pointwise(cin, cout, **kw) if cin != cout else None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x if self.conv_shortcut is None else self.conv_shortcut(x)
    x = self.conv1(jax.nn.silu(self.norm1(x)))
    x = self.conv2(jax.nn.silu(self.norm2(x)))
    return x + h


class Attention(nnx.Module):
  """diffusers Attention as UNetMidBlock2D builds it in a VAE: one head of all C channels over the
  h*w positions, group norm in front, residual: x + to_out(attn(q, k, v) of group_norm(x))."""

  def __init__(self, dim: int, groups: int, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.group_norm = GroupNorm(dim, groups, param_dtype=param_dtype)
    self.to_q = Linear(dim, dim, **kw)
    self.to_k = Linear(dim, dim, **kw)
    self.to_v = Linear(dim, dim, **kw)
    self.to_out = nnx.List([Linear(dim, dim, **kw)])  # diffusers: [Linear, Dropout]

  def __call__(self, x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    n = self.group_norm(x).reshape(b, h * w, c)
    out = vae_lib.attention(self.to_q(n), self.to_k(n), self.to_v(n))
    return x + self.to_out[0](out).reshape(b, h, w, c)


class Downsample2D(nnx.Module):
  """diffusers Downsample2D(use_conv=True, padding=0): vae.downsample_conv. H -> H / 2."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.conv = Conv2d(dim, dim, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return vae_lib.downsample_conv(x, self.conv.kernel[...], self.conv.bias[...])


class Upsample2D(nnx.Module):
  """diffusers Upsample2D(use_conv=True): vae.upsample_conv (nearest 2x, 3x3 conv). H -> 2H."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.conv = Conv2d(dim, dim, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return vae_lib.upsample_conv(x, self.conv.kernel[...], self.conv.bias[...])


class DownEncoderBlock2D(nnx.Module):
  """diffusers DownEncoderBlock2D: `layers` resnets, then an optional downsampler."""

  def __init__(
      self,
      cin: int,
      cout: int,
      layers: int,
      groups: int,
      downsample: bool,
      *,
      param_dtype,
      rngs: nnx.Rngs,
  ):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List(
        [ResnetBlock2D(cin if i == 0 else cout, cout, groups, **kw) for i in range(layers)]
    )
    self.downsamplers = nnx.List([Downsample2D(cout, **kw)] if downsample else [])

  def __call__(self, x: jax.Array) -> jax.Array:
    for resnet in self.resnets:
      x = resnet(x)
    for down in self.downsamplers:
      x = down(x)
    return x


class UpDecoderBlock2D(nnx.Module):
  """diffusers UpDecoderBlock2D: `layers` resnets, then an optional upsampler."""

  def __init__(
      self,
      cin: int,
      cout: int,
      layers: int,
      groups: int,
      upsample: bool,
      *,
      param_dtype,
      rngs: nnx.Rngs,
  ):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List(
        [ResnetBlock2D(cin if i == 0 else cout, cout, groups, **kw) for i in range(layers)]
    )
    self.upsamplers = nnx.List([Upsample2D(cout, **kw)] if upsample else [])

  def __call__(self, x: jax.Array) -> jax.Array:
    for resnet in self.resnets:
      x = resnet(x)
    for up in self.upsamplers:
      x = up(x)
    return x


class UNetMidBlock2D(nnx.Module):
  """diffusers UNetMidBlock2D (num_layers=1): resnet, attention (unless mid_block_add_attention
  is off), resnet."""

  def __init__(self, dim: int, groups: int, add_attention: bool, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResnetBlock2D(dim, dim, groups, **kw) for _ in range(2)])
    self.attentions = nnx.List([Attention(dim, groups, **kw)] if add_attention else [])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.resnets[0](x)
    for attn in self.attentions:
      x = attn(x)
    return self.resnets[1](x)


class Encoder(nnx.Module):
  """diffusers Encoder (double_z): [B, H, W, in] -> moments [B, H/8, W/8, 2 * latent_channels]
  (mean, then log-variance)."""

  def __init__(self, config: FluxVAEConfig, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    ch, groups = config.block_out_channels, config.norm_num_groups
    self.conv_in = Conv2d(config.in_channels, ch[0], **kw)
    blocks, cout = [], ch[0]
    for i, c in enumerate(ch):
      cin, cout = cout, c
      blocks.append(
          DownEncoderBlock2D(cin, cout, config.layers_per_block, groups, i < len(ch) - 1, **kw)
      )
    self.down_blocks = nnx.List(blocks)
    self.mid_block = UNetMidBlock2D(ch[-1], groups, config.mid_block_add_attention, **kw)
    self.conv_norm_out = GroupNorm(ch[-1], groups, param_dtype=param_dtype)
    self.conv_out = Conv2d(ch[-1], 2 * config.latent_channels, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.conv_in(x)
    for block in self.down_blocks:
      x = block(x)
    x = self.mid_block(x)
    return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
  """diffusers Decoder: [B, h, w, latent_channels] -> [B, 8h, 8w, out] (unclipped)."""

  def __init__(self, config: FluxVAEConfig, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    ch, groups = config.block_out_channels[::-1], config.norm_num_groups
    self.conv_in = Conv2d(config.latent_channels, ch[0], **kw)
    self.mid_block = UNetMidBlock2D(ch[0], groups, config.mid_block_add_attention, **kw)
    blocks, cout = [], ch[0]
    for i, c in enumerate(ch):
      cin, cout = cout, c
      blocks.append(
          UpDecoderBlock2D(cin, cout, config.layers_per_block + 1, groups, i < len(ch) - 1, **kw)
      )
    self.up_blocks = nnx.List(blocks)
    self.conv_norm_out = GroupNorm(ch[-1], groups, param_dtype=param_dtype)
    self.conv_out = Conv2d(ch[-1], config.out_channels, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.mid_block(self.conv_in(x))
    for block in self.up_blocks:
      x = block(x)
    return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class FluxVAE(nnx.Module):
  """AutoencoderKL (channels-last) with FluxPipeline's latent scaling. See the module docstring.
  The same interface as vae.QwenImageVAE, so vae.decode_packed / encode_packed take either."""

  def __init__(self, config: FluxVAEConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.config = config
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    z = config.latent_channels
    self.encoder = Encoder(config, **kw)
    self.quant_conv = vae_lib.Pointwise(2 * z, 2 * z, **kw) if config.use_quant_conv else None
    self.post_quant_conv = vae_lib.Pointwise(z, z, **kw) if config.use_post_quant_conv else None
    self.decoder = Decoder(config, **kw)

  @property
  def dtype(self):
    return self.decoder.conv_in.kernel.dtype

  @property
  def latent_channels(self) -> int:
    return self.config.latent_channels

  def normalize(self, z: jax.Array) -> jax.Array:
    """Latent means -> the transformer's latent space: (z - shift_factor) * scaling_factor, as
    FluxImg2ImgPipeline encodes. float32."""
    return (z.astype(jnp.float32) - self.config.shift_factor) * self.config.scaling_factor

  def denormalize(self, z: jax.Array) -> jax.Array:
    """Inverse of normalize, as FluxPipeline writes it: z / scaling_factor + shift_factor."""
    return z.astype(jnp.float32) / self.config.scaling_factor + self.config.shift_factor

  def encode(self, images: jax.Array, *, batch_chunk: int = 0) -> jax.Array:
    """[B, H, W, C] in [-1, 1] (H, W multiples of 8) -> latent mean (the posterior's mode)
    [B, H/8, W/8, latent_channels], float32, not normalised. batch_chunk > 0: that many images
    at a time."""
    r, c = self.config.spatial_compression, self.config.in_channels
    if images.ndim != 4 or images.shape[-1] != c or images.shape[1] % r or images.shape[2] % r:
      raise ValueError(
          f'VAE encode needs images [B, H, W, {c}] with H and W multiples of {r}, '
          f'got shape {images.shape}'
      )
    z = self.config.latent_channels

    def run(x):
      moments = self.encoder(x.astype(self.dtype))
      if self.quant_conv is not None:
        moments = self.quant_conv(moments)
      return moments[..., :z]

    return vae_lib.map_chunks(run, images, batch_chunk).astype(jnp.float32)

  def decode(
      self, latents: jax.Array, *, batch_chunk: int = 0, tile: TileConfig | None = None
  ) -> jax.Array:
    """[B, h, w, latent_channels] (not normalised) -> images [B, 8h, 8w, C] float32 clipped to
    [-1, 1]. batch_chunk > 0: decode that many images at a time (lax.map; same result). tile:
    decode overlapping spatial tiles and blend them as diffusers' tiled_decode (vae.tiled_decode
    says which TileConfig AutoencoderKL's tiling is)."""
    z = self.config.latent_channels
    if latents.ndim != 4 or latents.shape[-1] != z:
      raise ValueError(f'VAE decode needs latents [B, h, w, {z}], got shape {latents.shape}')
    if tile is not None:
      r = self.config.spatial_compression
      tile.check(r)
      fn = functools.partial(vae_lib.tiled_decode, self._decode_raw, tile=tile, compression=r)
    else:
      fn = self._decode_raw
    out = vae_lib.map_chunks(fn, latents.astype(self.dtype), batch_chunk)
    return jnp.clip(out.astype(jnp.float32), -1.0, 1.0)

  def _decode_raw(self, z: jax.Array) -> jax.Array:
    if self.post_quant_conv is not None:
      z = self.post_quant_conv(z)
    return self.decoder(z)


# ---------------------------------------------------------------------------------------------
# Packed (transformer-token) entry points: FluxPipeline._pack_latents / _unpack_latents are
# QwenImagePipeline's (2x2 patches, channel-major inside a token), so vae.py's serve both; the
# model supplies the scaling (FluxVAE.normalize / denormalize).
#   decode_packed(model, tokens [B, (h/2)(w/2), 64], latent_hw=(h, w)) -> images [B, 8h, 8w, 3]
#   encode_packed(model, images [B, H, W, 3]) -> tokens [B, (H/16)(W/16), 64]

decode_packed = vae_lib.decode_packed
encode_packed = vae_lib.encode_packed


# ---------------------------------------------------------------------------------------------
# Loading.


def _build(config: FluxVAEConfig, param_dtype) -> FluxVAE:
  return FluxVAE(config, param_dtype=param_dtype, rngs=nnx.Rngs(0))


def abstract_vae(config: FluxVAEConfig, param_dtype: Any = jnp.float32):
  """(graphdef, abstract nnx.State of ShapeDtypeStructs): the model built under nnx.eval_shape."""
  return nnx.split(nnx.eval_shape(lambda: _build(config, param_dtype)))


def vae_key_table(config: FluxVAEConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source (every param, every diffusers key once)."""
  model = nnx.eval_shape(lambda: _build(config, jnp.float32))
  return tensor_source.table_from_modules(model, _LEAVES, 'flux_vae.vae_key_table')


def load_vae_state(model: FluxVAE, state_dict: Mapping[str, Any]) -> FluxVAE:
  """Set every param of `model` IN PLACE from a diffusers state dict {key: array}; returns it.
  `model` may be abstract (nnx.eval_shape). Arrays are cast to each param's dtype. Raises
  ValueError naming missing / unexpected keys or a key whose shape does not fit."""
  return tensor_source.fill_params(model, vae_key_table(model.config), state_dict, 'VAE')


def resolve_vae_folder(path: str | os.PathLike) -> Path:
  """The folder holding the VAE's config.json: `path` itself or `path`/vae (pipeline folder)."""
  return streaming.component_folder(path, 'vae', DIFFUSERS_CLASS_NAME)


def read_vae_config(path: str | os.PathLike) -> FluxVAEConfig:
  """FluxVAEConfig from a diffusers vae/ folder or pipeline folder."""
  return streaming.read_component_config(resolve_vae_folder(path), config_from_diffusers)


def load_vae_folder(path: str | os.PathLike, param_dtype: Any = jnp.float32) -> FluxVAE:
  """FluxVAE with weights from a diffusers folder (vae/ or a pipeline folder holding vae/;
  *.safetensors, optionally sharded with an index), streamed tensor by tensor onto the first
  local device through the key table (models/streaming.py). No random init is made."""
  folder = resolve_vae_folder(path)
  config = read_vae_config(folder)
  graphdef, abstract = abstract_vae(config, param_dtype)
  return streaming.load_module(folder, vae_key_table(config), graphdef, abstract)
