"""The README's main job (configs/shapes.py) starts from the shipped base model and runs."""

import json
import os
import subprocess
import sys

import pytest

from configs import shapes
from digen_jax.experiment import config as configlib
from tests.helpers.paths import REPO


def test_shapes_config_uses_the_shipped_base_model():
  c = shapes.get_config()
  assert c.model.init == 'checkpoint'
  assert c.model.checkpoint == configlib.SHAPES_LATENT_BASE_CHECKPOINT
  assert c.latent.space == 'ae' and c.latent.ae == configlib.SHAPES_AE_CHECKPOINT
  assert c.reward.weights == 'shapes_dense' and c.optim.schedule == 'cosine'
  # RL draws its prompts from the 'rl' split, which shares no prompt with eval or val.
  from digen_jax.tasks.shapes import grammar

  splits = grammar.split_prompts()
  assert c.data.split == 'rl' and c.eval.split == 'eval'
  assert not set(splits['rl']) & (set(splits['eval']) | set(splits['val']))
  assert shapes.get_config('latent').to_dict() == c.to_dict()  # older commands' name for it
  pixel = shapes.get_config('pixel,disagg')
  assert pixel.model.checkpoint == configlib.SHAPES_BASE_CHECKPOINT
  assert pixel.latent.space == 'pixel' and pixel.runtime.mode == 'disagg'
  configlib.validate(pixel, 4)
  assert shapes.get_config('jpeg').reward.weights == 'jpeg_compressibility'
  configlib.validate(c, 4)
  d = shapes.get_config('jpeg,disagg')
  assert d.runtime.mode == 'disagg' and d.reward.weights == 'jpeg_compressibility'
  with pytest.raises(ValueError, match='unknown variant'):
    shapes.get_config('jpeg,fast')


def test_main_job_samples_the_model_its_base_was_pretrained_as():
  """configs/shapes_pretrain.py:ae made the main job's base: the RL config's model, latent space,
  text encoder and sampler are that pretraining's (only where the weights come from, and remat, a
  memory-for-time choice of the RL update, differ)."""
  from configs import shapes_pretrain

  pre, rl = shapes_pretrain.get_config('ae'), shapes.get_config()
  for section in ('model', 'latent', 'text', 'sampler'):
    a, b = rl[section].to_dict(), pre[section].to_dict()
    if section == 'model':
      for k in ('init', 'checkpoint', 'remat'):
        a.pop(k), b.pop(k)
    assert a == b, section


@pytest.mark.slow
@pytest.mark.parametrize('variant', ['', ':disagg'])
def test_shapes_main_job_runs_from_another_cwd(tmp_path, variant, plots):
  wd = tmp_path / 'run'
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.main',
      f'--workdir={wd}',
      f'--config={os.path.join(REPO, "configs", "shapes.py")}{variant}',
      '--config.total_steps=2',
      '--config.rl.prompts_per_step=2',
      '--config.rl.group_size=4',
      '--config.eval.every=2',
      '--config.eval.num_prompts=4',
      '--config.eval.samples_per_prompt=2',
      '--config.eval.batch_size=8',
      '--config.sample_grid_every=2',
  ]
  env = dict(os.environ, PYTHONPATH=REPO)
  r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in open(wd / 'metrics.jsonl')]
  train = [x for x in rows if 'reward_mean' in x]
  assert len(train) == 2 and all(0.0 <= x['reward_mean'] <= 1.0 for x in train)
  # The pretrained base draws shapes: its partial-credit reward is far above a random model's 0.
  assert train[0]['reward_mean'] > 0.3
  ev = [x for x in rows if 'eval/strict_accuracy' in x][-1]
  assert 0.0 <= ev['eval/atom_shape'] <= 1.0 and 0.0 <= ev['eval/atom_count'] <= 1.0
  assert os.path.exists(wd / 'reward.png') and os.path.exists(wd / 'samples' / 'step_000002.png')


def test_text_encoder_mismatch_is_a_clear_error(tmp_path):
  """config.text.seed seeds the word-encoder table; with the shipped base another seed would feed
  the generator embeddings it never saw. The digest recorded in the checkpoint catches it; the run's
  own seed (rollout noise, prompt order) is free to change."""
  from digen_jax.experiment import build as experiment

  c = shapes.get_config()
  experiment.check_text_encoder(c, experiment.build_text_encoder(c))  # seed 0: fine
  c.seed = 1
  experiment.check_text_encoder(c, experiment.build_text_encoder(c))  # the RL seed: fine
  c.text.seed = 1
  with pytest.raises(ValueError, match=r'config.text.seed=1.*Set config.text.seed=0'):
    experiment.check_text_encoder(c, experiment.build_text_encoder(c))
  with pytest.raises(ValueError, match='config.text.seed'):
    experiment.build(c, str(tmp_path), 4)
  assert not os.listdir(tmp_path)  # raised before anything was written
