"""configs/qwenimage.py:tiny_pipeline end to end: a random diffusers Qwen-Image folder (transformer,
VAE, Qwen2.5-VL text encoder, tokenizer, scheduler) -> embedding cache -> MMDiT sampling with
true CFG -> VAE decode -> JPEG + ShapesBench rewards -> GRPO with LoRA; colocated, two
processes, and resumed after a restart. The training process must never import torch: a
meta-path hook makes any torch import in it fail loudly."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from digen_jax.experiment import tiny_pipeline
from tests.helpers.paths import REPO
from tests.helpers.pipelines import flags, metrics_rows, run_main, run_main_two_processes


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """The toy diffusers Qwen-Image folder, built here: the worker has torch already (its
  collection imports it), a child process would import it again. Main building the folder
  itself, in a child, is test_flux_pipeline's."""
  out = str(tmp_path_factory.mktemp('tiny_qwenimage'))
  tiny_pipeline.build(out)
  return out


def test_lora_publishes_only_adapters(folder, tmp_path):
  """The publish of a LoRA run is its adapters: measured against full fine-tuning of the same
  pipeline folder (README quotes the factor for the real model from benchmarks/memory.py)."""
  from configs import qwenimage
  from digen_jax.experiment import build as experiment
  from digen_jax.runtime import publish

  sizes = {}
  for variant in ('tiny_pipeline', 'tiny_pipeline,full'):
    c = qwenimage.get_config(variant)
    c.model.checkpoint, c.text.cache = folder, os.path.join(folder, 'missing_cache')
    c.text.encoder = 'word'  # the cache is not what this test is about
    c.model.joint_attention_dim = 32
    mcfg, weights = experiment.build_weights(c)
    sizes[variant] = publish.publish_megabytes(weights.params)
    if 'full' in variant:
      assert weights.lora is None and sizes[variant] > 0
    else:
      assert set(weights.params) and all(set(v) == {'a', 'b'} for v in weights.params.values())
  factor = sizes['tiny_pipeline,full'] / sizes['tiny_pipeline']
  print(
      f'publish MB: full {sizes["tiny_pipeline,full"]:.4f}, LoRA {sizes["tiny_pipeline"]:.4f}, '
      f'factor {factor:.1f}'
  )
  assert factor > 4


@pytest.mark.slow
def test_colocated_lora_runs_and_resumes(folder, tmp_path):
  """3 steps straight vs 2 steps + restart + 1 step: same adapters, bit for bit."""
  straight = tmp_path / 'straight'
  run_main(folder, straight)  # also encodes the prompts into the cache (a child process)
  assert os.path.isfile(os.path.join(folder, 'model_index.json'))
  rows = metrics_rows(straight)
  train = [r for r in rows if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r['loss']) and r['nonfinite'] == 0 for r in train)
  # On-policy, unchanged params: the first update's importance ratio is 1 to float rounding.
  assert abs(train[0]['ratio_mean'] - 1.0) < 1e-5, train[0]
  assert any('eval/reward_mean' in r for r in rows)
  lora_file = straight / 'lora' / 'pytorch_lora_weights.safetensors'
  adapters = load_file(str(lora_file))
  assert adapters and all(k.startswith('transformer.') for k in adapters)
  assert any('lora_B' in k and np.abs(v).max() > 0 for k, v in adapters.items())  # it trained

  resumed = tmp_path / 'resumed'
  run_main(folder, resumed, '--config.total_steps=2')
  r = run_main(folder, resumed)
  assert 'resumed from' in r.stderr
  assert [x['step'] for x in metrics_rows(resumed) if 'reward_mean' in x] == [1, 2, 3]
  again = load_file(str(resumed / 'lora' / 'pytorch_lora_weights.safetensors'))
  assert sorted(again) == sorted(adapters)
  for k in adapters:
    np.testing.assert_array_equal(again[k], adapters[k], err_msg=k)

  # A folder without its text encoder trains on a complete cache (a warning says it is used
  # unchecked); a prompt the cache lacks is one line saying why it cannot be encoded here.
  bare = tmp_path / 'no_text_encoder'
  shutil.copytree(folder, bare, ignore=shutil.ignore_patterns('text_encoder'))
  r = run_main(bare, tmp_path / 'bare_run', '--config.total_steps=1')
  assert 'has no text_encoder/: config.text.cache holds every prompt' in r.stderr
  r = subprocess.run(
      [sys.executable, '-m', 'digen_jax.main']
      + flags(
          bare, tmp_path / 'bare_new', 'tiny_pipeline', '--config.sampler.negative_prompt=new words'
      ),
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  said = [l for l in r.stderr.splitlines() if l.startswith('digen_jax: ')]
  assert r.returncode == 1 and len(said) == 1, r.stderr[-3000:]
  assert f"config.model.checkpoint='{bare}' has no text_encoder/, so the prompts" in said[0]


@pytest.mark.slow
def test_two_processes_lora_with_resume(folder, tmp_path):
  wd = tmp_path / 'mp'
  for steps in (2, 3):  # a restart in the middle resumes
    run_main_two_processes(folder, wd, f'--config.total_steps={steps}')
  train = [r for r in metrics_rows(wd) if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert abs(train[0]['ratio_mean'] - 1.0) < 1e-5
  # Only adapters travel: the publish is the adapters' size, not the model's.
  assert train[0]['publish_mb'] < 0.1
  assert os.path.isfile(wd / 'lora' / 'pytorch_lora_weights.safetensors')
