"""The real families' tiny pipelines (a random diffusers folder -> embedding cache -> the
family's transformer and VAE -> rewards) trained with the likelihood-free objectives
(config.rl.algorithm nft | awm): colocated LoRA runs that resume bit for bit, and a
two-process GAP run. torch never runs in the training process (tests/helpers/pipelines.py)."""

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from digen_jax.experiment import tiny_pipeline
from tests.helpers import pipelines
from tests.helpers.paths import REPO

FAMILIES = {
    'qwenimage': (os.path.join(REPO, 'configs', 'qwenimage.py'), tiny_pipeline.build),
    'flux': (os.path.join(REPO, 'configs', 'flux.py'), tiny_pipeline.build_flux),
    'wan21': (os.path.join(REPO, 'configs', 'wan21.py'), tiny_pipeline.build_wan),
}
# Each family with one objective, qwenimage with both: the objectives' code is
# family-agnostic, the families' forwards are what differs.
CASES = [('qwenimage', 'nft'), ('qwenimage', 'awm'), ('flux', 'nft'), ('wan21', 'awm')]
# nft's old policy trailing from the first step, so its copy is saved and restored too.
OBJECTIVE_FLAGS = {
    'nft': ['--config.rl.algorithm=nft', '--config.rl.train_noise_levels=2'],
    'awm': ['--config.rl.algorithm=awm', '--config.rl.train_noise_levels=2'],
}
COMMON = ['--config.rl.old_policy_uprate=0.2', '--config.rl.old_policy_uphold=0.4']


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """Each family's toy folder, built once, lazily (the worker has torch already)."""
  built = {}

  def get(family):
    if family not in built:
      out = str(tmp_path_factory.mktemp(f'tiny_{family}'))
      FAMILIES[family][1](out)
      built[family] = out
    return built[family]

  return get


def _adapters(workdir):
  return load_file(str(workdir / 'lora' / 'pytorch_lora_weights.safetensors'))


@pytest.mark.slow
@pytest.mark.parametrize('family, algorithm', CASES)
def test_colocated_lora_trains_and_resumes_bit_for_bit(folders, tmp_path, family, algorithm):
  """3 steps straight vs 2 steps + restart + 1 step: the same adapters, bit for bit (the old
  policy is in the optimizer state the checkpoint holds)."""
  config, _ = FAMILIES[family]
  folder = folders(family)
  extra = [*OBJECTIVE_FLAGS[algorithm], *COMMON, '--config.eval.every=0']
  straight = tmp_path / 'straight'
  pipelines.run_main(folder, straight, *extra, config=config)
  train = [r for r in pipelines.metrics_rows(straight) if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r['loss']) and r['nonfinite'] == 0 for r in train)
  adapters = _adapters(straight)
  assert any('lora_B' in k and np.abs(v).max() > 0 for k, v in adapters.items())  # it trained

  resumed = tmp_path / 'resumed'
  pipelines.run_main(folder, resumed, *extra, '--config.total_steps=2', config=config)
  r = pipelines.run_main(folder, resumed, *extra, config=config)
  assert 'resumed from' in r.stderr
  again = _adapters(resumed)
  assert sorted(again) == sorted(adapters)
  for k in adapters:
    np.testing.assert_array_equal(again[k], adapters[k], err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize('algorithm', sorted(OBJECTIVE_FLAGS))
def test_two_processes_with_gap(folders, tmp_path, algorithm):
  """Rollout and trainer in two processes, the batch in 2 fragments (GAP): it trains."""
  config, _ = FAMILIES['qwenimage']
  wd = tmp_path / 'mp'
  pipelines.run_main_two_processes(
      folders('qwenimage'),
      wd,
      *OBJECTIVE_FLAGS[algorithm],
      *COMMON,
      '--config.total_steps=2',
      '--config.schedule.fragments=2',
      '--config.eval.every=0',
      config=config,
  )
  train = [r for r in pipelines.metrics_rows(wd) if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2]
  assert all(r['fragments'] == 2 and np.isfinite(r['loss']) for r in train)
