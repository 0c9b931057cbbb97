"""A diffusers pipeline folder is the model's config: the architecture fields of config.model and
config.latent.channels are read from its transformer/config.json and vae/config.json.

`resolve(config, explicit)` runs before validation (experiment.build) for the image families
(Qwen-Image, FLUX.1) when config.model.checkpoint is a pipeline folder: every architecture field
takes the folder's value; a field the user gave explicitly (`explicit`, the dotted fields of the
command line's --config.<field> overrides) must agree, else one ValueError naming the field, the
folder's value, the file and the fix. The sizes written in configs/qwenimage.py and
configs/flux.py are the releases' and count only without a folder (random init, the planner).

The image size stays a run setting in pixels: config.latent.image_height / image_width (0: the
latent grid latent.height / width as given) must be a multiple of the VAE's spatial compression
times model.patch_size, and set the latent grid to pixels / compression.
"""

from __future__ import annotations

import os
from typing import Any

from absl import logging

from digen_jax.experiment import weights as weights_lib
from digen_jax.models import family as family_lib

FAMILIES = ('qwenimage', 'flux')  # Wan reads its sizes from its config (configs/wan21.py)
IMAGE_FIELDS = ('latent.image_height', 'latent.image_width')


def explicit_fields(argv: list[str]) -> set[str]:
  """The dotted config fields a command line sets: {'model.num_layers'} of
  ['--config.model.num_layers=2', ...] (also '--config.x.y v' spelled as two arguments)."""
  out = set()
  for arg in argv:
    if arg.startswith('--config.'):
      out.add(arg[len('--config.') :].split('=', 1)[0])
  return out


def folder_values(config, path: str) -> tuple[dict[str, Any], dict[str, str]]:
  """({dotted config field: the folder's value}, {field: the file it comes from}) of the
  transformer and (latent.space='vae') the VAE of the pipeline folder at `path`."""
  family = family_lib.of(config)
  arch = family.read_config(path)
  tfile = os.path.join(path, 'transformer', 'config.json')
  m = {
      'model.in_channels': arch.in_channels,
      'model.num_layers': arch.num_layers,
      'model.attention_head_dim': arch.attention_head_dim,
      'model.num_attention_heads': arch.num_attention_heads,
      'model.joint_attention_dim': arch.joint_attention_dim,
      'model.axes_dims_rope': tuple(arch.axes_dims_rope),
  }
  if family.name == 'qwenimage':
    m.update({'model.patch_size': arch.patch_size, 'model.out_channels': arch.out_channels})
  else:  # FLUX packs 2x2 latent patches (config.model.patch_size); its transformer's patch is 1
    p = _positive(config.model.patch_size)
    m.update(
        {
            'model.out_channels': arch.out_channels // (p * p),
            'model.num_single_layers': arch.num_single_layers,
            'model.pooled_projection_dim': arch.pooled_projection_dim,
            'model.guidance_embeds': bool(arch.guidance_embeds),
        }
    )
  files = dict.fromkeys(m, tfile)
  if config.latent.space == 'vae':
    if not os.path.isfile(os.path.join(path, 'vae', 'config.json')):
      raise ValueError(
          "config.latent.space='vae' decodes with the VAE of the pipeline folder, but "
          f"config.model.checkpoint={path!r} has no vae/config.json: copy the release's vae/ "
          'folder into it'
      )
    vae = family.vae.read_vae_config(os.path.join(path, 'vae'))
    m['latent.channels'] = vae.latent_channels
    files['latent.channels'] = os.path.join(path, 'vae', 'config.json')
  return m, files


def pipeline_folder(config) -> str:
  """The pipeline folder config's architecture is read from ('' when none is: another family,
  random init, or no folder)."""
  m = config.model
  path = weights_lib.repo_path(m.checkpoint) if m.checkpoint else ''
  if m.family not in FAMILIES or m.init != 'checkpoint':
    return ''
  return path if path and weights_lib.is_pipeline_folder(path) else ''


def resolve(config, explicit: set[str] | frozenset = frozenset()) -> None:
  """Fills config's architecture fields from its pipeline folder in place (module docstring);
  the image size in pixels sets the latent grid. ValueError naming the field otherwise."""
  path = pipeline_folder(config)
  if not path:
    return
  values, files = folder_values(config, path)
  for field, value in values.items():
    section, name = field.split('.')
    current = config[section][name]
    if isinstance(current, (list, tuple)):
      current = tuple(current)
    if current == value:
      continue
    if field in explicit:
      raise ValueError(
          f'config.{field}={current!r} but the model folder has {value!r} ({files[field]}); '
          f"drop --config.{field} (it defaults to the folder's) or point "
          'config.model.checkpoint at a folder of that architecture'
      )
    logging.info('config.%s = %r from %s (the config had %r)', field, value, files[field], current)
    config[section][name] = value
  _image_size(config, path)


def _image_size(config, path: str) -> None:
  """latent.height / width from the image size in pixels, checked against the VAE's compression
  times the patch size."""
  lat = config.latent
  if config.latent.space != 'vae' or not (lat.image_height or lat.image_width):
    return
  vae = family_lib.of(config).vae.read_vae_config(os.path.join(path, 'vae'))
  step = vae.spatial_compression * _positive(config.model.patch_size)
  for field, latent_field in zip(IMAGE_FIELDS, ('height', 'width')):
    pixels = lat[field.split('.')[1]]
    if not isinstance(pixels, int) or pixels <= 0 or pixels % step:
      fit = max(step, -(-pixels // step) * step) if isinstance(pixels, int) else step  # up
      raise ValueError(
          f'config.{field}={pixels!r} must be a positive multiple of {step} pixels: the VAE '
          f'compresses {vae.spatial_compression}x ({os.path.join(path, "vae", "config.json")}) '
          f'and the transformer takes {config.model.patch_size}x{config.model.patch_size} '
          f'latent patches; e.g. --config.{field}={fit}'
      )
    lat[latent_field] = pixels // vae.spatial_compression


def _positive(patch) -> int:
  """model.patch_size, or 1 where it is not a positive int (validation names that field)."""
  return patch if isinstance(patch, int) and not isinstance(patch, bool) and patch > 0 else 1
