"""A run's weights without reading or allocating one: every leaf a ShapeDtypeStruct.

build(config, abstract=True) takes its Weights from here: the transformer under nnx.eval_shape,
LoRA adapters under jax.eval_shape of lora.init_adapters, the VAE via the family's abstract_vae
(its configuration from `vae_config`). The simulator and benchmarks/memory.py lower the real
programs from such a Run on fake devices.
"""

from __future__ import annotations

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp

from digen_jax.experiment import tiny_pipeline
from digen_jax.experiment import weights as weights_lib
from digen_jax.models import family as family_lib
from digen_jax.models.vae import flux_vae
from digen_jax.models.lora import adapters as lora_lib
from digen_jax.models.vae import qwen_vae as vae_lib


def vae_config(config, spec: str):
  """(VAE config, description), or (None, 'none ...') in pixel space. The VAE is the config's
  family's (models/family.py: Qwen-Image's or FLUX's AutoencoderKL). `spec`: 'auto' reads
  vae/config.json from config.model.checkpoint when it is a pipeline folder (configuration only),
  else the real VAE when config.latent.channels matches it and the toy VAE of
  digen_jax/experiment/tiny_pipeline.py otherwise; 'real'; 'tiny'; or a vae/config.json or pipeline folder.
  """
  if config.latent.space != 'vae':
    return None, 'none (pixel space: identity decoder)'
  z = int(config.latent.channels)
  family = family_lib.of(config)
  lib = family.vae

  def from_file(path):
    if os.path.isdir(path):
      path = (
          os.path.join(path, 'vae', 'config.json')
          if os.path.isdir(os.path.join(path, 'vae'))
          else os.path.join(path, 'config.json')
      )
    with open(path) as f:
      return lib.config_from_diffusers(json.load(f)), f'config of {path}'

  def real():
    if family.name == 'flux':
      return flux_vae.FluxVAEConfig(), 'real FLUX.1 VAE (FluxVAEConfig defaults)'
    if family.name == 'wan':  # Wan2.1's AutoencoderKLWan: the causal VAE's defaults
      return vae_lib.VAEConfig(), 'real Wan2.1 VAE (VAEConfig defaults)'
    return vae_lib.VAEConfig(), 'real Qwen-Image VAE (VAEConfig defaults)'

  def tiny():
    if family.name == 'flux':
      kw = dict(tiny_pipeline.FLUX_VAE, latent_channels=z)
      return flux_vae.config_from_diffusers(kw), f'tiny (tiny_pipeline.FLUX_VAE, {z} channels)'
    if family.name == 'wan':
      kw = dict(tiny_pipeline.WAN_VAE)
      if kw['z_dim'] != z:
        kw.update(z_dim=z, latents_mean=[0.0] * z, latents_std=[1.0] * z)
      return vae_lib.VAEConfig(**kw), f'tiny (tiny_pipeline.WAN_VAE, z_dim {z})'
    kw = dict(tiny_pipeline.VAE)
    if kw['z_dim'] != z:
      kw.update(z_dim=z, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    return vae_lib.VAEConfig(**kw), f'tiny (digen_jax/experiment/tiny_pipeline.py VAE, z_dim {z})'

  if spec == 'real':
    cfg, what = real()
  elif spec == 'tiny':
    cfg, what = tiny()
  elif spec == 'auto':
    ckpt = config.model.checkpoint
    if ckpt and os.path.isfile(os.path.join(ckpt, 'vae', 'config.json')):
      cfg, what = from_file(ckpt)
    elif z == real()[0].latent_channels:
      cfg, what = real()
    else:
      cfg, what = tiny()
  else:
    cfg, what = from_file(spec)
  if cfg.latent_channels != z:
    raise ValueError(
        f'vae={spec!r}: the VAE has {cfg.latent_channels} latent channels but '
        f'config.latent.channels={z}'
    )
  return cfg, what


def abstract_weights(config, family, mcfg, vae: str = 'auto') -> weights_lib.Weights:
  """The Weights weights_lib.build makes for `config`, every leaf a ShapeDtypeStruct, the VAE's
  configuration as `vae_config(config, vae)` chooses it (no folder read for its weights)."""
  lat = config.latent
  graphdef, state = nnx.split(nnx.eval_shape(lambda: family.new(mcfg, 0)))
  params = weights_lib.abstract_of(state)
  lo = config.model.lora
  lora_cfg, base_abstract = None, None
  if lo.rank > 0:
    lora_cfg = lora_lib.LoraConfig(
        rank=int(lo.rank), alpha=float(lo.alpha or lo.rank), targets=lo.targets
    )
    base_abstract = params
    paths = lora_lib.target_paths(base_abstract, family.key_table(mcfg), lora_cfg)
    params = jax.eval_shape(
        lambda key: lora_lib.init_adapters(base_abstract, paths, lora_cfg, key),
        jax.random.key(config.seed + 1),
    )
  vcfg, _ = vae_config(config, vae)
  source = None
  if vcfg is not None:
    vgraph, vstate = family.vae.abstract_vae(vcfg, jnp.float32)
    source = weights_lib.VAESource(
        vcfg, family.vae, vgraph, weights_lib.abstract_of(vstate), folder=''
    )
  frozen_dtype = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[config.model.frozen_dtype]
  return weights_lib.Weights(
      graphdef=graphdef,
      params=params,
      frozen_dtype=frozen_dtype,
      lora=lora_cfg,
      base_abstract=base_abstract,
      vae=source,
      latent_hw=(lat.height, lat.width),
      frames=int(lat.frames),
      video=family.name == 'wan',
      patch=config.model.patch_size,
      vae_batch_chunk=int(lat.vae_batch_chunk),
      vae_tile=int(lat.vae_tile),
  )
