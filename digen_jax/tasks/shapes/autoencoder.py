"""A small learned autoencoder for ShapesBench: generation in a latent grid, pixels from a decoder.

The ShapesBench base generator cannot draw crisp shapes in pixel space at 32 px (patch 4: one
linear layer maps each token to 48 pixel values, and the edges stay ragged; benchmarks/RESULTS.md).
As with real models, the generator works in a small latent grid and a convolutional decoder trained
on rendered images turns latents into pixels, so sharp edges are the decoder's job.

  encoder  [B, 32, 32, 3] -> conv3x3 -> 2 x (stride-2 conv3x3) -> conv1x1 -> [B, 8, 8, C]
  decoder  [B, 8, 8, C] -> conv1x1 -> 2 x (nearest 2x + conv3x3) -> conv3x3 -> [B, 32, 32, 3]

SiLU between layers. With `shape_channels` = 3, the first three latent channels are taught to
hold, per latent cell, the share of the cell covered by a circle, a square and a triangle
(`cell_means` of render.shape_coverage; digen_jax.tasks.shapes.pretrain_ae adds the term). Why: in a purely reconstructive latent a
square and a circle of the same size differ by a few corner pixels, so a flow model's loss barely
rewards reading the shape word (benchmarks/RESULTS.md, shapes_probe); with shape channels the shape
word moves the latent as much as the colour word does, as semantically regularised VAEs of real
models make concepts prominent in their latents. With `color_channels` = 3 as well, the next
three channels hold each cell's mean object colour times coverage (render.color_coverage), so
shape and colour are separate latent factors: a prompt pairing a colour and a shape never seen
together is a combination of two latent patterns the generator has each drawn many times (with
shape channels alone, held-out pairs came out in the training colours of their shape;
benchmarks/RESULTS.md). The decoder still has to draw the shape from
them: rewards only ever see decoded pixels. The latents are normalised to unit variance per channel with statistics
measured on rendered images (`latent_mean`, `latent_std`, fixed after training), so the flow
model sees N(0, 1)-scaled data. The decoder is trained on lightly perturbed latents as well as
clean ones, so the slightly-off latents a generator produces still decode to clean shapes.

The interface is the pipeline VAEs' (models/vae/qwen_vae.py, flux_vae.py): `latent_channels`,
`spatial_compression`, `encode`, `decode` (clipped to [-1, 1]), `normalize`, `denormalize`, so
`vae.decode_packed` decodes packed generator tokens with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from digen_jax.models.io import params_io
from digen_jax.models.io import streaming
from digen_jax.tasks.shapes.grammar import SHAPES

# config.json's format of an autoencoder params folder (models/io/params_io.py).
AE_FORMAT = 'digen_jax.shapes_ae/1'


@dataclasses.dataclass(frozen=True)
class ShapesAEConfig:
  latent_channels: int = 4
  shape_channels: int = 0  # 0, or len(SHAPES): leading channels that hold shape coverage
  color_channels: int = 0  # 0, or 3: the next channels hold RGB colour x coverage
  width: int = 64  # channels of the 16x16 and 8x8 stages (the 32x32 one has half)
  downsamples: int = 2  # each halves the resolution: 32 px -> 8x8 latents
  latent_mean: tuple[float, ...] = ()  # per channel, measured after training ('' = 0)
  latent_std: tuple[float, ...] = ()  # per channel ('' = 1)

  @property
  def spatial_compression(self) -> int:
    return 2**self.downsamples

  @property
  def semantic_channels(self) -> int:
    """Leading latent channels with a target (shape coverage, then colour x coverage)."""
    return self.shape_channels + self.color_channels

  def __post_init__(self):
    if self.latent_channels < 1 or self.width < 2 or self.downsamples < 1:
      raise ValueError(
          f'ShapesAEConfig: latent_channels={self.latent_channels}, width={self.width}, '
          f'downsamples={self.downsamples} must be >= 1, >= 2, >= 1'
      )
    if self.shape_channels not in (0, len(SHAPES)) or self.shape_channels > self.latent_channels:
      raise ValueError(
          f'ShapesAEConfig.shape_channels={self.shape_channels} must be 0 or '
          f'{len(SHAPES)} (one per shape), and <= latent_channels={self.latent_channels}'
      )
    if self.color_channels not in (0, 3) or self.semantic_channels > self.latent_channels:
      raise ValueError(
          f'ShapesAEConfig.color_channels={self.color_channels} must be 0 or 3 (RGB), and '
          f'shape_channels + color_channels <= latent_channels={self.latent_channels}'
      )
    for name in ('latent_mean', 'latent_std'):
      v = getattr(self, name)
      object.__setattr__(self, name, tuple(float(x) for x in v))
      if v and len(v) != self.latent_channels:
        raise ValueError(f'ShapesAEConfig.{name} needs {self.latent_channels} values, got {len(v)}')
    if any(not s > 0 for s in self.latent_std):
      raise ValueError(f'ShapesAEConfig.latent_std must be > 0, got {self.latent_std}')


def _conv(cin: int, cout: int, k: int, rngs: nnx.Rngs, stride: int = 1) -> nnx.Conv:
  return nnx.Conv(cin, cout, (k, k), strides=(stride, stride), padding='SAME', rngs=rngs)


def _upsample(x: jax.Array) -> jax.Array:
  return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


class ShapesAE(nnx.Module):
  """See the module docstring. Images channels-last in [-1, 1]."""

  def __init__(self, config: ShapesAEConfig, *, rngs: nnx.Rngs):
    self.config = config
    w, c = config.width, config.latent_channels
    half = max(w // 2, 1)
    self.enc_in = _conv(3, half, 3, rngs)
    chans = [half] + [w] * config.downsamples
    self.enc_down = nnx.List(
        [_conv(chans[i], chans[i + 1], 3, rngs, stride=2) for i in range(config.downsamples)]
    )
    self.enc_out = _conv(w, c, 1, rngs)
    self.dec_in = _conv(c, w, 1, rngs)
    up = [w] * config.downsamples + [half]
    self.dec_up = nnx.List([_conv(up[i], up[i + 1], 3, rngs) for i in range(config.downsamples)])
    self.dec_out = _conv(half, 3, 3, rngs)

  @property
  def latent_channels(self) -> int:
    return self.config.latent_channels

  def encode(self, images: jax.Array, *, batch_chunk: int = 0) -> jax.Array:
    """[B, H, W, 3] -> raw latents [B, H/r, W/r, C] (not normalised)."""
    del batch_chunk
    x = jax.nn.silu(self.enc_in(images.astype(jnp.float32)))
    for conv in self.enc_down:
      x = jax.nn.silu(conv(x))
    return self.enc_out(x)

  def cell_means(self, maps: jax.Array) -> jax.Array:
    """Per-pixel maps [B, H, W, K] (shape coverage, colour x coverage) -> what the matching
    channels of the raw latents should hold: their mean over each latent cell, [B, H/r, W/r, K]."""
    b, h, w, k = maps.shape
    r = self.config.spatial_compression
    return maps.reshape(b, h // r, r, w // r, r, k).mean(axis=(2, 4))

  def decode_raw(self, latents: jax.Array) -> jax.Array:
    """Raw latents [B, h, w, C] -> images [B, r h, r w, 3], unclipped."""
    x = jax.nn.silu(self.dec_in(latents.astype(jnp.float32)))
    for conv in self.dec_up:
      x = jax.nn.silu(conv(_upsample(x)))
    return self.dec_out(x)

  def decode(self, latents: jax.Array, *, batch_chunk: int = 0, tile: Any = None) -> jax.Array:
    """Raw latents -> images clipped to [-1, 1] (batch_chunk/tile accepted for the VAE
    interface; the model is small enough to decode whole)."""
    del batch_chunk
    if tile is not None:
      raise ValueError('ShapesAE decodes whole images; set config.latent.vae_tile=0')
    return jnp.clip(self.decode_raw(latents), -1.0, 1.0)

  def _stats(self, dtype):
    c = self.config
    mean = jnp.asarray(c.latent_mean or (0.0,) * c.latent_channels, dtype)
    std = jnp.asarray(c.latent_std or (1.0,) * c.latent_channels, dtype)
    return mean, std

  def normalize(self, z: jax.Array) -> jax.Array:
    mean, std = self._stats(z.dtype)
    return (z - mean) / std

  def denormalize(self, z: jax.Array) -> jax.Array:
    mean, std = self._stats(z.dtype)
    return z * std + mean


# --------------------------------------------------------------------------------------------
# The pipeline-VAE module interface (weights.VAESource.lib): read, abstract, key table, decode.


def read_vae_config(folder) -> ShapesAEConfig:
  """The config of an autoencoder params folder (digen_jax.tasks.shapes.pretrain_ae's DIR/params)."""
  meta = params_io.read_config(folder)
  if meta.get('format') != AE_FORMAT:
    raise ValueError(
        f'{folder} holds {meta.get("format")!r}, not a ShapesBench autoencoder '
        f'({AE_FORMAT!r}); make one with python -m digen_jax.tasks.shapes.pretrain_ae'
    )
  return ShapesAEConfig(**meta['model_config'])


def abstract_vae(config: ShapesAEConfig, param_dtype: Any = jnp.float32):
  """(graphdef, state of ShapeDtypeStructs); params are float32 (param_dtype is the VAE API's)."""
  del param_dtype
  return nnx.split(nnx.eval_shape(lambda: ShapesAE(config, rngs=nnx.Rngs(0))))


def vae_key_table(config: ShapesAEConfig):
  """Our own layout: every param's file key is its dotted path."""
  return streaming.identity_table(abstract_vae(config)[1])


params_io.register_kind(AE_FORMAT, ShapesAEConfig, ShapesAE)
