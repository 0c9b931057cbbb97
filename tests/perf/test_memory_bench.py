"""benchmarks/memory.py at configs/qwenimage.py:tiny_pipeline sizes: XLA's per-device memory of
the real update and rollout programs, compiled ahead of time on fake CPU devices (no weights,
no pipeline folder: the toy VAE comes from --vae=tiny)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import xla_env
from tests.helpers.paths import REPO

SCRIPT = os.path.join(REPO, 'benchmarks', 'memory.py')
CONFIG = os.path.join(REPO, 'configs', 'qwenimage.py')


def _start(tmp_path, name: str, variant: str, devices: int, *extra: str):
  out = tmp_path / f'{name}.json'
  # The script must set its own device count whatever the parent's XLA_FLAGS say (conftest
  # fakes 4 devices for the test process).
  env = xla_env.env_with_devices(3)
  cmd = [
      sys.executable,
      SCRIPT,
      f'--config={CONFIG}:{variant}',
      f'--devices={devices}',
      '--vae=tiny',
      f'--out={out}',
      *extra,
  ]
  proc = subprocess.Popen(
      cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
  )
  return proc, out


def _finish(started) -> dict:
  proc, out = started
  log, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, log[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_memory_bench_tiny_pipeline(tmp_path):
  # Three runs at once (each is mostly single-threaded compilation).
  lora4 = _start(tmp_path, 'lora4', 'tiny_pipeline', 4, '--pipelines=default')
  full4 = _start(
      tmp_path, 'full4', 'tiny_pipeline,full', 4, '--programs=update', '--pipelines=no_hoist'
  )
  lora2 = _start(tmp_path, 'lora2', 'tiny_pipeline', 2, '--programs=update', '--pipelines=default')
  lora4, full4, lora2 = _finish(lora4), _finish(full4), _finish(lora2)

  # Both programs (the rollout in both layouts) have positive figures.
  assert set(lora4['programs']) == {'update', 'rollout_replicated', 'rollout_fsdp'}
  for name, p in lora4['programs'].items():
    pd = p['per_device']
    for key in ('argument_bytes', 'output_bytes', 'temp_bytes', 'total_bytes', 'held_total_bytes'):
      assert pd[key] > 0, (name, key, pd)
    assert pd['total_bytes'] == (
        pd['argument_bytes'] + pd['output_bytes'] - pd['alias_bytes'] + pd['temp_bytes']
    )
    assert pd['held_argument_bytes'] >= pd['argument_bytes'], name
    assert p['xla_flops'] > 0 and p['analytic_mmdit_flops'] > 0, name
    assert p['batch'] == 8 and p['pipeline'] == 'default', name
  s = lora4['settings']
  assert s['devices'] == 4 and s['finetune'] == 'lora' and s['cfg'] and s['per_device_batch'] == 2
  assert 'tiny' in s['vae'] and 'while' in lora4['flops_note']
  assert lora4['command'].startswith('python ') and lora4['machine']['cpu_count'] >= 1

  # The update donates params and optimizer state: XLA aliases them to its outputs.
  assert lora4['programs']['update']['per_device']['alias_bytes'] > 0
  # Rollout layouts: the FSDP copy of the weights (adapters and base) holds less per device.
  rep, fsdp = (lora4['programs'][f'rollout_{k}'] for k in ('replicated', 'fsdp'))
  assert fsdp['argument_groups_bytes']['params'] < rep['argument_groups_bytes']['params']
  assert fsdp['per_device']['argument_bytes'] < rep['per_device']['argument_bytes']
  assert rep['base_sharding'] == 'replicated' and fsdp['base_sharding'] == 'fsdp'
  assert set(lora4['colocated_estimate']) == {'rollout_replicated', 'rollout_fsdp'}

  # Analytic counts: LoRA adapters (float32) are a small part of the model; Adam keeps 2 moments.
  a, af = lora4['analytic'], full4['analytic']
  assert a['trainable'] == 'lora' and af['trainable'] == 'full'
  assert 0 < a['adapter_bytes_f32'] < af['trainable_bytes_f32'] == 4 * af['mmdit_params']
  assert af['optimizer_state_bytes'] >= 2 * af['trainable_bytes_f32']
  assert a['frozen_base_bytes'] == 4 * a['mmdit_params']  # tiny_pipeline: float32 frozen

  # LoRA's trainer holds less than full fine-tuning's (params + optimizer state); argument bytes
  # do not depend on the pass pipeline.
  lu, fu = lora4['programs']['update'], full4['programs']['update']
  assert lu['per_device']['argument_bytes'] < fu['per_device']['argument_bytes']
  assert (
      lu['argument_groups_bytes']['params'] + lu['argument_groups_bytes']['opt_state']
      < fu['argument_groups_bytes']['params'] + fu['argument_groups_bytes']['opt_state']
  )
  assert fu['pipeline'] == 'no_hoist' and set(fu['pipelines']) == {'no_hoist'}
  assert fu['per_device']['temp_bytes'] > 0

  # Sharding over more devices lowers the per-device argument bytes (FSDP state and batch).
  l2 = lora2['programs']['update']
  assert lora2['settings']['devices'] == 2 and l2['batch'] == 8
  assert lu['per_device']['argument_bytes'] < l2['per_device']['argument_bytes']
  assert lu['argument_groups_bytes']['frozen'] < l2['argument_groups_bytes']['frozen']
