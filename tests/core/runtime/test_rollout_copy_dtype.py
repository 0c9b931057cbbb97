"""The rollout copy in the dtype the config publishes, in every mode: full
fine-tuning under bf16 compute samples with a bf16 copy colocated as well as disaggregated, the
planner costs that copy, and LoRA keeps float32 adapters everywhere."""

import json
import subprocess
import sys

import pytest

from configs import flux
from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.experiment import validation
from tests.helpers import xla_env
from tests.helpers.paths import REPO


@pytest.mark.parametrize('module', [qwenimage, flux])
def test_full_finetuning_publishes_bf16_in_every_mode(module):
  for variant in ('full', 'full,disagg'):
    assert module.get_config(variant).cluster.rollout.param_dtype == 'bfloat16', variant
  # float32 compute (the toy variants) and LoRA (float32 adapters) keep a float32 copy.
  for variant in ('', 'disagg', 'full,tiny', 'full,tiny_pipeline', 'tiny_pipeline'):
    assert module.get_config(variant).cluster.rollout.param_dtype == 'float32', variant


def test_lora_with_a_bf16_copy_is_refused_colocated_too():
  c = configlib.apply_overrides(qwenimage.get_config('tiny_pipeline'), {})
  c.cluster.rollout.param_dtype = 'bfloat16'
  assert c.runtime.mode != 'disagg'
  with pytest.raises(ValueError, match='param_dtype must be float32 with LoRA'):
    validation.validate(c, 2)


@pytest.mark.slow
def test_colocated_main_job_samples_with_the_configured_copy(tmp_path):
  """configs/qwenimage.py:tiny colocated, one step, with a bf16 rollout copy: the run publishes
  half the float32 bytes (publish_mb of the metrics row)."""
  rows = {}
  for dtype in ('float32', 'bfloat16'):
    wd = tmp_path / dtype
    cmd = [
        sys.executable,
        '-m',
        'digen_jax.main',
        '--config=configs/qwenimage.py:tiny',
        f'--workdir={wd}',
        '--config.total_steps=1',
        f'--config.cluster.rollout.param_dtype={dtype}',
    ]
    r = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=xla_env.env_with_devices(2)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows[dtype] = [json.loads(l) for l in open(wd / 'metrics.jsonl')][-1]
  assert rows['bfloat16']['publish_mb'] == pytest.approx(
      rows['float32']['publish_mb'] / 2, rel=1e-3
  )
