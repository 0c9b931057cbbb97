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
VAE comes from vae_blocks.py: the convs and resamplers, the chunked attention, the 1x1-conv leaf,
the residual block's forward, encode / decode with batch chunking and tiled decode (ImageVAE,
TileConfig) and the packed entry points; the load path is models/io/loading.py's.

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
from typing import Any, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import config_checks
from digen_jax.models.io import loading
from digen_jax.models.io.tensor_source import TensorSource, weight_and_bias
from digen_jax.models.vae import vae_blocks

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
    config_checks.require_positive_ints(
        'FluxVAEConfig',
        self,
        ('in_channels', 'out_channels', 'layers_per_block', 'latent_channels', 'norm_num_groups'),
    )
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
  def image_channels(self) -> int:
    """The image's channels (in_channels; decode gives out_channels, the same for FLUX.1)."""
    return self.in_channels

  @property
  def spatial_compression(self) -> int:
    """Pixels per latent along each spatial axis (FluxPipeline's vae_scale_factor)."""
    return 2 ** (len(self.block_out_channels) - 1)


# The config.json keys that are FluxVAEConfig fields.
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(FluxVAEConfig))
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
  structural = ('act_fn', 'down_block_types', 'up_block_types', 'latents_mean', 'latents_std')
  loading.check_config_keys(
      cfg,
      DIFFUSERS_CLASS_NAME,
      CONFIG_KEYS + structural + _IGNORED_KEYS,
      kind='VAE',
      what='FluxVAEConfig',
  )
  if cfg.get('act_fn', 'silu') != 'silu':
    raise ValueError(f"VAE config act_fn={cfg['act_fn']!r} is not supported (only 'silu')")
  for name in ('latents_mean', 'latents_std'):
    if cfg.get(name) is not None:
      raise ValueError(
          f'VAE config {name} is set; this AutoencoderKL normalises latents with '
          'scaling_factor and shift_factor only (as FluxPipeline does)'
      )
  config = FluxVAEConfig(**{k: cfg.get(k, _DIFFUSERS_DEFAULTS[k]) for k in CONFIG_KEYS})
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
# Leaves (vae_blocks.py: each gives its diffusers `sources`) and blocks.


