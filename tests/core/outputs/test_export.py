"""python -m digen_jax.export writes a trained run as a diffusers pipeline folder that diffusers'
own QwenImagePipeline / FluxPipeline.from_pretrained load, whose transformer gives our trained
transformer's output: a full fine-tune and LoRA merged into the base, on tiny folders of sizes
unlike the configs' (tests/helpers/model_folders.py), one training step each (the weights moved)."""

import json
import os

import diffusers
from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch

from digen_jax import export as export_lib
from digen_jax.models import family as family_lib
from tests.helpers import model_folders
from tests.helpers.cli_cases import last_line, run_cases
from tests.helpers.parity import flux_pipeline_image_ids

pytestmark = pytest.mark.slow  # three tiny training runs and their exports: a few minutes

RUNS = {  # id: (family, config variant)
    'qwen_full': ('qwenimage', 'configs/qwenimage.py:tiny_pipeline,full'),
    'qwen_lora': ('qwenimage', 'configs/qwenimage.py:tiny_pipeline'),
    'flux_lora': ('flux', 'configs/flux.py:tiny_pipeline'),
}


def _train_flags(config, folder):
  return [
      f'--config={config}',
      f'--config.model.checkpoint={folder}',
      '--config.model.build_tiny_pipeline=False',
      '--config.text.encoder=word',
      '--config.text.cache=',
      '--config.text.max_length=16',
      '--config.total_steps=1',
      '--config.eval.every=0',
      '--config.optim.lr=3e-2',  # one step that moves every trained weight visibly
  ]


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp('export')
  folders = {
      'qwenimage': model_folders.qwenimage(str(root / 'qwen_folder')),
      'flux': model_folders.flux(str(root / 'flux_folder')),
  }
  train = [
      (
          run,
          ['-m', 'digen_jax.main', f'--workdir={root / run}', *_train_flags(config, folders[fam])],
          str(root / run),
      )
      for run, (fam, config) in RUNS.items()
  ]
  trained = run_cases(train, timeout_s=400)
  for run in RUNS:
    assert trained[run]['code'] == 0, trained[run]['stderr'][-3000:]
  exports = [
      (
          run,
          [
              '-m',
              'digen_jax.export',
              f'--workdir={root / run}',
              f'--out={root / (run + "_diffusers")}',
              '--max_shard_mb=0.05',  # several shards even at toy size
          ],
          '',
      )
      for run in RUNS
  ]
  # Exporting into a folder that is not empty is one line.
  os.makedirs(root / 'taken')
  open(root / 'taken' / 'x', 'w').close()
  exports.append(
      (
          'taken',
          ['-m', 'digen_jax.export', f'--workdir={root / "qwen_lora"}', f'--out={root / "taken"}'],
          '',
      )
  )
  done = run_cases(exports, timeout_s=300)
  return root, folders, done


def _ours(workdir):
  """Our trained transformer (the checkpoint's params, LoRA merged) and its family."""
  config, mcfg, _, params = export_lib.trained_transformer(str(workdir))
  family = family_lib.of(config)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: family.new(mcfg, 0)))
  return family, nnx.merge(graphdef, params)


def _inputs(model, h, w, seed=0):
  rng = np.random.default_rng(seed)
  cfg = model.config
  latents = rng.standard_normal((2, h * w, cfg.in_channels), dtype=np.float32)
  sigma = np.array([0.35, 0.9], np.float32)
  text = rng.standard_normal((2, 5, cfg.joint_attention_dim), dtype=np.float32)
  return latents, sigma, text


def _qwen_outputs(pipe, model, h=4, w=3):
  latents, sigma, text = _inputs(model, h, w)
  mask = np.ones(text.shape[:2], np.int64)
  with torch.no_grad():
    ref = pipe.transformer(
        hidden_states=torch.from_numpy(latents),
        timestep=torch.from_numpy(sigma),
        guidance=None,
        encoder_hidden_states_mask=torch.from_numpy(mask),
        encoder_hidden_states=torch.from_numpy(text),
        img_shapes=[[(1, h, w)]] * 2,
        return_dict=False,
    )[0].numpy()
  ours = model(
      jnp.asarray(latents),
      jnp.asarray(sigma),
      jnp.asarray(text),
      jnp.asarray(mask),
      img_shape=(1, h, w),
  )
  return np.asarray(ours), ref


