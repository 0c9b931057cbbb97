"""VAE building blocks shared by the VAEs (causal_vae.py: the Wan2.1 causal 3-D VAE, Qwen-Image's
and Wan2.1's; flux_vae.py: FLUX.1's AutoencoderKL).

Channels-last throughout: images [B, H, W, C] in [-1, 1], latents [B, h, w, z].

  convs      conv2d, downsample_conv / upsample_conv (diffusers' 2x resamplers)
  attention  spatial_attention: one head over all h*w positions (the mid blocks')
  leaves     KernelBias (a conv or linear leaf: kernel and bias with their init), Pointwise (a 1x1
             conv as a dense kernel). Every leaf module gives its params' diffusers keys through
             a static `sources(path, shapes)` (tensor_source.table_from_modules); containers
             mirror diffusers' attribute names and list indices, so a leaf's path is its
             diffusers module path and a VAE's key table is mechanical
  blocks     PreNormResidual (both VAEs' residual block), apply_in_order
  entry      ImageVAE (encode / decode with batch chunking and diffusers' tiled decode),
             map_chunks, tiled_decode + TileConfig, and the packed (transformer-token) entry
             points decode_packed / encode_packed, which take any VAE with ImageVAE's interface

Precision: convs and attention matmuls run in the params' dtype (inputs are cast on entry); the
attention softmax runs in float32; encode / decode return float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models.attention import kernels as attention_lib
from digen_jax.models import latents as latents_lib
from digen_jax.models.io.tensor_source import TensorSource, weight_and_bias


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


def spatial_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, query_chunk: int | None = None
) -> jax.Array:
  """Single-head softmax attention, scale 1/sqrt(C): q, k, v [B, N, C] -> [B, N, C]. The shared
  attention (models/attention/kernels.py) with one head; its portable path chunks the queries once the
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


def blend_v(a: jax.Array, b: jax.Array, extent: int) -> jax.Array:
  """diffusers blend_v on [B, H, W, C]: the top rows of b fade in from a's bottom rows."""
  e = min(a.shape[1], b.shape[1], extent)
  if e == 0:
    return b
  w = _blend_weights(e, b.dtype)[None, :, None, None]
  return b.at[:, :e].set(a[:, a.shape[1] - e :] * (1 - w) + b[:, :e] * w)


def blend_h(a: jax.Array, b: jax.Array, extent: int) -> jax.Array:
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
  overlap_h, overlap_w = tile.height - tile.stride_height, tile.width - tile.stride_width
  out_rows = []
  for a in range(len(rows)):
    pieces = []
    for b in range(len(rows[a])):
      t = rows[a][b]
      if a > 0:
        t = blend_v(rows[a - 1][b], t, overlap_h)
      if b > 0:
        t = blend_h(rows[a][b - 1], t, overlap_w)
      rows[a][b] = t
      pieces.append(t[:, : tile.stride_height, : tile.stride_width])
    out_rows.append(jnp.concatenate(pieces, axis=2))
  return jnp.concatenate(out_rows, axis=1)[:, : h * r, : w * r]


# ---------------------------------------------------------------------------------------------
# Leaves and blocks.


def kernel_init(rngs: nnx.Rngs, shape, dtype):
  return nnx.initializers.lecun_normal()(rngs.params(), shape, dtype)


class KernelBias(nnx.Module):
  """A conv or linear leaf: kernel `kernel_shape` [..., in, out] (lecun-normal init) and bias
  [out] (zeros). Subclasses apply it and give its diffusers `sources`."""

  def __init__(self, kernel_shape: tuple[int, ...], *, param_dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs, kernel_shape, param_dtype))
    self.bias = nnx.Param(jnp.zeros((kernel_shape[-1],), param_dtype))


