"""FLUX.1 through the same loop as Qwen-Image.

* LoRA interop: adapters saved by a FLUX run load into diffusers' own FluxPipeline.load_lora_weights
  and give our merged forward's output (double- and single-stream blocks, alpha != rank).
* configs/flux.py:tiny_pipeline end to end: a random diffusers FLUX.1 folder (transformer with the
  guidance embedding, AutoencoderKL, CLIP + T5) -> embedding cache (T5 sequences + CLIP pooled) ->
  FLUX sampling with distilled guidance -> VAE decode -> rewards -> GRPO with LoRA; colocated with a
  bit-identical resume, and two processes. Torch never loads in training.
* configs/flux.py at real size is a valid config, and `:tiny` runs in one process.
"""

import copy
import os

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from configs import flux as flux_config
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.models.transformers import flux
from digen_jax.models.io import flux_convert
from digen_jax.models.lora import adapters as lora
from tests.helpers import diffusers_models
from tests.helpers import pipelines
from tests.helpers.paths import REPO

CONFIG = os.path.join(REPO, 'configs', 'flux.py')
TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
RANK_ALPHA = lora.LoraConfig(rank=4, alpha=6.0, targets=flux_config.get_config().model.lora.targets)


def _real(variant=None):
  c = flux_config.get_config(variant)
  c.model.checkpoint = '/path/FLUX.1-dev'  # validate() checks fields, not the folders
  c.text.cache = '/path/cache'
  c.data.prompts = '/path/prompts.txt'
  return c


def test_real_config_is_valid_and_sized_as_flux_dev():
  c = _real()
  configlib.validate(c, 8)
  mcfg = experiment.model_config_from(c)
  assert isinstance(mcfg, flux.FluxConfig) and mcfg.guidance_embeds
  assert 11.5e9 < flux.count_params(mcfg) < 12.5e9
  schnell = experiment.model_config_from(_real('schnell'))
  assert not schnell.guidance_embeds and flux.count_params(schnell) < flux.count_params(mcfg)
  for variant in ('schnell', 'dance', 'full,disagg'):
    configlib.validate(_real(variant), 8)
  c = _real()
  c.sampler.guidance_scale = 4.0
  with pytest.raises(ValueError, match='guidance-distilled'):
    configlib.validate(c, 8)
  c = _real()
  c.text.encoder = 'qwen2.5-vl'
  with pytest.raises(ValueError, match="text.encoder='qwen2.5-vl' must be 't5-clip'"):
    configlib.validate(c, 8)


def test_diffusers_loads_our_flux_lora(tmp_path):
  """diffusers' own loader reads our adapters file and reproduces our merged forward."""
  tmodel = diffusers_models.randomized_transformer(diffusers.FluxTransformer2DModel, **TINY)
  cfg = flux_convert.config_from_diffusers(dict(tmodel.config))
  model = flux_convert.load_flux_from_diffusers(tmodel.state_dict(), cfg)
  graphdef, state = nnx.split(model)
  table = flux_convert.flux_key_table(cfg)
  paths = lora.target_paths(state, table, RANK_ALPHA)
  assert any(p.startswith('single_blocks') for p in paths) and any(
      p.startswith('blocks') for p in paths
  )
  adapters = lora.init_adapters(state, paths, RANK_ALPHA, jax.random.key(0))
  key = jax.random.key(1)
  for p in adapters:  # B = 0 at init: give every adapter real values
    key, k = jax.random.split(key)
    adapters[p]['b'] = 0.3 * jax.random.normal(k, adapters[p]['b'].shape)
  lora.save_diffusers_lora(tmp_path, jax.device_get(adapters), RANK_ALPHA, table)

  rng = np.random.default_rng(0)
  h, w, n_txt, b = 3, 5, 7, 2
  x = rng.standard_normal((b, h * w, TINY['in_channels'])).astype(np.float32)
  text = rng.standard_normal((b, n_txt, TINY['joint_attention_dim'])).astype(np.float32)
  pooled = rng.standard_normal((b, TINY['pooled_projection_dim'])).astype(np.float32)
  sigma, guidance = np.array([0.7, 0.3], np.float32), np.array([3.5, 3.5], np.float32)

  def torch_forward(transformer):
    img_ids = torch.from_numpy(flux.image_ids(h, w).astype(np.float32))
    with torch.no_grad():
      return transformer(
          hidden_states=torch.from_numpy(x),
          encoder_hidden_states=torch.from_numpy(text),
          pooled_projections=torch.from_numpy(pooled),
          timestep=torch.from_numpy(sigma),
          guidance=torch.from_numpy(guidance),
          img_ids=img_ids,
          txt_ids=torch.zeros(n_txt, 3),
          return_dict=False,
      )[0].numpy()

  transformer = copy.deepcopy(tmodel)
  pipe = diffusers.FluxPipeline(
      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
      vae=None,
      text_encoder=None,
      tokenizer=None,
      text_encoder_2=None,
      tokenizer_2=None,
      transformer=transformer,
  )
  pipe.load_lora_weights(str(tmp_path))
  ref = torch_forward(transformer)
  merged = nnx.merge(graphdef, lora.merge(state, adapters, RANK_ALPHA))
  ours = np.asarray(
      merged(
          jnp.asarray(x),
          jnp.asarray(sigma),
          jnp.asarray(text),
          jnp.asarray(pooled),
          jnp.asarray(guidance),
          img_shape=(h, w),
      )
  )
  rel = lambda a, b_: float(np.abs(a - b_).max() / np.abs(b_).max())
  assert rel(ours, ref) <= 1e-4
  assert rel(torch_forward(tmodel), ref) > 0.05  # the adapters matter: a dropped one would show


def _main(folder, workdir, *extra, variant='tiny_pipeline'):
  return pipelines.run_main(folder, workdir, *extra, variant=variant, config=CONFIG)


@pytest.mark.slow
def test_tiny_pipeline_colocated_lora_runs_and_resumes(tmp_path):
  """2 steps, then a restart that resumes for the third; the folder and the cache are built by
  the run itself (child processes). The bit-for-bit comparison of a resumed LoRA run with a
  straight one is test_qwenimage_pipeline's: checkpointing the adapters is family-agnostic."""
  folder = str(tmp_path / 'pipeline')
  run = tmp_path / 'run'
  _main(folder, run, '--config.total_steps=2')
  assert os.path.isfile(os.path.join(folder, 'model_index.json'))
  resumed = _main(folder, run)
  assert 'resumed from' in resumed.stderr
  rows = pipelines.metrics_rows(run)
  train = [r for r in rows if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r['loss']) and r['nonfinite'] == 0 for r in train)
  assert abs(train[0]['ratio_mean'] - 1.0) < 1e-5, train[0]
  assert any('eval/reward_mean' in r for r in rows)
  adapters = load_file(str(run / 'lora' / 'pytorch_lora_weights.safetensors'))
  assert any('single_transformer_blocks' in k for k in adapters)
  assert any('lora_B' in k and np.abs(v).max() > 0 for k, v in adapters.items())  # it trained

  # Two processes (a restart of a two-process run is test_qwenimage_pipeline's).
  wd = tmp_path / 'mp'
  pipelines.run_main_two_processes(folder, wd, '--config.total_steps=2', config=CONFIG)
  train = [r for r in pipelines.metrics_rows(wd) if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2]
  assert abs(train[0]['ratio_mean'] - 1.0) < 1e-5
  assert train[0]['publish_mb'] < 0.1  # only adapters travel
