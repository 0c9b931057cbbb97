"""config.latent.space='ae': RL in the latent space of a ShapesBench autoencoder
(tasks/shapes/autoencoder.py), registered with the weights builder on import."""

from __future__ import annotations

import os

from digen_jax.experiment import weights as weights_lib
from digen_jax.models.io import params_io
from digen_jax.tasks.shapes import autoencoder as shapes_ae


def latent_source(config) -> weights_lib.VAESource:
  """The autoencoder in config.latent.ae (a params folder made by python -m
  digen_jax.tasks.shapes.pretrain_ae) that decodes the latents; ValueError naming the field."""
  folder = config.latent.ae
  if not folder:
    raise ValueError(
        "config.latent.space='ae' decodes with a ShapesBench autoencoder: set "
        'config.latent.ae to a params folder made by python -m digen_jax.tasks.shapes.pretrain_ae'
    )
  folder = weights_lib.repo_path(folder)
  acfg = shapes_ae.read_vae_config(folder)
  if acfg.latent_channels != config.latent.channels:
    raise ValueError(
        f'config.latent.channels={config.latent.channels} but the autoencoder in '
        f'{folder} has {acfg.latent_channels}; set --config.latent.channels='
        f'{acfg.latent_channels}'
    )
  graphdef, abstract = shapes_ae.abstract_vae(acfg)
  return weights_lib.VAESource(
      acfg,
      shapes_ae,
      graphdef,
      weights_lib.abstract_of(abstract),
      os.path.join(folder, params_io.WEIGHTS_FILE),
  )


weights_lib.register_latent_space('ae', latent_source)
