"""The memory tool on the real Wan2.1-14B (configs/wan21.py:disagg, 832x480 x 81 frames: 32,760
tokens a sample): XLA's ahead-of-time memory analysis of the trainer's fragment gradient on 8
fake CPU devices (`python -m digen_jax.sim.costs`, nothing runs), with each sample's tokens split
over the 8 devices (config.parallel.sequence=8) and without: a fragment of one video over the
recipe's K = 11 trained steps x 2 CFG branches, the steps one after another (rl.step_loop=scan),
XLA:CPU without the pass that hoists f32 copies of whole bf16 stacks (--xla_pipeline=no_hoist,
closer to an accelerator). The split is what brings it under an 80 GB device;
benchmarks/RESULTS.md ("Sequence parallelism for long videos") records these figures and the
rollout's. Slow: two compiles of the 14B program, about a minute each here."""

import json
import subprocess
import sys

import pytest

from configs import wan21
from digen_jax.sim import sequence_fit
from tests import xla_env
from tests.mp_scripts import launcher_util as util

DEVICE_BYTES = 80e9  # an 80 GB accelerator (H100/A100-80GB)


def _grad_bytes(tmp_path, split: int) -> dict:
  out = tmp_path / f'grad_s{split}.json'
  proc = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.sim.costs',
          '--config=configs/wan21.py:disagg',
          '--devices=8',
          '--programs=grad',
          '--method=raw',
          '--fragment_batch=8',
          '--fragment_samples=1',
          '--config.rl.step_loop=scan',
          '--xla_pipeline=no_hoist',
          f'--config.parallel.sequence={split}',
          f'--json={out}',
      ],
      cwd=util.REPO,
      env=xla_env.env_with_devices(8),
      capture_output=True,
      text=True,
      timeout=1200,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data['settings']['sequence_split'] == split
  assert data['settings']['image_tokens'] == 32760 and data['settings']['trained_steps'] == 11
  return data['programs']['grad']['memory']


@pytest.mark.slow
def test_the_14b_fragment_gradient_fits_80gb_only_with_the_tokens_split(tmp_path):
  split = _grad_bytes(tmp_path, 8)
  whole = _grad_bytes(tmp_path, 1)
  assert split['total_bytes'] < DEVICE_BYTES, split
  assert whole['total_bytes'] > DEVICE_BYTES, whole
  # The same weights on each device; the activations of one video spread over 8 devices.
  assert split['argument_bytes'] == whole['argument_bytes']
  assert whole['temp_bytes'] > 5 * split['temp_bytes']


@pytest.mark.slow
def test_the_fit_search_tries_each_split_smallest_first():
  """fit_sequence_split (python -m digen_jax.sim.costs --fit_gb) on wan21:tiny (2 heads) over 4
  fake devices, a fragment of 1 video: the splits 1 and 2 in order; none fits 0 bytes, the
  first fits any budget, and the split lowers the per-device temporaries."""
  config = wan21.get_config('tiny')
  kw = dict(programs_=('grad',), method='raw', fragment_batch=4, fragment_samples=1)
  split, tried = sequence_fit.fit_sequence_split(config, 4, 0.0, **kw)
  assert split is None and list(tried) == [1, 2]
  temp = {s: c.programs['grad'].memory.temp_bytes for s, c in tried.items()}
  assert temp[2] < temp[1], temp
  assert [c.settings['sequence_split'] for c in tried.values()] == [1, 2]
  split, tried = sequence_fit.fit_sequence_split(config, 4, float('inf'), **kw)
  assert split == 1 and list(tried) == [1]
