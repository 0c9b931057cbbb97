"""Qwen-Image VAE (diffusers ``AutoencoderKLQwenImage``) in flax NNX, for single images.

AutoencoderKLQwenImage is Wan2.1's causal 3-D VAE; the network is causal_vae.py's (shared with
wan_vae.py), run on one frame: diffusers pads every causal 3-D conv with zero frames in front, so
for one frame only the LAST temporal tap of a kernel sees data, and the `time_conv` layers of the
3-D resamplers act only from the second frame on. This module holds what is Qwen-Image's own:
the config.json keys and the load path.

Images are channels-last [B, H, W, C] in [-1, 1]; latents are [B, h, w, z_dim] with h = H / 8
(8 = 2 ** len(temperal_downsample)).

    model = vae.load_vae_folder('/ckpt/Qwen-Image', param_dtype=jnp.bfloat16)   # or .../vae
    images = vae.decode_packed(model, tokens, latent_hw=(166, 166))            # [B, 1328, 1328, 3]
    tokens = vae.encode_packed(model, images)                                  # normalised, packed

encode / decode (batch chunking, tiled decode) and the packed entry points are vae_blocks.py's,
shared with flux_vae.py (FLUX.1's AutoencoderKL); the load path is models/io/loading.py's.
"""

from __future__ import annotations

from typing import Any, Mapping

from digen_jax.models.vae import causal_vae
from digen_jax.models.io import loading
from digen_jax.models.vae.causal_vae import rms_norm as rms_norm  # re-exported: this VAE's names
from digen_jax.models.vae.causal_vae_config import (
    VAEConfig as VAEConfig,
    denormalize_latents as denormalize_latents,
    normalize_latents as normalize_latents,
)
from digen_jax.models.vae.vae_blocks import (  # re-exported, as before
    TileConfig as TileConfig,  # the decode tiling of both image VAEs
    decode_packed as decode_packed,  # this VAE's packed entry points
    encode_packed as encode_packed,
)

DIFFUSERS_CLASS_NAME = 'AutoencoderKLQwenImage'

# AutoencoderKLQwenImage's config keys: exactly VAEConfig's fields.
_CONFIG_KEYS = (
    'base_dim',
    'z_dim',
    'dim_mult',
    'num_res_blocks',
    'attn_scales',
    'temperal_downsample',
    'dropout',
    'input_channels',
    'latents_mean',
    'latents_std',
)

# The module: causal_vae's, whose images are the one-frame case.
QwenImageVAE = causal_vae.CausalVAE


def config_from_diffusers(cfg: Mapping[str, Any]) -> VAEConfig:
  """VAEConfig from a diffusers vae/config.json dict. Keys starting with '_' are metadata; any
  other unknown key raises (it may change the math). Missing keys take diffusers' defaults."""
  loading.check_config_keys(cfg, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, kind='VAE', what='VAEConfig')
  return VAEConfig(**{k: cfg[k] for k in _CONFIG_KEYS if k in cfg})


# ---------------------------------------------------------------------------------------------
# Loading (models/io/loading.py's load path).


LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME,
    'vae',
    config_from_diffusers,
    QwenImageVAE,
    'VAE',
    leaves=causal_vae.LEAVES,
)
# The interface of family.vae (models/family.py): config, abstract module and key table.
read_vae_config = LOADER.read_config
abstract_vae = LOADER.abstract
vae_key_table = LOADER.table
# QwenImageVAE with weights streamed from a diffusers folder (vae/ or a pipeline folder holding
# it) onto the first local device.
load_vae_folder = LOADER.load_folder
