"""Wan2.1 VAE (diffusers ``AutoencoderKLWan``) in flax NNX, for videos.

The network is causal_vae.py's (shared with Qwen-Image's VAE, vae.py). This module holds what is
Wan's own: AutoencoderKLWan's config.json keys, the load path, and the packed entry points that
WanPipeline's latents take:

    decode:  z = unpack_frames(tokens) / (1 / latents_std) + latents_mean;  video = vae.decode(z)
    encode:  tokens = pack_frames((vae.encode(video).mode() - latents_mean) / latents_std)

Videos are channels-last [B, T, H, W, C] in [-1, 1] with T = 1 + 4k frames; latents are
[B, 1 + k, H/8, W/8, z_dim]; tokens are latents.pack_frames's [B, (1 + k)(h/p)(w/p), z*p*p].

    model = wan_vae.load_vae_folder('/ckpt/Wan2.1-T2V-1.3B-Diffusers', param_dtype=jnp.bfloat16)
    video = wan_vae.decode_packed(model, tokens, latent_shape=(21, 60, 104))  # [B, 81, 480, 832, 3]
    tokens = wan_vae.encode_packed(model, video)

decode_packed runs inside a jitted program: frame chunks under one lax.scan (memory of one chunk,
whatever the length), `batch_chunk` videos at a time, and optionally spatial tiles (`tile`, as
AutoencoderKLWan.enable_tiling).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

from digen_jax.models.vae import causal_vae
from digen_jax.models import latents as latents_lib
from digen_jax.models.io import loading
from digen_jax.models.vae.causal_vae_config import VAEConfig
from digen_jax.models.vae.vae_blocks import TileConfig as TileConfig  # re-exported: decode tiling

DIFFUSERS_CLASS_NAME = 'AutoencoderKLWan'

# AutoencoderKLWan's config keys (diffusers 0.42.1) read as VAEConfig's fields of the same name.
_SAME_KEYS = (
    'base_dim',
    'z_dim',
    'dim_mult',
    'num_res_blocks',
    'attn_scales',
    'temperal_downsample',
    'dropout',
    'latents_mean',
    'latents_std',
)
# The rest: checked against what the network implements (Wan2.1's layout).
_OTHER_KEYS = (
    'decoder_base_dim',
    'is_residual',
    'in_channels',
    'out_channels',
    'patch_size',
    'scale_factor_temporal',
    'scale_factor_spatial',
)

# The module: causal_vae's, whose videos run in frame chunks.
WanVAE = causal_vae.CausalVAE


def config_from_diffusers(cfg: Mapping[str, Any]) -> VAEConfig:
  """VAEConfig from an AutoencoderKLWan vae/config.json dict. Keys starting with '_' are metadata;
  any other unknown key raises, as does a Wan2.2 layout (residual blocks, patchified input, another
  decoder width). Missing keys take diffusers' defaults."""
  loading.check_config_keys(
      cfg, DIFFUSERS_CLASS_NAME, _SAME_KEYS + _OTHER_KEYS, kind='VAE', what='the Wan VAE'
  )
  if cfg.get('is_residual') or cfg.get('patch_size') is not None:
    raise ValueError(
        f'is_residual={cfg.get("is_residual")!r}, patch_size={cfg.get("patch_size")!r}: the Wan2.2 '
        'VAE (residual blocks, patchified frames) is not supported; Wan2.1 has false and null'
    )
  base = cfg.get('base_dim', VAEConfig.base_dim)
  if cfg.get('decoder_base_dim') not in (None, base):
    raise ValueError(
        f'decoder_base_dim={cfg["decoder_base_dim"]!r} differs from base_dim={base}: not supported'
    )
  channels = cfg.get('in_channels', 3)
  if cfg.get('out_channels', channels) != channels:
    raise ValueError(
        f'in_channels={channels} and out_channels={cfg["out_channels"]} differ: not supported'
    )
  config = VAEConfig(input_channels=channels, **{k: cfg[k] for k in _SAME_KEYS if k in cfg})
  for key, ours in (
      ('scale_factor_spatial', config.spatial_compression),
      ('scale_factor_temporal', config.temporal_compression),
  ):
    if cfg.get(key) not in (None, ours):
      raise ValueError(
          f'{key}={cfg[key]!r}, but temperal_downsample={list(config.temperal_downsample)} '
          f'compresses by {ours} (WanPipeline sizes its latents by {key})'
      )
  return config


def decode_packed(
    model: Any,
    tokens: jax.Array,
    latent_shape: tuple[int, int, int],
    patch: int = 2,
    *,
    batch_chunk: int = 0,
    tile: TileConfig | None = None,
) -> jax.Array:
  """Transformer output tokens [B, F*(h/p)*(w/p), z*p*p] (normalised, latents.pack_frames) for a
  latent video latent_shape = (F, h, w) -> videos [B, 1 + (F - 1) * 4, 8h, 8w, C] float32 in
  [-1, 1]: WanPipeline's denormalise and decode."""
  f, h, w = latent_shape
  want = f * (h // patch) * (w // patch), model.latent_channels * patch * patch
  if h % patch or w % patch or tokens.ndim != 3 or tuple(tokens.shape[1:]) != want:
    raise ValueError(
        f'decode_packed: latent_shape={tuple(latent_shape)} with patch={patch} needs tokens '
        f'[B, {want[0]}, {want[1]}] and h, w multiples of {patch}; got tokens {tokens.shape}'
    )
  z = model.denormalize(latents_lib.unpack_frames(tokens, f, h, w, patch))
  return model.decode_video(z, batch_chunk=batch_chunk, tile=tile)


def encode_packed(
    model: Any, videos: jax.Array, patch: int = 2, *, batch_chunk: int = 0
) -> jax.Array:
  """Videos [B, 1 + 4k, H, W, C] in [-1, 1] -> normalised latent means packed as transformer tokens
  [B, (1 + k)(H/8p)(W/8p), z*p*p] float32 (the inverse of decode_packed up to the VAE's loss)."""
  r = model.config.spatial_compression * patch
  if videos.ndim != 5 or videos.shape[2] % r or videos.shape[3] % r:
    raise ValueError(
        f'encode_packed: videos [B, T, H, W, C] need H and W multiples of {r} '
        f'(VAE compression x patch), got shape {videos.shape}'
    )
  z = model.normalize(model.encode_video(videos, batch_chunk=batch_chunk))
  return latents_lib.pack_frames(z, patch)


# ---------------------------------------------------------------------------------------------
# Loading (models/io/loading.py's load path).


LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME, 'vae', config_from_diffusers, WanVAE, 'VAE', leaves=causal_vae.LEAVES
)
# The interface of family.vae (models/family.py): config, abstract module and key table.
read_vae_config = LOADER.read_config
abstract_vae = LOADER.abstract
vae_key_table = LOADER.table
# WanVAE with weights streamed from a diffusers folder (vae/ or a pipeline folder holding it) onto
# the first local device.
load_vae_folder = LOADER.load_folder
