"""Model families: what the rest of digen_jax needs to know about one transformer architecture.

A family turns `config.model` into the architecture's config, builds the module, reads and streams
its diffusers checkpoints, names its params the diffusers way (LoRA targets and export), runs its
forward on the conditioning dict, and says which conditioning arrays that forward takes. Everything
else (sampler, objective, programs, runtime) is family-agnostic and goes through this table.

  'qwenimage': models/transformers/mmdit.py (Qwen-Image MMDiT; also the ShapesBench base generator), vae.py
  'flux':      models/transformers/flux.py  (FLUX.1 -dev / -schnell), flux_vae.py (AutoencoderKL)
  'wan':       models/transformers/wan.py   (Wan2.1 text-to-video), wan_vae.py (AutoencoderKLWan)

Conditioning dicts hold batch-leading arrays: 'text' [B, L, D] and 'text_mask' [B, L] always
(FLUX and Wan ignore the mask: FLUX's T5 sequence is padded and every token attends, Wan's umT5
sequence is zero past each prompt and every position attends, as in diffusers), 'pooled' [B, P]
for FLUX's CLIP vector. img_shape is (frames, h_tokens, w_tokens): 1 frame for the image
families, the latent frames for Wan (whose tokens are latents.pack_frames's, frame-major).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from digen_jax.models.io import convert
from digen_jax.models.transformers import flux
from digen_jax.models.io import flux_convert
from digen_jax.models.vae import flux_vae
from digen_jax.models.io import initialize
from digen_jax.models.transformers import mmdit
from digen_jax.models.vae import qwen_vae
from digen_jax.models.transformers import wan
from digen_jax.models.io import wan_convert
from digen_jax.models.vae import wan_vae

FAMILIES = ('qwenimage', 'flux', 'wan')


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  config_from: Callable[[Any], Any]  # config.model -> architecture config
  module: Callable[..., nnx.Module]  # (arch config, rngs=, param_dtype=) -> module
  read_config: Callable[[str], Any]  # diffusers folder -> architecture config
  load_sharded: Callable[..., Any]  # (folder, shardings_fn, dtype) -> (cfg, graphdef, state)
  key_table: Callable[[Any], dict]  # arch config -> {our dotted path: diffusers source}
  cond_keys: tuple[str, ...]  # conditioning arrays the forward reads
  # (module, latents, sigma, cond, img_shape, guidance, token_mesh=None) -> v; token_mesh: the
  # (samples, tokens) mesh each sample's tokens are split over (models/attention/sequence_parallel.py)
  forward: Callable[..., jax.Array]
  count_params: Callable[[Any], int]  # arch config -> parameter count
  flops_per_forward: Callable[..., float]  # (arch config, batch, n_img, n_txt) -> matmul FLOPs
  # The pipeline's VAE module: read_vae_config(folder), abstract_vae(cfg, dtype) ->
  # (graphdef, abstract), vae_key_table(cfg), decode_packed(model, tokens, latent_hw, patch, ...)
  # and a config with latent_channels and spatial_compression (models/vae/qwen_vae.py, models/vae/flux_vae.py;
  # models/vae/wan_vae.py's decode_packed takes latent_shape=(frames, h, w) and returns videos).
  vae: Any = None

  def new(self, cfg, seed: int):
    return initialize.build(self.module, cfg, seed)


def _shared_fields(m) -> dict:
  """The architecture config fields every family reads the same way from config.model."""
  return dict(
      in_channels=m.in_channels,
      num_layers=m.num_layers,
      attention_head_dim=m.attention_head_dim,
      num_attention_heads=m.num_attention_heads,
      joint_attention_dim=m.joint_attention_dim,
      axes_dims_rope=tuple(m.axes_dims_rope),
      rope_theta=float(m.rope_theta),
      remat=bool(m.remat),
      scan_layers=bool(m.scan_layers),
      attention=str(m.attention),
  )


def _mmdit_config(m) -> mmdit.MMDiTConfig:
  return mmdit.MMDiTConfig(
      patch_size=m.patch_size,
      out_channels=m.out_channels,
      pooled_text=bool(m.pooled_text),
      **_shared_fields(m),
  )


def _flux_config(m) -> flux.FluxConfig:
  # config.model.patch_size is the latent packing (2x2 for FLUX, done by latents.pack); the
  # transformer's own patch embedding is 1, as in FluxTransformer2DModel.
  return flux.FluxConfig(
      patch_size=1,
      out_channels=m.out_channels * m.patch_size**2,
      num_single_layers=m.num_single_layers,
      pooled_projection_dim=m.pooled_projection_dim,
      guidance_embeds=bool(m.guidance_embeds),
      **_shared_fields(m),
  )


def _wan_config(m) -> wan.WanConfig:
  # config.model.in_channels is the packed token width, as for every family; diffusers' Wan
  # counts the latent's channels (its patch embedding packs p x p of them). The rotary axes
  # follow from the head dim (wan.rope_axes).
  fields = _shared_fields(m)
  del fields['axes_dims_rope']
  fields['in_channels'] = m.in_channels // m.patch_size**2
  return wan.WanConfig(
      patch_size=m.patch_size,
      out_channels=m.out_channels,
      ffn_dim=m.ffn_dim,
      cross_attn_norm=bool(m.cross_attn_norm),
      **fields,
  )


def _mmdit_forward(model, latents, sigma, cond, img_shape, guidance, token_mesh=None):
  del guidance
  return model(
      latents, sigma, cond['text'], cond['text_mask'], img_shape=img_shape, token_mesh=token_mesh
  )


def _flux_forward(model, latents, sigma, cond, img_shape, guidance, token_mesh=None):
  # Guidance-distilled FLUX.1-dev takes the guidance scale as an input (no CFG branch).
  g = None
  if model.config.guidance_embeds:
    g = jnp.full((latents.shape[0],), guidance, jnp.float32)
  return model(
      latents,
      sigma,
      cond['text'],
      cond['pooled'].astype(latents.dtype),
      g,
      img_shape=tuple(img_shape[-2:]),
      token_mesh=token_mesh,
  )


def _wan_forward(model, latents, sigma, cond, img_shape, guidance, token_mesh=None):
  # True CFG (a second, negative-prompt forward) is the sampler's; the mask is not read (see the
  # module docstring).
  del guidance
  return model(latents, sigma, cond['text'], img_shape=tuple(img_shape), token_mesh=token_mesh)


_TABLE = {
    'qwenimage': Family(
        'qwenimage',
        _mmdit_config,
        mmdit.MMDiT,
        convert.read_config,
        convert.load_diffusers_sharded,
        convert.diffusers_key_table,
        ('text', 'text_mask'),
        _mmdit_forward,
        mmdit.count_params,
        mmdit.flops_per_forward,
        qwen_vae,
    ),
    'flux': Family(
        'flux',
        _flux_config,
        flux.Flux,
        flux_convert.read_config,
        flux_convert.load_flux_sharded,
        flux_convert.flux_key_table,
        ('text', 'text_mask', 'pooled'),
        _flux_forward,
        flux.count_params,
        flux.flops_per_forward,
        flux_vae,
    ),
    'wan': Family(
        'wan',
        _wan_config,
        wan.Wan,
        wan_convert.read_config,
        wan_convert.load_wan_sharded,
        wan_convert.wan_key_table,
        ('text', 'text_mask'),
        _wan_forward,
        wan.count_params,
        wan.flops_per_forward,
        wan_vae,
    ),
}


def get(name: str) -> Family:
  if name not in _TABLE:
    raise ValueError(f'config.model.family={name!r} must be one of {FAMILIES}')
  return _TABLE[name]


def of(config) -> Family:
  return get(config.model.family)
