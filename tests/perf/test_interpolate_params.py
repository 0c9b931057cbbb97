"""benchmarks/interpolate_params.py: the straight line between two params folders."""

import os
import sys

import jax
import numpy as np
import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, REPO)

from benchmarks import interpolate_params  # noqa: E402
from digen_jax.models.io import params_io  # noqa: E402

LATENT_BASE = os.path.join(REPO, 'assets', 'shapes_latent_base')
PIXEL_BASE = os.path.join(REPO, 'assets', 'shapes_base')


def _leaves(folder):
  return jax.tree.leaves(params_io.load_params(folder)[1])


def test_an_endpoint_a_mix_and_provenance(tmp_path):
  # A and B: the shipped latent base and a copy of it scaled by 3 (same architecture).
  cfg, params, extra = params_io.load_params(LATENT_BASE)
  tripled = params_io.save_params(
      tmp_path / 'b', jax.tree.map(lambda x: 3.0 * x, params), cfg, dict(extra, loss=0.5)
  )
  a = _leaves(LATENT_BASE)
  for alpha, factor in ((0.0, 1.0), (0.25, 1.5)):  # an endpoint and a mix
    out = interpolate_params.interpolate(LATENT_BASE, tripled, alpha, str(tmp_path / f'{alpha}'))
    for x, y in zip(a, _leaves(out)):
      np.testing.assert_allclose(np.asarray(y), factor * np.asarray(x), rtol=1e-6, atol=1e-7)
    saved = params_io.load_params(out)[2]
    assert saved['interpolated'] == {'a': LATENT_BASE, 'b': tripled, 'alpha': alpha}
    assert 'final_eval' not in saved and 'loss' not in saved  # B's measurements, not these


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
  for alpha in (-0.1, 1.5, float('nan')):
    with pytest.raises(ValueError, match='--alpha'):
      interpolate_params.interpolate(LATENT_BASE, LATENT_BASE, alpha, str(tmp_path / 'x'))
  with pytest.raises(ValueError, match='different architectures'):
    interpolate_params.interpolate(PIXEL_BASE, LATENT_BASE, 0.5, str(tmp_path / 'y'))
  assert not os.listdir(tmp_path)
