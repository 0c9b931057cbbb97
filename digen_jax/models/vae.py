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

flux_vae.py (FLUX.1's AutoencoderKL) shares this file's convs and resamplers, attention, batch
chunking, tiled decode, 1x1-conv leaf and packed entry points (decode_packed / encode_packed take
any VAE with latent_channels, normalize / denormalize, encode / decode).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import attention as attention_lib
from digen_jax.models import latents as latents_lib
from digen_jax.models import streaming
from digen_jax.models import tensor_source
from digen_jax.models.tensor_source import TensorSource

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
    for name in ('base_dim', 'z_dim', 'num_res_blocks', 'input_channels'):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f'VAEConfig.{name} must be a positive int, got {value!r}')
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
  def spatial_compression(self) -> int:
    """Pixels per latent along each spatial axis (diffusers' spatial_compression_ratio)."""
    return 2 ** len(self.temperal_downsample)


_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(VAEConfig))


def config_from_diffusers(cfg: Mapping[str, Any]) -> VAEConfig:
  """VAEConfig from a diffusers vae/config.json dict. Keys starting with '_' are metadata; any
  other unknown key raises (it may change the math). Missing keys take diffusers' defaults."""
  cls = cfg.get('_class_name', DIFFUSERS_CLASS_NAME)
  if cls != DIFFUSERS_CLASS_NAME:
    raise ValueError(f'VAE config _class_name is {cls!r}; expected {DIFFUSERS_CLASS_NAME!r}')
  unknown = sorted(k for k in cfg if not k.startswith('_') and k not in _CONFIG_KEYS)
  if unknown:
    raise ValueError(
        f'unknown VAE config keys {unknown}; VAEConfig understands ' f'{list(_CONFIG_KEYS)}'
    )
  return VAEConfig(**{k: cfg[k] for k in _CONFIG_KEYS if k in cfg})


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Spatial tiling of decode, in output pixels (diffusers' enable_tiling arguments; its defaults).
  Tiles of `height` x `width` pixels start every `stride_*` pixels; overlaps are blended."""

  height: int = 256
  width: int = 256
  stride_height: int = 192
  stride_width: int = 192

  def check(self, compression: int) -> None:
    for name in ('height', 'width', 'stride_height', 'stride_width'):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0 or value % compression:
        raise ValueError(
            f'TileConfig.{name} must be a positive multiple of the VAE compression '
            f'{compression} (diffusers floors it otherwise), got {value!r}'
        )
    if self.stride_height > self.height or self.stride_width > self.width:
      raise ValueError(f'TileConfig strides must not exceed the tile size, got {self}')


# ---------------------------------------------------------------------------------------------
# Pure functions.


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
  """diffusers QwenImageRMS_norm over the channel (last) axis, in float32: x / max(|x|, eps) *
  sqrt(C) * gamma. [..., C] -> [..., C] in x's dtype."""
  x32 = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
  scale = math.sqrt(x.shape[-1])
  return (x32 / jnp.maximum(norm, NORM_EPS) * scale * gamma.astype(jnp.float32)).astype(x.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, query_chunk: int | None = None
) -> jax.Array:
  """Single-head softmax attention, scale 1/sqrt(C): q, k, v [B, N, C] -> [B, N, C]. The shared
  attention (models/attention.py) with one head; its portable path chunks the queries once the
  logits grow large (`query_chunk` rows, or its own budget)."""
  q = (q * (1.0 / math.sqrt(q.shape[-1]))).astype(q.dtype)
  out = attention_lib.attention(
      q[:, :, None], k[:, :, None], v[:, :, None], query_chunk=query_chunk
  )
  return out[:, :, 0]


def conv2d(x, kernel, bias, *, stride=1, padding):
  """NHWC conv in the kernel's dtype. kernel [kh, kw, in, out], bias [out]."""
  y = jax.lax.conv_general_dilated(
      x.astype(kernel.dtype),
      kernel,
      (stride, stride),
      padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
  )
  return y + bias.astype(y.dtype)


def downsample_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """2x spatial downsampling as diffusers' VAEs do it (QwenImageResample 'downsample2d',
  Downsample2D with padding=0): zero-pad right and bottom by 1, then a 3x3 stride-2 conv.
  [B, H, W, in] -> [B, H/2, W/2, out]."""
  return conv2d(x, kernel, bias, stride=2, padding=[(0, 1), (0, 1)])


def upsample_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """2x spatial upsampling as diffusers' VAEs do it (QwenImageResample 'upsample2d', Upsample2D):
  nearest 2x (nearest and nearest-exact agree at scale 2: src = dst // 2), then a 3x3 conv.
  [B, H, W, in] -> [B, 2H, 2W, out]."""
  x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
  return conv2d(x, kernel, bias, padding=[(1, 1), (1, 1)])


def map_chunks(fn: Callable[[jax.Array], jax.Array], x: jax.Array, chunk: int) -> jax.Array:
  """fn over x's leading (batch) axis `chunk` items at a time (lax.map: one compiled body, one
  chunk live at a time); the remainder is one more call. chunk <= 0 or >= B: fn(x)."""
  b = x.shape[0]
  if chunk <= 0 or chunk >= b:
    return fn(x)
  n = b // chunk
  head = jax.lax.map(fn, x[: n * chunk].reshape(n, chunk, *x.shape[1:]))
  out = head.reshape(n * chunk, *head.shape[2:])
  if b % chunk:
    out = jnp.concatenate([out, fn(x[n * chunk :])], axis=0)
  return out


def _blend_weights(e: int, dtype) -> jax.Array:
  # diffusers blends row y of the overlap as a * (1 - y / e) + b * (y / e).
  return jnp.asarray(np.arange(e) / e, dtype)


def _blend_v(a: jax.Array, b: jax.Array, extent: int) -> jax.Array:
  """diffusers blend_v on [B, H, W, C]: the top rows of b fade in from a's bottom rows."""
  e = min(a.shape[1], b.shape[1], extent)
  if e == 0:
    return b
  w = _blend_weights(e, b.dtype)[None, :, None, None]
  return b.at[:, :e].set(a[:, a.shape[1] - e :] * (1 - w) + b[:, :e] * w)


def _blend_h(a: jax.Array, b: jax.Array, extent: int) -> jax.Array:
  """diffusers blend_h on [B, H, W, C]: the left columns of b fade in from a's right columns."""
  e = min(a.shape[2], b.shape[2], extent)
  if e == 0:
    return b
  w = _blend_weights(e, b.dtype)[None, None, :, None]
  return b.at[:, :, :e].set(a[:, :, a.shape[2] - e :] * (1 - w) + b[:, :, :e] * w)


def tiled_decode(
    decode: Callable[[jax.Array], jax.Array], z: jax.Array, tile: TileConfig, compression: int
) -> jax.Array:
  """diffusers' tiled decode of latents z [B, h, w, C]: `decode` (latents -> unclipped pixels,
  `compression` pixels per latent) runs on overlapping latent tiles, blended and cropped in
  diffusers' order. This is AutoencoderKLQwenImage.tiled_decode for one frame, and
  AutoencoderKL.tiled_decode with tile_sample_min_size S (tile_overlap_factor 0.25, S / 4 a
  multiple of `compression`) is TileConfig(S, S, 3 * S // 4, 3 * S // 4)."""
  r = compression
  _, h, w, _ = z.shape
  min_h, min_w = tile.height // r, tile.width // r
  if h <= min_h and w <= min_w:  # diffusers decodes without tiles then
    return decode(z)
  step_h, step_w = tile.stride_height // r, tile.stride_width // r
  starts = [(i, j) for i in range(0, h, step_h) for j in range(0, w, step_w)]
  # Tiles of one shape decode under one lax.map (one compiled decoder per shape, at most 4:
  # interior, bottom edge, right edge, corner), one tile live at a time.
  groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for i, j in starts:
    groups.setdefault((min(min_h, h - i), min(min_w, w - j)), []).append((i, j))
  decoded = {}
  for (th, tw), where in groups.items():
    stack = jnp.stack([z[:, i : i + th, j : j + tw] for i, j in where])
    out = jax.lax.map(decode, stack)
    decoded.update({ij: out[n] for n, ij in enumerate(where)})
  # Blend in diffusers' order. diffusers blends in place, so a tile's above and left
  # neighbours are already blended when it reads them; rows[i][j] is updated the same way.
  rows_i, cols_j = sorted({i for i, _ in starts}), sorted({j for _, j in starts})
  rows = [[decoded[(i, j)] for j in cols_j] for i in rows_i]
  blend_h, blend_w = tile.height - tile.stride_height, tile.width - tile.stride_width
  out_rows = []
  for a in range(len(rows)):
    pieces = []
    for b in range(len(rows[a])):
      t = rows[a][b]
      if a > 0:
        t = _blend_v(rows[a - 1][b], t, blend_h)
      if b > 0:
        t = _blend_h(rows[a][b - 1], t, blend_w)
      rows[a][b] = t
      pieces.append(t[:, : tile.stride_height, : tile.stride_width])
    out_rows.append(jnp.concatenate(pieces, axis=2))
  return jnp.concatenate(out_rows, axis=1)[:, : h * r, : w * r]


# ---------------------------------------------------------------------------------------------
# Modules. Each leaf module knows its diffusers keys (`sources`); containers mirror diffusers'
# attribute names and list indices, so a leaf's path is its diffusers module path.


def kernel_init(rngs: nnx.Rngs, shape, dtype):
  return nnx.initializers.lecun_normal()(rngs.params(), shape, dtype)


class CausalConv(nnx.Module):
  """diffusers QwenImageCausalConv3d on one frame: a 2-D conv with the kernel's last temporal tap
  (the earlier taps only ever see the causal zero padding). [B, H, W, in] -> [B, H, W, out]."""

  def __init__(
      self, cin: int, cout: int, kernel: tuple[int, int, int], *, param_dtype, rngs: nnx.Rngs
  ):
    self.kernel = nnx.Param(kernel_init(rngs, (*kernel, cin, cout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((cout,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...][-1]
    pads = [((kernel.shape[0] - 1) // 2,) * 2, ((kernel.shape[1] - 1) // 2,) * 2]
    return conv2d(x, kernel, self.bias[...], padding=pads)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return {
        f'{path}.kernel': TensorSource((f'{path}.weight',), perm=(2, 3, 4, 1, 0)),
        f'{path}.bias': TensorSource((f'{path}.bias',)),
    }


class ResampleConv(nnx.Module):
  """The 3x3 Conv2d of a QwenImageResample; diffusers wraps it as nn.Sequential(pad or upsample,
  conv), hence its keys `<path>.1.weight`. Applied by Resample (padding and stride differ)."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs, (3, 3, cin, cout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((cout,), param_dtype))

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return {
        f'{path}.kernel': TensorSource((f'{path}.1.weight',), perm=(2, 3, 1, 0)),
        f'{path}.bias': TensorSource((f'{path}.1.bias',)),
    }


class Pointwise(nnx.Module):
  """A 1x1 Conv2d held as a dense kernel [in, out] (diffusers weight [out, in, 1, 1])."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs, (cin, cout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((cout,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    y = jnp.einsum('...i,io->...o', x.astype(kernel.dtype), kernel)
    return y + self.bias[...].astype(y.dtype)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    return {
        f'{path}.kernel': TensorSource(
            (f'{path}.weight',), perm=(2, 3, 1, 0), shape=shapes[f'{path}.kernel']
        ),
        f'{path}.bias': TensorSource((f'{path}.bias',)),
    }


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


class ResidualBlock(nnx.Module):
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

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x if self.conv_shortcut is None else self.conv_shortcut(x)
    x = self.conv1(jax.nn.silu(self.norm1(x)))
    x = self.conv2(jax.nn.silu(self.norm2(x)))
    return x + h


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
    return x + self.proj(attention(q, k, v).reshape(b, h, w, c))


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
    x = self.conv_in(x)
    for block in self.down_blocks:
      x = block(x)
    x = self.mid_block(x)
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
    for resnet in self.resnets:
      x = resnet(x)
    for up in self.upsamplers:
      x = up(x)
    return x


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
    x = self.mid_block(self.conv_in(x))
    for block in self.up_blocks:
      x = block(x)
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class QwenImageVAE(nnx.Module):
  """AutoencoderKLQwenImage for single images (channels-last). See the module docstring."""

  def __init__(self, config: VAEConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.config = config
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.encoder = Encoder(config, **kw)
    self.quant_conv = CausalConv(2 * config.z_dim, 2 * config.z_dim, (1, 1, 1), **kw)
    self.post_quant_conv = CausalConv(config.z_dim, config.z_dim, (1, 1, 1), **kw)
    self.decoder = Decoder(config, **kw)

  @property
  def dtype(self):
    return self.decoder.conv_in.kernel.dtype

  @property
  def latent_channels(self) -> int:
    return self.config.z_dim

  def normalize(self, z: jax.Array) -> jax.Array:
    """Latent means -> the transformer's latent space (normalize_latents)."""
    return normalize_latents(z, self.config)

  def denormalize(self, z: jax.Array) -> jax.Array:
    """The transformer's latent space -> what decode takes (denormalize_latents)."""
    return denormalize_latents(z, self.config)

  def encode(self, images: jax.Array, *, batch_chunk: int = 0) -> jax.Array:
    """[B, H, W, C] in [-1, 1] (H, W multiples of 8) -> latent mean (the posterior's mode)
    [B, H/8, W/8, z_dim], float32, not normalised. batch_chunk > 0: that many images at a time."""
    r, c = self.config.spatial_compression, self.config.input_channels
    if images.ndim != 4 or images.shape[-1] != c or images.shape[1] % r or images.shape[2] % r:
      raise ValueError(
          f'VAE encode needs images [B, H, W, {c}] with H and W multiples of {r}, '
          f'got shape {images.shape}'
      )
    z = self.config.z_dim

    def run(x):
      return self.quant_conv(self.encoder(x.astype(self.dtype)))[..., :z]

    return map_chunks(run, images, batch_chunk).astype(jnp.float32)

  def decode(
      self, latents: jax.Array, *, batch_chunk: int = 0, tile: TileConfig | None = None
  ) -> jax.Array:
    """[B, h, w, z_dim] (not normalised) -> images [B, 8h, 8w, C] float32 clipped to [-1, 1].
    batch_chunk > 0: decode that many images at a time (lax.map; same result). tile: decode
    overlapping spatial tiles and blend them exactly as diffusers' tiled_decode."""
    z = self.config.z_dim
    if latents.ndim != 4 or latents.shape[-1] != z:
      raise ValueError(f'VAE decode needs latents [B, h, w, {z}], got shape {latents.shape}')
    if tile is not None:
      tile.check(self.config.spatial_compression)
      fn = functools.partial(self._decode_tiled, tile=tile)
    else:
      fn = self._decode_raw
    out = map_chunks(fn, latents.astype(self.dtype), batch_chunk)
    return jnp.clip(out.astype(jnp.float32), -1.0, 1.0)

  def _decode_raw(self, z: jax.Array) -> jax.Array:
    return self.decoder(self.post_quant_conv(z))

  def _decode_tiled(self, z: jax.Array, tile: TileConfig) -> jax.Array:
    """diffusers AutoencoderKLQwenImage.tiled_decode for one frame (unclipped)."""
    return tiled_decode(self._decode_raw, z, tile, self.config.spatial_compression)


# ---------------------------------------------------------------------------------------------
# Latent normalisation and packed (transformer-token) entry points.


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


def decode_packed(
    model: QwenImageVAE,
    tokens: jax.Array,
    latent_hw: tuple[int, int],
    patch: int = 2,
    *,
    batch_chunk: int = 0,
    tile: TileConfig | None = None,
) -> jax.Array:
  """Transformer output tokens [B, (h/p)(w/p), z_dim*p*p] (normalised latents, diffusers' packing)
  -> images [B, 8h, 8w, C] float32 in [-1, 1]: QwenImagePipeline's unpack, denormalise, decode.
  `model` may be any VAE with this interface (latent_channels, denormalize, decode), e.g.
  flux_vae.FluxVAE: FluxPipeline packs and unpacks its latents the same way."""
  h, w = latent_hw
  want = (h // patch) * (w // patch), model.latent_channels * patch * patch
  if h % patch or w % patch or tokens.ndim != 3 or tuple(tokens.shape[1:]) != want:
    raise ValueError(
        f'decode_packed: latent_hw={latent_hw} with patch={patch} needs tokens '
        f'[B, {want[0]}, {want[1]}] and h, w multiples of {patch}; got tokens '
        f'{tokens.shape}'
    )
  z = model.denormalize(latents_lib.unpack(tokens, h, w, patch))
  return model.decode(z, batch_chunk=batch_chunk, tile=tile)


def encode_packed(
    model: QwenImageVAE, images: jax.Array, patch: int = 2, *, batch_chunk: int = 0
) -> jax.Array:
  """Images [B, H, W, C] in [-1, 1] -> normalised latent means packed as transformer tokens
  [B, (H/8p)(W/8p), z_dim*p*p] float32 (the inverse of decode_packed up to the VAE's loss).
  `model`: as for decode_packed (config.spatial_compression, encode, normalize)."""
  r = model.config.spatial_compression * patch
  if images.ndim != 4 or images.shape[1] % r or images.shape[2] % r:
    raise ValueError(
        f'encode_packed: images [B, H, W, C] need H and W multiples of {r} '
        f'(VAE compression x patch), got shape {images.shape}'
    )
  z = model.normalize(model.encode(images, batch_chunk=batch_chunk))
  return latents_lib.pack(z, patch)


# ---------------------------------------------------------------------------------------------
# Loading.


def _build(config: VAEConfig, param_dtype) -> QwenImageVAE:
  return QwenImageVAE(config, param_dtype=param_dtype, rngs=nnx.Rngs(0))


def abstract_vae(config: VAEConfig, param_dtype: Any = jnp.float32):
  """(graphdef, abstract nnx.State of ShapeDtypeStructs): the model built under nnx.eval_shape."""
  return nnx.split(nnx.eval_shape(lambda: _build(config, param_dtype)))


def vae_key_table(config: VAEConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source (every param, every diffusers key once)."""
  model = nnx.eval_shape(lambda: _build(config, jnp.float32))
  return tensor_source.table_from_modules(model, _LEAVES, 'vae_key_table')


def load_vae_state(model: QwenImageVAE, state_dict: Mapping[str, Any]) -> QwenImageVAE:
  """Set every param of `model` IN PLACE from a diffusers state dict {key: array}; returns it.
  `model` may be abstract (nnx.eval_shape). Arrays are cast to each param's dtype. Raises
  ValueError naming missing / unexpected keys or a key whose shape does not fit."""
  return tensor_source.fill_params(model, vae_key_table(model.config), state_dict, 'VAE')


def resolve_vae_folder(path: str | os.PathLike) -> Path:
  """The folder holding the VAE's config.json: `path` itself or `path`/vae (pipeline folder)."""
  return streaming.component_folder(path, 'vae', DIFFUSERS_CLASS_NAME)


def read_vae_config(path: str | os.PathLike) -> VAEConfig:
  """VAEConfig from a diffusers vae/ folder or pipeline folder."""
  return streaming.read_component_config(resolve_vae_folder(path), config_from_diffusers)


def load_vae_folder(path: str | os.PathLike, param_dtype: Any = jnp.float32) -> QwenImageVAE:
  """QwenImageVAE with weights from a diffusers folder (vae/ or a pipeline folder holding vae/;
  *.safetensors, optionally sharded with an index), streamed tensor by tensor onto the first
  local device through the same key table (models/streaming.py). No random init is made."""
  folder = resolve_vae_folder(path)
  config = read_vae_config(folder)
  graphdef, abstract = abstract_vae(config, param_dtype)
  return streaming.load_module(folder, vae_key_table(config), graphdef, abstract)
