"""What a ShapesBench pretraining config (configs/shapes_pretrain.py) must hold, and what it
describes: `validate` (ValueError naming the field and the fix, before anything compiles), the
training-pair stream (`batch_spec`) and the warm start (`warm_start_params`)."""

from __future__ import annotations

import dataclasses
import math

from flax import nnx
import jax.numpy as jnp
import ml_collections

from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.models.io import initialize
from digen_jax.models.transformers import mmdit
from digen_jax.models.io import params_io
from digen_jax.tasks.shapes import autoencoder as shapes_ae
from digen_jax.tasks.shapes import training as training_data
from digen_jax.tasks.shapes.flow_matching import POOLED_TEXT_OUTPUT, SIGMA_SAMPLING


def validate(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the field and the fix; run before anything compiles."""
  configlib.validate(config, 1)
  if 'pretrain' not in config:
    raise ValueError('config has no `pretrain` section; use configs/shapes_pretrain.py')
  _check_latent(config)
  _check_objective(config)
  _check_warm_start_and_cfg(config)
  _check_data_and_lr(config)


def _check_latent(config: ml_collections.ConfigDict) -> None:
  """Square still images, in pixel space or an autoencoder's latents of the rendered size."""
  p, lat = config.pretrain, config.latent
  if lat.space not in ('pixel', 'ae'):
    raise ValueError(
        f"config.latent.space={lat.space!r}: pretraining renders pixels; use 'pixel' or "
        "'ae' (a digen_jax.tasks.shapes.pretrain_ae autoencoder at config.latent.ae)"
    )
  if lat.frames != 1 or lat.height != lat.width:
    raise ValueError(
        f'config.latent: frames={lat.frames}, {lat.height}x{lat.width}: ShapesBench '
        'images are square stills; use frames=1 and height == width'
    )
  if lat.space == 'pixel':
    if lat.channels != 3:
      raise ValueError(f'config.latent.channels={lat.channels}: pixel space is RGB; use 3')
    if p.image_size != lat.height:
      raise ValueError(
          f'config.pretrain.image_size={p.image_size} must equal latent.height='
          f'{lat.height} in pixel space'
      )
  else:
    acfg = shapes_ae.read_vae_config(experiment.checkpoint_folder(lat.ae, 'config.latent.ae'))
    if lat.channels != acfg.latent_channels:
      raise ValueError(
          f'config.latent.channels={lat.channels} but the autoencoder at '
          f'config.latent.ae has {acfg.latent_channels}'
      )
    if p.image_size != lat.height * acfg.spatial_compression:
      raise ValueError(
          f'config.pretrain.image_size={p.image_size} must equal latent.height '
          f'{lat.height} x the autoencoder compression {acfg.spatial_compression}'
      )


def _check_objective(config: ml_collections.ConfigDict) -> None:
  """The loss's inputs (word encoder, σ sampling and shift, text dropout), the run's sizes, the
  EMA and the share of single-object prompts."""
  p = config.pretrain
  if config.text.encoder != 'word':
    raise ValueError(
        f"config.text.encoder={config.text.encoder!r}: pretraining uses the 'word' encoder"
    )
  if p.sigma_sampling not in SIGMA_SAMPLING:
    raise ValueError(
        f'config.pretrain.sigma_sampling={p.sigma_sampling!r} must be one of {SIGMA_SAMPLING}'
    )
  for name in (
      'steps',
      'batch',
      'eval_prompts',
      'eval_samples',
      'final_eval_prompts',
      'final_eval_samples',
      'eval_batch',
      'log_every',
  ):
    if int(p[name]) < 1:
      raise ValueError(f'config.pretrain.{name}={p[name]} must be >= 1')
  if not 0.0 <= p.ema < 1.0:
    raise ValueError(f'config.pretrain.ema={p.ema} must be in [0, 1) (0 = off)')
  if not 0.0 <= p.text_dropout < 1.0:
    raise ValueError(f'config.pretrain.text_dropout={p.text_dropout} must be in [0, 1)')
  if config.sampler.negative_prompt.strip():
    raise ValueError(
        f'config.sampler.negative_prompt={config.sampler.negative_prompt!r}: text dropout trains '
        "the empty prompt, so CFG's unconditional branch must be it; use ' ' or ''"
    )
  if p.single_fraction > 1.0:
    raise ValueError(
        f'config.pretrain.single_fraction={p.single_fraction} must be <= 1 (< 0 = uniform)'
    )
  if not p.sigma_shift > 0:
    raise ValueError(f'config.pretrain.sigma_shift={p.sigma_shift} must be > 0 (1 = no shift)')


def _check_warm_start_and_cfg(config: ml_collections.ConfigDict) -> None:
  """The warm-start folder exists, and CFG evals only for a model that learnt the empty prompt."""
  p = config.pretrain
  if p.get('init_from'):
    experiment.checkpoint_folder(p.init_from, 'config.pretrain.init_from')
  if config.sampler.guidance_scale > 1.0 and p.text_dropout == 0:
    if not warm_start_cfg_trained(config):
      raise ValueError(
          f'config.sampler.guidance_scale={config.sampler.guidance_scale} samples evals with CFG, '
          'but the model never learns the empty prompt; set config.pretrain.text_dropout > 0 '
          '(e.g. 0.15) or warm-start from a checkpoint trained with it'
      )


def _check_data_and_lr(config: ml_collections.ConfigDict) -> None:
  """The batch stream's fields and the learning-rate schedule."""
  p = config.pretrain
  try:
    batch_spec(config)
  except ValueError as e:
    raise ValueError(f'config.pretrain: {e}') from None
  if int(p.data_workers) < 0:
    raise ValueError(
        f'config.pretrain.data_workers={p.data_workers} must be >= 0 (0 = render in '
        'the training process)'
    )
  if p.warmup < 0 or p.warmup >= p.steps:
    raise ValueError(f'config.pretrain.warmup={p.warmup} must be in [0, steps={p.steps})')
  if not (math.isfinite(p.lr) and 0 < p.lr <= 1):  # NaN/inf would only show as a NaN loss
    raise ValueError(f'config.pretrain.lr={p.lr!r} must be a finite number in (0, 1] (e.g. 2e-3)')
  if not (math.isfinite(p.final_lr_frac) and 0 <= p.final_lr_frac <= 1):
    raise ValueError(f'config.pretrain.final_lr_frac={p.final_lr_frac!r} must be in [0, 1]')


def warm_start_cfg_trained(config: ml_collections.ConfigDict) -> bool:
  """Whether config.pretrain.init_from's checkpoint learnt the empty prompt (text dropout)."""
  if not config.pretrain.get('init_from'):
    return False
  folder = experiment.checkpoint_folder(config.pretrain.init_from, 'config.pretrain.init_from')
  return bool(params_io.read_config(folder).get('extra', {}).get('cfg_trained'))


def batch_spec(config: ml_collections.ConfigDict) -> training_data.BatchSpec:
  """The training-pair stream config.pretrain describes."""
  p = config.pretrain
  kinds = tuple(k.strip() for k in str(p.caption_noise_kinds).split(',') if k.strip())
  count_weights = None
  if str(p.single_count_weights).strip():
    try:
      count_weights = tuple(float(w) for w in str(p.single_count_weights).split(','))
    except ValueError:
      raise ValueError(
          f'single_count_weights={p.single_count_weights!r}: give comma-separated numbers, '
          "e.g. '1,2,3' ('' = equal weights)"
      ) from None
  return training_data.BatchSpec(
      batch=int(p.batch),
      size=int(p.image_size),
      seed=int(config.seed),
      single_fraction=float(p.single_fraction),
      single_count_weights=count_weights,
      caption_noise=float(p.caption_noise),
      noise_kinds=kinds,
  )


def warm_start_params(config: ml_collections.ConfigDict, mcfg: mmdit.MMDiTConfig) -> nnx.State:
  """config.pretrain.init_from's params; ValueError if its architecture is not config.model's.

  One difference is allowed: a checkpoint without pooled text conditioning warm-starts a model with
  it (config.model.pooled_text=True). The new `text_pool` projection starts with a zero output
  layer, so the warm-started model computes exactly the checkpoint's function at step 0."""
  path = experiment.checkpoint_folder(config.pretrain.init_from, 'config.pretrain.init_from')
  ckpt_cfg, params, _ = params_io.load_params(path)
  adds_pool = mcfg.pooled_text and not ckpt_cfg.pooled_text
  if not experiment.same_architecture(
      dataclasses.replace(ckpt_cfg, pooled_text=mcfg.pooled_text) if adds_pool else ckpt_cfg, mcfg
  ):
    raise ValueError(
        f'config.pretrain.init_from={config.pretrain.init_from!r} holds {ckpt_cfg}, but '
        f'config.model asks for {mcfg}; warm-start from a checkpoint of the same architecture'
    )
  if not adds_pool:
    return params
  _, fresh = nnx.split(initialize.build(mmdit.MMDiT, mcfg, config.seed))
  loaded = dict(nnx.to_flat_state(params))
  flat = []
  for path_, var in nnx.to_flat_state(fresh):
    if path_ in loaded:
      var = loaded[path_]
    elif path_[:-1] == POOLED_TEXT_OUTPUT:
      var = var.replace(jnp.zeros_like(var[...]))
    flat.append((path_, var))
  return nnx.from_flat_state(flat)