class Pointwise(KernelBias):
  """A 1x1 Conv2d held as a dense kernel [in, out] (diffusers weight [out, in, 1, 1])."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    super().__init__((cin, cout), param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    y = jnp.einsum('...i,io->...o', x.astype(kernel.dtype), kernel)
    return y + self.bias[...].astype(y.dtype)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    return weight_and_bias(path, path, perm=(2, 3, 1, 0), shape=shapes[f'{path}.kernel'])


class PreNormResidual(nnx.Module):
  """shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x)))))): the residual block of both VAEs
  (the causal VAE's ResidualBlock; ResnetBlock2D as a VAE builds it, no time embedding).
  Subclasses build norm1, conv1, norm2, conv2 and conv_shortcut (None when the channels do not
  change). conv_args go to conv1 and conv2 (the causal VAE's frame history)."""

  def __call__(self, x: jax.Array, *conv_args) -> jax.Array:
    h = x if self.conv_shortcut is None else self.conv_shortcut(x)
    x = self.conv1(jax.nn.silu(self.norm1(x)), *conv_args)
    x = self.conv2(jax.nn.silu(self.norm2(x)), *conv_args)
    return x + h


def apply_in_order(x: jax.Array, *stages: Iterable[Callable[[jax.Array], jax.Array]]) -> jax.Array:
  """x through every module of each stage in turn (e.g. a block's resnets, then its resamplers)."""
  for stage in stages:
    for module in stage:
      x = module(x)
  return x


# ---------------------------------------------------------------------------------------------
# Entry points.


class ImageVAE(nnx.Module):
  """encode / decode of a channels-last image VAE (vae.QwenImageVAE, flux_vae.FluxVAE).

  A subclass holds `config` (with image_channels, latent_channels and spatial_compression) and
  `decoder` (whose conv_in kernel sets the compute dtype), and gives encode_mean (images in the
  compute dtype -> latent means), decode_raw (latents -> unclipped images), and normalize /
  denormalize (latent means <-> the transformer's latent space, float32)."""

  @property
  def dtype(self):
    return self.decoder.conv_in.kernel.dtype

  @property
  def image_channels(self) -> int:
    return self.config.image_channels

  @property
  def latent_channels(self) -> int:
    return self.config.latent_channels

  def encode(self, images: jax.Array, *, batch_chunk: int = 0) -> jax.Array:
    """[B, H, W, C] in [-1, 1] (H, W multiples of the compression r) -> latent mean (the
    posterior's mode) [B, H/r, W/r, latent_channels], float32, not normalised. batch_chunk > 0:
    that many images at a time."""
    r, c = self.config.spatial_compression, self.image_channels
    if images.ndim != 4 or images.shape[-1] != c or images.shape[1] % r or images.shape[2] % r:
      raise ValueError(
          f'VAE encode needs images [B, H, W, {c}] with H and W multiples of {r}, '
          f'got shape {images.shape}'
      )
    run = lambda x: self.encode_mean(x.astype(self.dtype))
    return map_chunks(run, images, batch_chunk).astype(jnp.float32)

  def decode(
      self, latents: jax.Array, *, batch_chunk: int = 0, tile: TileConfig | None = None
  ) -> jax.Array:
    """[B, h, w, latent_channels] (not normalised) -> images [B, rh, rw, C] float32 clipped to
    [-1, 1]. batch_chunk > 0: decode that many images at a time (lax.map; same result). tile:
    decode overlapping spatial tiles and blend them as diffusers' tiled_decode (which
    TileConfig AutoencoderKL's tiling is: see tiled_decode)."""
    z = self.latent_channels
    if latents.ndim != 4 or latents.shape[-1] != z:
      raise ValueError(f'VAE decode needs latents [B, h, w, {z}], got shape {latents.shape}')
    if tile is not None:
      r = self.config.spatial_compression
      tile.check(r)
      fn = functools.partial(tiled_decode, self.decode_raw, tile=tile, compression=r)
    else:
      fn = self.decode_raw
    out = map_chunks(fn, latents.astype(self.dtype), batch_chunk)
    return jnp.clip(out.astype(jnp.float32), -1.0, 1.0)


def decode_packed(
    model: Any,
    tokens: jax.Array,
    latent_hw: tuple[int, int],
    patch: int = 2,
    *,
    batch_chunk: int = 0,
    tile: TileConfig | None = None,
) -> jax.Array:
  """Transformer output tokens [B, (h/p)(w/p), z*p*p] (normalised latents, diffusers' packing)
  -> images [B, rh, rw, C] float32 in [-1, 1]: the pipelines' unpack, denormalise, decode.
  `model`: any VAE with latent_channels, denormalize and decode (an ImageVAE; QwenImagePipeline
  and FluxPipeline pack and unpack their latents the same way)."""
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
    model: Any, images: jax.Array, patch: int = 2, *, batch_chunk: int = 0
) -> jax.Array:
  """Images [B, H, W, C] in [-1, 1] -> normalised latent means packed as transformer tokens
  [B, (H/rp)(W/rp), z*p*p] float32 (the inverse of decode_packed up to the VAE's loss).
  `model`: any VAE with config.spatial_compression, encode and normalize (an ImageVAE)."""
  r = model.config.spatial_compression * patch
  if images.ndim != 4 or images.shape[1] % r or images.shape[2] % r:
    raise ValueError(
        f'encode_packed: images [B, H, W, C] need H and W multiples of {r} '
        f'(VAE compression x patch), got shape {images.shape}'
    )
  z = model.normalize(model.encode(images, batch_chunk=batch_chunk))
  return latents_lib.pack(z, patch)
