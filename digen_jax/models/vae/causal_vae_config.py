"""The causal VAE's config (causal_vae.py's network: Wan2.1's VAE, also Qwen-Image's) and the
latent normalisation both pipelines apply with its statistics.

`VAEConfig` holds AutoencoderKLQwenImage's config keys, with their checks; vae.py reads Qwen-Image's
config.json into it, wan_vae.py AutoencoderKLWan's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import config_checks

# diffusers' _encode: the first frame alone, then this many frames per chunk.
ENCODE_CHUNK_FRAMES = 4

# Both AutoencoderKLWan's and AutoencoderKLQwenImage's defaults (the released VAE's statistics).
# fmt: off
_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)
# fmt: on


@dataclasses.dataclass(frozen=True)
class VAEConfig:
  """Architecture of the causal VAE; defaults are diffusers' (the released Wan2.1 / Qwen-Image
  VAE). Field names (including the spelling `temperal_downsample`) are AutoencoderKLQwenImage's
  config keys; wan_vae.py maps AutoencoderKLWan's onto them."""

  base_dim: int = 96
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  attn_scales: tuple[float, ...] = ()
  temperal_downsample: tuple[bool, ...] = (False, True, True)
  dropout: float = 0.0  # inference only: dropout is the identity here, as in diffusers' eval()
  input_channels: int = 3
  latents_mean: tuple[float, ...] = _LATENTS_MEAN
  latents_std: tuple[float, ...] = _LATENTS_STD

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
    if sum(map(bool, self.temperal_downsample)) > 2:
      raise ValueError(
          f'VAEConfig.temperal_downsample={list(self.temperal_downsample)}: at most 2 temporal '
          f'downsamplings (diffusers encodes {ENCODE_CHUNK_FRAMES} frames per chunk)'
      )
    if self.attn_scales:
      # diffusers' encoder calls its down-block attention with (x, feat_cache, feat_idx), which
      # the attention block's forward does not accept: no usable checkpoint has them.
      raise ValueError(
          f'VAEConfig.attn_scales={list(self.attn_scales)} is not supported '
          f'(diffusers cannot encode with it either); Wan2.1 and Qwen-Image use []'
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'VAEConfig.dropout must be in [0, 1), got {self.dropout}')
    for name in ('latents_mean', 'latents_std'):
      if len(getattr(self, name)) != self.z_dim:
        raise ValueError(
            f'VAEConfig.{name} needs z_dim={self.z_dim} values, got {len(getattr(self, name))}'
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

  @property
  def temporal_compression(self) -> int:
    """Frames per latent frame after the first (WanPipeline's vae_scale_factor_temporal)."""
    return 2 ** sum(map(bool, self.temperal_downsample))


# ---------------------------------------------------------------------------------------------
# Latent normalisation.


def normalize_latents(z: jax.Array, config: VAEConfig) -> jax.Array:
  """(z - mean) / std per channel (last axis), as the pipelines normalise encoded latents."""
  mean = jnp.asarray(config.latents_mean, jnp.float32)
  std = jnp.asarray(config.latents_std, jnp.float32)
  return (z.astype(jnp.float32) - mean) / std


def denormalize_latents(z: jax.Array, config: VAEConfig) -> jax.Array:
  """Inverse of normalize_latents, as QwenImagePipeline and WanPipeline write it: z / (1 / std) +
  mean."""
  mean = jnp.asarray(config.latents_mean, jnp.float32)
  inv_std = 1.0 / jnp.asarray(config.latents_std, jnp.float32)
  return z.astype(jnp.float32) / inv_std + mean
