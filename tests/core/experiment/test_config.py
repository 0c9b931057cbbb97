"""Config fields that select execution options, the learning-rate schedule and the reward."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import qwenimage
from configs import shapes
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment


def test_learning_rate_schedules():
  c = qwenimage.get_config('tiny')
  c.total_steps, c.optim.lr = 50, 1e-3
  c.rl.inner_epochs = 2  # 100 optimizer updates in all
  lr = experiment.learning_rate(c)
  assert [float(lr(n)) for n in (0, 57, 99)] == pytest.approx([1e-3] * 3)
  c.optim.schedule, c.optim.warmup_steps, c.optim.final_lr_frac = 'cosine', 10, 0.1
  lr = experiment.learning_rate(c)
  assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-4)
  assert float(lr(10)) == pytest.approx(1e-3)
  assert float(lr(55)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)  # half-way down
  assert float(lr(100)) == pytest.approx(1e-4)
  c.optim.schedule, c.optim.warmup_steps, c.optim.final_lr_frac = 'linear', 0, 0.0
  lr = experiment.learning_rate(c)
  assert [float(lr(n)) for n in (0, 50, 100)] == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-9)
  c.optim.warmup_steps = 100
  with pytest.raises(
      ValueError, match=r'warmup_steps=100 in \[0, total_steps \* rl.inner_epochs = 100\)'
  ):
    configlib.validate(c, 1)
  c.optim.warmup_steps, c.optim.schedule = 0, 'step'
  with pytest.raises(ValueError, match='optim.schedule'):
    configlib.validate(c, 1)


def test_execution_options_reach_the_model_and_keep_the_checkpoint():
  """model.remat / model.scan_layers change how the shipped base runs, not what it is."""
  c = shapes.get_config()
  assert c.model.remat and c.rl.step_loop == 'auto'
  mcfg, graphdef, params = experiment.build_model(c)
  assert mcfg.remat and mcfg.scan_layers
  c.model.remat, c.model.scan_layers = False, False
  mcfg2, graphdef2, params2 = experiment.build_model(c)
  assert not mcfg2.remat and not mcfg2.scan_layers
  assert experiment.same_architecture(mcfg, mcfg2)
  assert not experiment.same_architecture(mcfg, dataclasses.replace(mcfg2, num_layers=2))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(a, b)
  c.model.num_layers = 2
  with pytest.raises(ValueError, match='does not match the checkpoint'):
    experiment.build_model(c)


def test_architecture_fields_reach_the_model_and_are_validated():
  """model.rope_theta and model.pooled_text are architecture (unlike remat): a checkpoint made
  without them is refused, and bad values are named before anything is built."""
  c = shapes.get_config()
  c.model.rope_theta, c.model.pooled_text = 100.0, True
  mcfg = experiment.model_config_from(c)
  assert mcfg.rope_theta == 100.0 and mcfg.pooled_text
  with pytest.raises(ValueError, match='does not match the checkpoint'):
    experiment.build_model(c)
  c = shapes.get_config()
  c.model.rope_theta = 0.0
  with pytest.raises(
      ValueError, match=r'config.model.rope_theta=0.0 must be a finite number in \(0, inf\)'
  ):
    configlib.validate(c, 1)


def test_reward_spec_from_the_config(tmp_path):
  c = shapes.get_config()
  c.reward.weights = 'shapes:1, shapes_strict:0.5'
  assert experiment.build(c, str(tmp_path), 1).reward_fn.weights == {
      'shapes': 1.0,
      'shapes_strict': 0.5,
  }
  c.reward.weights = ''
  with pytest.raises(ValueError, match='config.reward.weights: .*empty'):
    configlib.validate(c, 1)
  c.reward.weights = 'shapes:inf'
  with pytest.raises(
      ValueError, match="config.reward.weights: weight for reward 'shapes' must be a finite number"
  ):
    configlib.validate(c, 1)


def test_auto_step_loop_scans_on_one_device_only():
  from digen_jax import programs
  from digen_jax.parallel import mesh as mesh_lib

  one, two = (mesh_lib.make_mesh(jax.devices()[:n]) for n in (1, 2))
  assert programs.step_loop_for('auto', one) == 'scan'
  assert programs.step_loop_for('auto', two) == 'vmap'  # no collectives inside the step loop
  assert (
      programs.step_loop_for('scan', two) == 'scan'
      and programs.step_loop_for('vmap', one) == 'vmap'
  )
