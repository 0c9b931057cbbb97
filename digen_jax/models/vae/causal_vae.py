"""The Wan2.1 causal 3-D VAE in flax NNX: one implementation for Wan2.1's videos (diffusers
``AutoencoderKLWan``) and Qwen-Image's images (``AutoencoderKLQwenImage`` is the same network,
used on one frame). Its config is causal_vae_config.py's; vae.py and wan_vae.py only add each
pipeline's config keys and entry points.

Channels-last throughout: videos [B, T, H, W, C] and images [B, H, W, C] in [-1, 1]; latents
[B, F, h, w, z_dim] and [B, h, w, z_dim], h = H / 8, F = 1 + (T - 1) / 4 (with Wan2.1's
temperal_downsample [False, True, True]: 2 ** len spatially, 2 ** sum temporally).

Causality and chunks, as diffusers runs them. Every 3-D conv pads time on the left only, so frame t
sees frames <= t. diffusers encodes the first frame alone, then 4 frames at a time, and decodes one
latent frame at a time; between chunks each causal conv keeps the last 2 frames of its input
(`feat_cache`), each temporal downsampler the last frame, and a temporal upsampler starts from zero
frames after the first chunk, which it passes through without its time conv. `FrameHistory` is
that cache: fixed-shape arrays in call order, zeros before the video. The first chunk (one frame
everywhere, so each conv is a 2-D conv with the kernel's last temporal tap) runs on its own and
yields the history; the remaining chunks, all of one shape, run under one lax.scan carrying it:
memory is one chunk's activations plus the history, whatever the frame count. An image is the
first chunk alone (its history is dropped), hence Qwen-Image's VAE.

Parameter layout (names mirror diffusers, so the key table is mechanical):
  causal 3-D convs   kernel [kt, kh, kw, in, out]  <- weight [out, in, kt, kh, kw]
  resample convs     kernel [3, 3, in, out]        <- `resample.1.weight` [out, in, 3, 3]
  attention 1x1s     kernel [in, out]              <- weight [out, in, 1, 1]
  RMS norm gammas    gamma [C]                     <- gamma [C, 1, 1(, 1)]

Precision: convs and attention matmuls run in the params' dtype (inputs are cast on entry); norm
statistics and the attention softmax run in float32; encode / decode return float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp

from digen_jax.models.vae.causal_vae_config import (
    ENCODE_CHUNK_FRAMES,
    VAEConfig,
    denormalize_latents,
    normalize_latents,
)
from digen_jax.models.io.tensor_source import TensorSource, weight_and_bias
from digen_jax.models.vae.vae_blocks import (
    ImageVAE,
    KernelBias,
    Pointwise,
    PreNormResidual,
    conv2d,
    downsample_conv,
    map_chunks,
    TileConfig,
    spatial_attention,
    tiled_decode,
    upsample_conv,
)

# F.normalize's default eps (diffusers' RMS_norm divides by max(||x||_2, eps)).
NORM_EPS = 1e-12


# ---------------------------------------------------------------------------------------------
# Pure functions and the frame history.


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
  """diffusers' RMS_norm over the channel (last) axis, in float32: x / max(|x|, eps) * sqrt(C) *
  gamma. [..., C] -> [..., C] in x's dtype."""
  x32 = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
  scale = math.sqrt(x.shape[-1])
  return (x32 / jnp.maximum(norm, NORM_EPS) * scale * gamma.astype(jnp.float32)).astype(x.dtype)


