"""The text-rendering task end to end on the tiny pipelines: configs/qwenimage.py and
configs/flux.py `:tiny_pipeline,ocr` -- a random diffusers folder, the text_render prompts encoded
into the cache, sampling, VAE decode, the OCR reward (PP-OCRv4) in two reward worker processes
that the run starts itself, GRPO with LoRA -- for 2 steps, with the rewards' figures in
metrics.jsonl. The training process must never import torch, transformers or the OCR engine: a
meta-path hook makes any such import in it fail loudly (the workers are their own processes)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.paths import REPO

# digen_jax.main with the model code of the rewards and the text encoders unimportable here; the
# tiny pipeline folder, the prompt cache and the reward workers are child processes.
_BLOCKED_MAIN = r"""
import sys
class _Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('torch', 'transformers', 'rapidocr_onnxruntime', 'onnxruntime'):
      raise ImportError(f'{name} imported in the training process')
    return None
sys.meta_path.insert(0, _Block())
import runpy
sys.argv = ['digen_jax.main'] + sys.argv[1:]
runpy.run_module('digen_jax.main', run_name='__main__')
"""


def _run(family: str, root) -> tuple[str, list[dict], dict]:
  """main of configs/<family>.py:tiny_pipeline,ocr for 2 steps; main builds the toy folder and
  encodes the prompts in child processes. -> (stderr, metrics rows, config.json)."""
  folder, wd = root / 'folder', root / 'run'
  r = subprocess.run(
      [
          sys.executable,
          '-c',
          _BLOCKED_MAIN,
          f'--config={os.path.join(REPO, "configs", family + ".py")}:tiny_pipeline,ocr',
          f'--workdir={wd}',
          f'--config.model.checkpoint={folder}',
          f'--config.text.cache={folder}/text_cache',
          f'--config.data.data_dir={folder}/data',
          '--config.total_steps=2',
      ],
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO),
      capture_output=True,
      text=True,
      timeout=1500,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  rows = [json.loads(l) for l in open(wd / 'metrics.jsonl')]
  return r.stderr, rows, json.load(open(wd / 'config.json'))


@pytest.mark.slow
@pytest.mark.parametrize('family', ['qwenimage', 'flux'])
def test_tiny_pipeline_runs_the_ocr_task_with_reward_workers(family, tmp_path):
  log, rows, config = _run(family, tmp_path)
  assert config['data']['prompts'] == 'text_render' and config['reward']['weights'] == 'ocr'
  assert config['eval']['split'] == 'eval'
  # The run started its two OCR workers (torch/onnxruntime blocked here: they are processes).
  for i in (0, 1):
    assert f'reward worker {i} (ocr on cpu) ready' in log, log[-3000:]
  train = [r for r in rows if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2]
  for r in train:
    assert 0.0 <= r['reward_mean'] <= 1.0 and r['nonfinite'] == 0, r
    assert r['reward_failed'] == 0 and r['reward_retries'] == 0, r
    assert r['reward_s_per_sample'] > 0 and r['reward_wait_s'] >= 0, r
    assert np.isfinite(r['loss'])
  evals = [r for r in rows if 'eval/reward_mean' in r]
  assert evals and all(r['eval/reward_failed'] == 0 for r in evals)
  assert all(0.0 <= r['eval/reward_mean'] <= 1.0 for r in evals)
