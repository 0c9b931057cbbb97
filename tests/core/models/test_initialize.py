"""models/io/initialize.py: a module's random params drawn by one jitted program equal the eager
construction's bit for bit (shipped bases and every seed-pinned result depend on it)."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import flux as flux_config
from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.models import family
from digen_jax.models.io import initialize
from digen_jax.tasks.shapes import autoencoder as shapes_ae


def _same(a: nnx.Module, b: nnx.Module):
  fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (path, x), (_, y) in zip(fa, fb):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


@pytest.mark.parametrize('config', [qwenimage.get_config('tiny'), flux_config.get_config('tiny')])
@pytest.mark.slow
def test_jitted_init_equals_eager(config):
  mcfg = experiment.model_config_from(config)
  module = family.of(config).module
  jitted = initialize.build(module, mcfg, 3)
  _same(jitted, module(mcfg, rngs=nnx.Rngs(3)))
  _same(initialize.build(module, mcfg, 3), jitted)  # built again: the same values
  other = initialize.build(module, mcfg, 4)
  assert any(
      not np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(nnx.state(other)), jax.tree.leaves(nnx.state(jitted)))
  )


def test_jitted_init_equals_eager_autoencoder():
  cfg = shapes_ae.ShapesAEConfig()
  _same(initialize.build(shapes_ae.ShapesAE, cfg, 0), shapes_ae.ShapesAE(cfg, rngs=nnx.Rngs(0)))