def per_frame(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """fn on every frame of x [B, T, H, W, C] (frames folded into the batch) -> [B, T, H', W', C']."""
  b, t = x.shape[:2]
  y = fn(x.reshape(b * t, *x.shape[2:]))
  return y.reshape(b, t, *y.shape[1:])


def conv3d(x: jax.Array, kernel: jax.Array, bias: jax.Array, time_stride: int = 1) -> jax.Array:
  """NDHWC conv in the kernel's dtype, no time padding (the frames before x are in x), spatial
  'same' padding. kernel [kt, kh, kw, in, out], bias [out]."""
  kh, kw = kernel.shape[1:3]
  y = jax.lax.conv_general_dilated(
      x.astype(kernel.dtype),
      kernel,
      (time_stride, 1, 1),
      [(0, 0), ((kh - 1) // 2,) * 2, ((kw - 1) // 2,) * 2],
      dimension_numbers=('NDHWC', 'DHWIO', 'NDHWC'),
  )
  return y + bias.astype(y.dtype)


class FrameHistory:
  """The causal state of one chunk pass: for each causal layer, in call order, the trailing frames
  of its input that the next chunk needs (diffusers' feat_cache, indexed by call order as its
  feat_idx is). past: the previous chunk's `states`, or None in the first chunk (zero frames before
  the video). A pass appends this chunk's states, for the next."""

  def __init__(self, past: list[jax.Array] | None = None):
    self.past = past
    self.states: list[jax.Array] = []

  @property
  def first(self) -> bool:
    return self.past is None

  def exchange(self, x: jax.Array, frames: int) -> jax.Array | None:
    """The `frames` frames this layer saw before x [B, T, ...] (None in the first chunk: zeros);
    records the last `frames` frames of [those, x] for the next chunk."""
    past = None if self.past is None else self.past[len(self.states)]
    joined = x if past is None else jnp.concatenate([past, x], axis=1)
    if joined.shape[1] < frames:  # a first chunk shorter than the window: zeros before it
      pad = [(0, 0), (frames - joined.shape[1], 0)] + [(0, 0)] * (x.ndim - 2)
      joined = jnp.pad(joined, pad)
    self.states.append(joined[:, -frames:])
    return past


# ---------------------------------------------------------------------------------------------
# Leaves (vae_blocks.py: each gives its diffusers `sources`).


class CausalConv(KernelBias):
  """diffusers' CausalConv3d: time padded on the left by kt - 1 frames (zeros before the video,
  the previous chunk's frames after it), 'same' spatial padding. [B, T, H, W, in] ->
  [B, T, H, W, out]. A frame without history is a 2-D conv with the kernel's last temporal tap
  (the earlier taps only see zeros), which is all an image or a first chunk ever runs."""

  def __init__(
      self, cin: int, cout: int, kernel: tuple[int, int, int], *, param_dtype, rngs: nnx.Rngs
  ):
    super().__init__((*kernel, cin, cout), param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, history: FrameHistory | None = None) -> jax.Array:
    kernel, bias = self.kernel[...], self.bias[...]
    kt = kernel.shape[0]
    past = history.exchange(x, kt - 1) if (history is not None and kt > 1) else None
    if past is None and x.shape[1] == 1:
      pads = [((kernel.shape[1] - 1) // 2,) * 2, ((kernel.shape[2] - 1) // 2,) * 2]
      return per_frame(lambda f: conv2d(f, kernel[-1], bias, padding=pads), x)
    if past is None:
      past = jnp.zeros((x.shape[0], kt - 1, *x.shape[2:]), x.dtype)
    return conv3d(jnp.concatenate([past, x], axis=1), kernel, bias)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, path, perm=(2, 3, 4, 1, 0))


class ResampleConv(KernelBias):
  """The 3x3 Conv2d of a resampler; diffusers wraps it as nn.Sequential(pad or upsample, conv),
  hence its keys `<path>.1.weight`. Applied by Resample (padding and stride differ)."""

  def __init__(self, cin: int, cout: int, *, param_dtype, rngs: nnx.Rngs):
    super().__init__((3, 3, cin, cout), param_dtype=param_dtype, rngs=rngs)

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    del shapes
    return weight_and_bias(path, f'{path}.1', perm=(2, 3, 1, 0))


class RMSNorm(nnx.Module):
  """diffusers' RMS_norm (no bias in any of these VAEs' norms)."""

  def __init__(self, dim: int, *, param_dtype):
    self.gamma = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.gamma[...])

  @staticmethod
  def sources(path: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorSource]:
    return {f'{path}.gamma': TensorSource((f'{path}.gamma',), shape=shapes[f'{path}.gamma'])}


LEAVES = (CausalConv, ResampleConv, Pointwise, RMSNorm)


# ---------------------------------------------------------------------------------------------
# Blocks: every __call__ takes x [B, T, H, W, C] and the chunk's FrameHistory.


class ResidualBlock(PreNormResidual):
  """diffusers' ResidualBlock: shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))."""

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
  """diffusers' AttentionBlock: x + proj(attn(to_qkv(norm(x)))), one head over each frame's h*w."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.norm = RMSNorm(dim, param_dtype=param_dtype)
    self.to_qkv = Pointwise(dim, 3 * dim, param_dtype=param_dtype, rngs=rngs)
    self.proj = Pointwise(dim, dim, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    del history  # attention sees one frame at a time

    def frame(f):
      b, h, w, c = f.shape
      q, k, v = jnp.split(self.to_qkv(self.norm(f)).reshape(b, h * w, 3 * c), 3, axis=-1)
      return f + self.proj(spatial_attention(q, k, v).reshape(b, h, w, c))

    return per_frame(frame, x)


class Resample(nnx.Module):
  """diffusers' Resample. down: zero-pad right/bottom by 1, 3x3 stride-2 conv per frame, then in
  3-D mode a stride-2 time conv over [the previous chunk's last frame, x] (none in the first
  chunk). up: in 3-D mode a causal time conv doubling the channels, unfolded into twice the frames
  (none in the first chunk, after which it starts from zero frames), then nearest 2x and a 3x3
  conv to dim // 2 channels per frame."""

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

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    kernel, bias = self.resample.kernel[...], self.resample.bias[...]
    if self.mode == 'upsample3d':
      if history.first:  # diffusers' 'Rep': the next chunk's time conv starts from zeros
        history.exchange(jnp.zeros_like(x), 2)
      else:
        y = self.time_conv(x, history)  # [B, T, H, W, 2C]: channel halves are frames 2t, 2t+1
        b, t, h, w, c2 = y.shape
        y = jnp.moveaxis(y.reshape(b, t, h, w, 2, c2 // 2), 4, 2)
        x = y.reshape(b, 2 * t, h, w, c2 // 2)
    if self.mode.startswith('upsample'):
      return per_frame(lambda f: upsample_conv(f, kernel, bias), x)
    x = per_frame(lambda f: downsample_conv(f, kernel, bias), x)
    if self.mode == 'downsample3d':
      past = history.exchange(x, 1)
      if past is not None:
        conv = self.time_conv
        x = conv3d(jnp.concatenate([past, x], axis=1), conv.kernel[...], conv.bias[...], 2)
    return x


def run_in_order(x: jax.Array, history: FrameHistory, *stages) -> jax.Array:
  """x through every block of each stage in turn, each given the chunk's history."""
  for stage in stages:
    for block in stage:
      x = block(x, history)
  return x


class MidBlock(nnx.Module):
  """diffusers' MidBlock (num_layers=1): resnet, attention, resnet."""

  def __init__(self, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.resnets = nnx.List(
        [ResidualBlock(dim, dim, param_dtype=param_dtype, rngs=rngs) for _ in range(2)]
    )
    self.attentions = nnx.List([AttentionBlock(dim, param_dtype=param_dtype, rngs=rngs)])

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    x = self.resnets[0](x, history)
    for attn, resnet in zip(self.attentions, list(self.resnets)[1:]):
      x = resnet(attn(x, history), history)
    return x


class Encoder(nnx.Module):
  """diffusers' Encoder3d: [B, T, H, W, C] -> [B, T', H/8, W/8, 2 * z_dim] (T' = T for a first
  chunk, T / 4 after it)."""

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

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    x = run_in_order(x, history, [self.conv_in], self.down_blocks, [self.mid_block])
    return self.conv_out(jax.nn.silu(self.norm_out(x)), history)


class UpBlock(nnx.Module):
  """diffusers' UpBlock: num_res_blocks + 1 resnets, then an optional upsampler."""

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

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    return run_in_order(x, history, self.resnets, self.upsamplers)


class Decoder(nnx.Module):
  """diffusers' Decoder3d: [B, F, h, w, z_dim] -> [B, T, 8h, 8w, C] (unclipped; T = F for a first
  chunk, 4F after it)."""

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

  def __call__(self, x: jax.Array, history: FrameHistory) -> jax.Array:
    x = run_in_order(x, history, [self.conv_in, self.mid_block], self.up_blocks)
    return self.conv_out(jax.nn.silu(self.norm_out(x)), history)


# ---------------------------------------------------------------------------------------------
# The model.


def in_chunks(run: Callable[[jax.Array, FrameHistory], jax.Array], x: jax.Array, size: int):
  """run(chunk, history) over x [B, T, ...] in diffusers' chunks: frame 0 alone, then `size`
  frames at a time ((T - 1) % size == 0), the history carried from chunk to chunk; the later
  chunks under one lax.scan. Returns the outputs concatenated along frames."""
  history = FrameHistory()
  first = run(x[:, :1], history)
  n = (x.shape[1] - 1) // size
  if n == 0:
    return first
  chunks = jnp.moveaxis(x[:, 1:].reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)

  def step(states, chunk):
    history = FrameHistory(states)
    out = run(chunk, history)
    return history.states, out

  _, rest = jax.lax.scan(step, history.states, chunks)  # [n, B, T_out, ...]
  rest = jnp.moveaxis(rest, 0, 1)
  return jnp.concatenate([first, rest.reshape(rest.shape[0], -1, *rest.shape[3:])], axis=1)


def tiled_video_decode(
    decode_frames: Callable[[jax.Array], jax.Array],
    z: jax.Array,
    *,
    tile: TileConfig,
    compression: int,
    channels: int,
) -> jax.Array:
  """AutoencoderKLWan.tiled_decode of latents z [B, F, h, w, C] into frames of `channels`: each
  spatial tile decodes all its frames (with a history of its own), tiles blend per frame.
  vae_blocks.tiled_decode tiles and blends them with the frames folded into the channels."""
  b, f, h, w, c = z.shape

  def decode(folded):  # [B', th, tw, F*C] -> [B', TH, TW, T*channels]
    frames = decode_frames(jnp.moveaxis(folded.reshape(*folded.shape[:3], f, c), 3, 1))
    return jnp.moveaxis(frames, 1, 3).reshape(*frames.shape[:1], *frames.shape[2:4], -1)

  out = tiled_decode(decode, jnp.moveaxis(z, 1, 3).reshape(b, h, w, f * c), tile, compression)
  return jnp.moveaxis(out.reshape(*out.shape[:3], -1, channels), 3, 1)


class CausalVAE(ImageVAE):
  """AutoencoderKLWan / AutoencoderKLQwenImage (see the module docstring). Images through
  ImageVAE's encode / decode (batch chunks, tiled decode); videos through encode_video /
  decode_video (frame chunks under a scan, batch chunks)."""

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

  def encode_frames(self, x: jax.Array) -> jax.Array:
    """Frames [B, 1 + 4k, H, W, C] in the compute dtype -> posterior means [B, 1 + k', h, w, z]
    (k' = k * 4 / temporal_compression), diffusers' _encode chunk by chunk."""
    out = in_chunks(self.encoder, x, ENCODE_CHUNK_FRAMES)
    return self.quant_conv(out)[..., : self.config.z_dim]

  def decode_frames(self, z: jax.Array) -> jax.Array:
    """Latents [B, F, h, w, z] (not normalised) -> unclipped frames [B, 1 + (F - 1) * 4, H, W,
    C], diffusers' _decode one latent frame at a time."""
    return in_chunks(self.decoder, self.post_quant_conv(z), 1)

  def encode_mean(self, x: jax.Array) -> jax.Array:
    """Images [B, H, W, C] in the compute dtype -> the posterior's mean [B, H/8, W/8, z_dim]."""
    return self.encode_frames(x[:, None])[:, 0]

  def decode_raw(self, z: jax.Array) -> jax.Array:
    """Latents [B, h, w, z] (not normalised) -> unclipped images [B, 8h, 8w, C]."""
    return self.decode_frames(z[:, None])[:, 0]

  def encode_video(self, videos: jax.Array, *, batch_chunk: int = 0) -> jax.Array:
    """[B, T, H, W, C] in [-1, 1], T = 1 + 4k, H and W multiples of the compression r -> latent
    means [B, 1 + k, H/r, W/r, z_dim] float32, not normalised. batch_chunk > 0: that many videos
    at a time."""
    r, c = self.config.spatial_compression, self.image_channels
    ok = (
        videos.ndim == 5
        and videos.shape[-1] == c
        and (videos.shape[1] - 1) % ENCODE_CHUNK_FRAMES == 0
    )
    if not ok or videos.shape[2] % r or videos.shape[3] % r:
      raise ValueError(
          f'VAE encode_video needs videos [B, 1 + 4k, H, W, {c}] with H and W multiples of {r}, '
          f'got shape {videos.shape}'
      )
    run = lambda v: self.encode_frames(v.astype(self.dtype))
    return map_chunks(run, videos, batch_chunk).astype(jnp.float32)

  def decode_video(
      self, latents: jax.Array, *, batch_chunk: int = 0, tile: TileConfig | None = None
  ) -> jax.Array:
    """[B, F, h, w, z_dim] (not normalised) -> videos [B, 1 + (F - 1) * temporal_compression, rh,
    rw, C] float32 clipped to [-1, 1]. batch_chunk > 0: that many videos at a time. tile: decode
    overlapping spatial tiles, every frame of each, blended as AutoencoderKLWan.tiled_decode."""
    z = self.latent_channels
    if latents.ndim != 5 or latents.shape[-1] != z:
      raise ValueError(f'VAE decode_video needs latents [B, F, h, w, {z}], got {latents.shape}')
    fn = self.decode_frames
    if tile is not None:
      r = self.config.spatial_compression
      tile.check(r)
      fn = functools.partial(
          tiled_video_decode,
          self.decode_frames,
          tile=tile,
          compression=r,
          channels=self.image_channels,
      )
    out = map_chunks(fn, latents.astype(self.dtype), batch_chunk)
    return jnp.clip(out.astype(jnp.float32), -1.0, 1.0)
