"""Tiny diffusers pipeline folders for the tests of reading a model folder: a random transformer,
VAE and scheduler saved by diffusers' own save_pretrained (no text encoder: the runs that read
these use the word encoder), at sizes unlike the configs' defaults and unlike
experiment/tiny_pipeline.py's, with any scheduler settings."""

import json
import os

import diffusers

from tests.helpers import diffusers_models

# Qwen-Image at sizes no config sets: 1 block, 3 heads of 24, 40-dim text, a 6-channel VAE latent.
QWEN_Z = 6
QWEN_TRANSFORMER = dict(
    patch_size=2,
    in_channels=QWEN_Z * 4,
    out_channels=QWEN_Z,
    num_layers=1,
    attention_head_dim=24,
    num_attention_heads=3,
    joint_attention_dim=40,
    axes_dims_rope=(8, 8, 8),
)
QWEN_VAE = dict(
    base_dim=8,
    z_dim=QWEN_Z,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[0.1 * i for i in range(QWEN_Z)],
    latents_std=[1.0 + 0.1 * i for i in range(QWEN_Z)],
)
QWEN_COMPRESSION = 8  # 2 ** len(temperal_downsample)

# FLUX.1 likewise: 1 double + 1 single block, 2 heads of 20, 5-channel latent, guidance embedding.
FLUX_Z = 5
FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=FLUX_Z * 4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=20,
    num_attention_heads=2,
    joint_attention_dim=36,
    pooled_projection_dim=36,
    guidance_embeds=True,
    axes_dims_rope=(4, 8, 8),
)
FLUX_VAE = dict(
    block_out_channels=(8, 8),
    down_block_types=('DownEncoderBlock2D',) * 2,
    up_block_types=('UpDecoderBlock2D',) * 2,
    latent_channels=FLUX_Z,
    norm_num_groups=4,
    layers_per_block=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.5,
    shift_factor=0.1,
)
FLUX_COMPRESSION = 2  # 2 ** (len(block_out_channels) - 1)

# FlowMatchEulerDiscreteScheduler settings unlike both families' releases.
QWEN_SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.3,
    max_shift=1.4,
    base_image_seq_len=64,
    max_image_seq_len=1024,
    shift_terminal=0.05,
    time_shift_type='exponential',
)
FLUX_SCHEDULER = dict(shift=2.5, use_dynamic_shifting=False, shift_terminal=0.1)


def _write(model, folder):
  model.save_pretrained(folder, safe_serialization=True)


def qwenimage(path, *, transformer=None, vae=None, scheduler=None) -> str:
  """A Qwen-Image pipeline folder (model_index.json, transformer/, vae/, scheduler/) at `path`;
  the dicts replace the module's defaults above. Returns path."""
  t = dict(QWEN_TRANSFORMER, **(transformer or {}))
  v = dict(QWEN_VAE, **(vae or {}))
  _write(diffusers_models.randomized_transformer(**t), os.path.join(path, 'transformer'))
  model = diffusers.AutoencoderKLQwenImage(**v).eval()
  diffusers_models.randomize_vae(model, 1)
  _write(model, os.path.join(path, 'vae'))
  return _finish(path, 'QwenImagePipeline', model, scheduler or QWEN_SCHEDULER)


def flux(path, *, transformer=None, vae=None, scheduler=None) -> str:
  """A FLUX.1 pipeline folder likewise (FluxTransformer2DModel, AutoencoderKL)."""
  t = dict(FLUX_TRANSFORMER, **(transformer or {}))
  v = dict(FLUX_VAE, **(vae or {}))
  _write(
      diffusers_models.randomized_transformer(diffusers.FluxTransformer2DModel, **t),
      os.path.join(path, 'transformer'),
  )
  model = diffusers.AutoencoderKL(**v).eval()
  diffusers_models.randomize_vae(model, 1)
  _write(model, os.path.join(path, 'vae'))
  return _finish(path, 'FluxPipeline', model, scheduler or FLUX_SCHEDULER)


def _finish(path, pipeline_class, vae, scheduler) -> str:
  diffusers.FlowMatchEulerDiscreteScheduler(**scheduler).save_pretrained(
      os.path.join(path, 'scheduler')
  )
  transformer = json.load(open(os.path.join(path, 'transformer', 'config.json')))['_class_name']
  index = {
      '_class_name': pipeline_class,
      '_diffusers_version': diffusers.__version__,
      'scheduler': ['diffusers', 'FlowMatchEulerDiscreteScheduler'],
      'transformer': ['diffusers', transformer],
      'vae': ['diffusers', type(vae).__name__],
  }
  with open(os.path.join(path, 'model_index.json'), 'w') as f:
    json.dump(index, f, indent=1)
  return path
