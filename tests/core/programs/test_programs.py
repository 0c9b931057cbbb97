"""digen_jax/programs.py: a second build of the same config reuses the jitted programs (no
re-tracing), and anything a program reads keys a program of its own."""

import jax
import pytest

from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax import programs
from digen_jax.parallel import mesh as mesh_lib


def _exp(tmp_path, name, **overrides):
  config = configlib.apply_overrides(
      qwenimage.get_config('tiny'), {'data.data_dir': str(tmp_path / name / 'data'), **overrides}
  )
  return experiment.build(config, str(tmp_path / name), 2)


@pytest.fixture(scope='module')
def first(tmp_path_factory):
  return _exp(tmp_path_factory.mktemp('programs'), 'first')


def test_the_same_config_gets_the_same_programs(first, tmp_path):
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  again = _exp(tmp_path, 'again')  # another workdir and prompt folder: no program reads them
  assert again.program_key == first.program_key
  a, b = programs.make_rollout(first, mesh), programs.make_rollout(again, mesh)
  assert a.program is b.program
  assert programs.make_select(first, mesh) is programs.make_select(again, mesh)
  # Another mesh, another argument form or another layout: a program of its own.
  other_mesh = mesh_lib.make_mesh(jax.devices()[2:4])
  assert programs.make_rollout(again, other_mesh).program is not a.program
  assert programs.make_rollout(again, mesh, with_offset=True).program is not a.program
  programs.clear_memo()
  assert programs.make_rollout(again, mesh).program is not a.program


@pytest.mark.parametrize(
    'override',
    [
        {'optim.lr': 2e-3},  # the optimizer's schedule is inside update/apply
        {'total_steps': 7},  # so is the decay length
        {'sampler.num_steps': 3},
        {'rl.clip_range': 0.3},
    ],
)
def test_a_program_field_changes_the_key(first, tmp_path, override):
  other = _exp(tmp_path, 'other', **override)
  assert other.program_key != first.program_key
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  assert programs.make_select(other, mesh) is not programs.make_select(first, mesh)