class Conv2d(vae_blocks.KernelBias):
  """A diffusers 3x3 nn.Conv2d, kernel [3, 3, in, out]. Called: stride 1, padding 1 (the
  resamplers apply the kernel through downsample_conv / upsample_conv instead)."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    super().__init__((3, 3, cin, cout), param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return vae_blocks.conv2d(x, self.kernel[...], self.bias[...], padding=[(1, 1), (1, 1)])

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, path, perm=(2, 3, 1, 0))


class Linear(vae_blocks.Pointwise):
  """A diffusers nn.Linear held as Pointwise holds a 1x1 conv: kernel [in, out] <- weight
  [out, in]."""

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, path, perm=(1, 0))


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


# vae_blocks.Pointwise: the 1x1 convs (conv_shortcut, quant_conv, post_quant_conv).
_LEAVES = (Conv2d, Linear, vae_blocks.Pointwise, GroupNorm)


class ResnetBlock2D(vae_blocks.PreNormResidual):
  """diffusers ResnetBlock2D as the VAE builds it (no time embedding, output_scale_factor 1):
  shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

  def __init__(self, cin: int, cout: int, groups: int, *, param_dtype, rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.norm1 = GroupNorm(cin, groups, param_dtype=param_dtype)
    self.conv1 = Conv2d(cin, cout, **kw)
    self.norm2 = GroupNorm(cout, groups, param_dtype=param_dtype)
    self.conv2 = Conv2d(cout, cout, **kw)
    self.conv_shortcut = vae_blocks.Pointwise(cin, cout, **kw) if cin != cout else None


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
    out = vae_blocks.spatial_attention(self.to_q(n), self.to_k(n), self.to_v(n))
    return x + self.to_out[0](out).reshape(b, h, w, c)


class Resample2D(nnx.Module):
  """diffusers Downsample2D(use_conv=True, padding=0), H -> H / 2 (downsample_conv), or, with
  `up`, Upsample2D(use_conv=True), H -> 2H (upsample_conv: nearest 2x, then a 3x3 conv)."""

  def __init__(self, dim: int, up: bool, *, param_dtype, rngs: nnx.Rngs):
    self.up = up
    self.conv = Conv2d(dim, dim, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    resample = vae_blocks.upsample_conv if self.up else vae_blocks.downsample_conv
    return resample(x, self.conv.kernel[...], self.conv.bias[...])


class ResnetStage(nnx.Module):
  """`layers` ResnetBlock2D (cin -> cout in the first), then an optional resampler: the body of
  DownEncoderBlock2D and UpDecoderBlock2D, which name the resampler list (RESAMPLERS) as
  diffusers does."""

  RESAMPLERS = ''  # the attribute holding the resampler list: its diffusers name

  def __init__(
      self,
      cin: int,
      cout: int,
      layers: int,
      groups: int,
      resample: bool,
      *,
      param_dtype,
      rngs: nnx.Rngs,
  ):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List(
        [ResnetBlock2D(cin if i == 0 else cout, cout, groups, **kw) for i in range(layers)]
    )
    up = self.RESAMPLERS == 'upsamplers'
    setattr(self, self.RESAMPLERS, nnx.List([Resample2D(cout, up, **kw)] if resample else []))

  def __call__(self, x: jax.Array) -> jax.Array:
    return vae_blocks.apply_in_order(x, self.resnets, getattr(self, self.RESAMPLERS))


class DownEncoderBlock2D(ResnetStage):
  """diffusers DownEncoderBlock2D: `layers` resnets, then an optional downsampler."""

  RESAMPLERS = 'downsamplers'


class UpDecoderBlock2D(ResnetStage):
  """diffusers UpDecoderBlock2D: `layers` resnets, then an optional upsampler."""

  RESAMPLERS = 'upsamplers'


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
    x = vae_blocks.apply_in_order(x, [self.conv_in], self.down_blocks, [self.mid_block])
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
    x = vae_blocks.apply_in_order(x, [self.conv_in, self.mid_block], self.up_blocks)
    return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class FluxVAE(vae_blocks.ImageVAE):
  """AutoencoderKL (channels-last) with FluxPipeline's latent scaling; encode / decode are
  ImageVAE's, so decode_packed / encode_packed take it as they take vae.QwenImageVAE. See the
  module docstring."""

  def __init__(self, config: FluxVAEConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.config = config
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    z = config.latent_channels
    self.encoder = Encoder(config, **kw)
    self.quant_conv = vae_blocks.Pointwise(2 * z, 2 * z, **kw) if config.use_quant_conv else None
    self.post_quant_conv = vae_blocks.Pointwise(z, z, **kw) if config.use_post_quant_conv else None
    self.decoder = Decoder(config, **kw)

  def normalize(self, z: jax.Array) -> jax.Array:
    """Latent means -> the transformer's latent space: (z - shift_factor) * scaling_factor, as
    FluxImg2ImgPipeline encodes. float32."""
    return (z.astype(jnp.float32) - self.config.shift_factor) * self.config.scaling_factor

  def denormalize(self, z: jax.Array) -> jax.Array:
    """Inverse of normalize, as FluxPipeline writes it: z / scaling_factor + shift_factor."""
    return z.astype(jnp.float32) / self.config.scaling_factor + self.config.shift_factor

  def encode_mean(self, x: jax.Array) -> jax.Array:
    """Images in the compute dtype -> the posterior's mean [B, H/8, W/8, latent_channels]."""
    moments = self.encoder(x)
    if self.quant_conv is not None:
      moments = self.quant_conv(moments)
    return moments[..., : self.config.latent_channels]

  def decode_raw(self, z: jax.Array) -> jax.Array:
    """Latents (not normalised) -> unclipped images."""
    if self.post_quant_conv is not None:
      z = self.post_quant_conv(z)
    return self.decoder(z)


# ---------------------------------------------------------------------------------------------
# Packed (transformer-token) entry points: FluxPipeline._pack_latents / _unpack_latents are
# QwenImagePipeline's (2x2 patches, channel-major inside a token), so vae_blocks' serve both; the
# model supplies the scaling (FluxVAE.normalize / denormalize).
#   decode_packed(model, tokens [B, (h/2)(w/2), 64], latent_hw=(h, w)) -> images [B, 8h, 8w, 3]
#   encode_packed(model, images [B, H, W, 3]) -> tokens [B, (H/16)(W/16), 64]

decode_packed = vae_blocks.decode_packed
encode_packed = vae_blocks.encode_packed


# ---------------------------------------------------------------------------------------------
# Loading (models/io/loading.py's load path).


LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME, 'vae', config_from_diffusers, FluxVAE, 'VAE', leaves=_LEAVES
)
# The interface of family.vae (models/family.py): config, abstract module and key table.
read_vae_config = LOADER.read_config
abstract_vae = LOADER.abstract
vae_key_table = LOADER.table
# FluxVAE with weights streamed from a diffusers folder (vae/ or a pipeline folder holding it) onto
# the first local device.
load_vae_folder = LOADER.load_folder