def _flux_outputs(pipe, model, h=4, w=3):
  latents, sigma, text = _inputs(model, h, w)
  pooled = np.random.default_rng(1).standard_normal(
      (2, model.config.pooled_projection_dim), dtype=np.float32
  )
  guidance = np.full((2,), 3.5, np.float32)
  with torch.no_grad():
    ref = pipe.transformer(
        hidden_states=torch.from_numpy(latents),
        encoder_hidden_states=torch.from_numpy(text),
        pooled_projections=torch.from_numpy(pooled),
        timestep=torch.from_numpy(sigma),
        img_ids=torch.from_numpy(flux_pipeline_image_ids(h, w)).float(),
        txt_ids=torch.zeros((text.shape[1], 3)),
        guidance=torch.from_numpy(guidance),
        return_dict=False,
    )[0].numpy()
  ours = model(
      jnp.asarray(latents),
      jnp.asarray(sigma),
      jnp.asarray(text),
      jnp.asarray(pooled),
      jnp.asarray(guidance),
      img_shape=(h, w),
  )
  return np.asarray(ours), ref


@pytest.mark.parametrize('run', list(RUNS))
def test_diffusers_loads_the_export_and_matches_our_transformer(exported, run):
  root, folders, done = exported
  r = done[run]
  assert r['code'] == 0, r['stderr'][-3000:]
  assert 'digen_jax export: step 1 (' in r['stdout'] and 'shard(s)' in r['stdout']
  family_name = RUNS[run][0]
  out, source = root / f'{run}_diffusers', folders[family_name]
  index = json.load(open(out / 'transformer' / 'diffusion_pytorch_model.safetensors.index.json'))
  assert len(set(index['weight_map'].values())) > 1  # sharded, with its index
  # The untouched components are the source's, byte for byte.
  for rel in (
      'model_index.json',
      'vae/diffusion_pytorch_model.safetensors',
      'scheduler/scheduler_config.json',
      'transformer/config.json',
  ):
    assert open(out / rel, 'rb').read() == open(os.path.join(source, rel), 'rb').read(), rel
  # The exported transformer is the trained one, not the base.
  base = load_file(os.path.join(source, 'transformer', 'diffusion_pytorch_model.safetensors'))
  trained = {}
  for shard in set(index['weight_map'].values()):
    trained.update(load_file(str(out / 'transformer' / shard)))
  assert set(trained) == set(base)
  moved = [k for k in base if not np.array_equal(base[k], trained[k])]
  assert 'transformer_blocks.0.attn.to_q.weight' in moved
  if run == 'qwen_full':
    assert 'proj_out.weight' in moved  # full fine-tuning moves weights LoRA does not target
  else:
    assert 'proj_out.weight' not in moved
  # diffusers' own loader reads the folder; its transformer gives ours.
  cls = diffusers.QwenImagePipeline if family_name == 'qwenimage' else diffusers.FluxPipeline
  absent = (
      dict(text_encoder=None, tokenizer=None)
      if family_name == 'qwenimage'
      else dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
  )
  pipe = cls.from_pretrained(str(out), dtype=torch.float32, **absent)
  family, model = _ours(root / run)
  ours, ref = (_qwen_outputs if family.name == 'qwenimage' else _flux_outputs)(pipe, model)
  err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
  print(f'{run}: max relative error of the exported transformer {err:.2e}')
  assert err <= 1e-4


def test_export_into_a_used_folder_is_one_line(exported):
  r = exported[2]['taken']
  assert r['code'] == 1 and 'Traceback' not in r['stderr']
  assert (
      last_line(r['stderr']).startswith('digen_jax: --out=')
      and 'not an empty folder' in r['stderr']
  )
