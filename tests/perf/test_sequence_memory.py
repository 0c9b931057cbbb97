"""The memory tool on the real Wan2.1-14B (configs/wan21.py:disagg, 832x480 x 81 frames: 32,760
tokens a sample): XLA's ahead-of-time memory analysis of the trainer's fragment gradient on 8
fake CPU devices (`python -m digen_jax.perf.costs`, nothing runs), with each sample's tokens split
over the 8 devices (config.parallel.sequence=8) and without: a fragment of one video over the
recipe's K = 11 trained steps x 2 CFG branches, the steps one after another (rl.step_loop=scan),
XLA:CPU without the pass that hoists f32 copies of whole bf16 stacks (--xla_pipeline=no_hoist,
closer to an accelerator). The split is what brings it under an 80 GB device;
benchmarks/RESULTS.md ("Sequence parallelism for long videos") records these figures and the
rollout's. Slow: two compiles of the 14B program, about a minute each here."""

import dataclasses
import json
import subprocess
import sys

import pytest

from configs import wan21
from digen_jax.perf import sequence_fit
from tests.helpers import xla_env
from tests.mp_scripts import launcher_util as util

DEVICE_BYTES = 80e9  # an 80 GB accelerator (H100/A100-80GB)


def _grad_bytes(tmp_path, split: int) -> dict:
  out = tmp_path / f'grad_s{split}.json'
  proc = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.perf.costs',
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
  """fit_sequence_split (python -m digen_jax.perf.costs --fit_gb) on wan21:tiny (2 heads) over 4
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


@pytest.mark.slow
def test_the_planner_compiles_a_split_the_cache_lacks_once(tmp_path, monkeypatch):
  """planner.split_computer on wan21:tiny (2 heads), into an empty cache: the rollout and the
  gradient (its K steps as a vmap and as a scan) compiled at config.parallel.sequence = 2 at
  one and two videos a row of 2 devices, stored under their own keys; the trainer's options at
  that split read exactly those compiles' temp memory; asked again, nothing is compiled."""
  from digen_jax.perf import hardware  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import planner as planning  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import run_models  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import roles  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import runmodel as rm  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import splits  # pylint: disable=g-import-not-at-top

  monkeypatch.delenv('DIGEN_COSTS_CACHE_ONLY', raising=False)
  config = wan21.get_config('tiny')
  log = tmp_path / 'log.txt'
  with open(log, 'w') as f:
    run = run_models.run_model(
        'configs/wan21.py:tiny', config, [], planning.Settings(), directory=str(tmp_path), log=f
    )
    assert run.split_memory == {}
    compute = splits.split_computer(
        'configs/wan21.py:tiny', config, [], run, directory=str(tmp_path), log=f
    )
    memory = compute(2)
  split_files = sorted(p.name for p in tmp_path.glob('*_no-hoist_*.json'))
  assert len(split_files) == 4, split_files
  assert sum('_scan_' in n for n in split_files) == 2
  assert set(memory.grads) == set(memory.scans) == {bool(config.model.remat)}
  at2 = dataclasses.replace(run, sequence=2, split_memory={2: memory})
  group = roles.Group(hardware.parse_cluster('4xH100'))
  options = {
      (o.detail['loop'], o.detail['chunk']): o
      for o in rm.grad_options(at2, group, 2, rm.Knobs(), tsp=False)
  }
  compiled = {}
  for name in split_files:
    d = json.loads((tmp_path / name).read_text())
    if d['settings']['fragment_samples'] == d['devices'] // 2:  # one video a row of 2 devices
      compiled[d['key']['step_loop'] or 'vmap'] = d['programs']['grad']['memory']['temp_bytes']
  # Affine through both compiles (proportional to the larger when the constant would be < 0:
  # a few bytes off here).
  for loop in ('vmap', 'scan'):
    assert options[(loop, 1)].memory['temp'] == pytest.approx(compiled[loop], rel=1e-4), loop
  before = log.read_text().count('computing costs')
  with open(log, 'a') as f:
    splits.split_computer('configs/wan21.py:tiny', config, [], run, directory=str(tmp_path), log=f)(
        2
    )
  assert log.read_text().count('computing costs') == before
