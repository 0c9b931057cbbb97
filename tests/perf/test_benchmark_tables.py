"""The tables the benchmark scripts write into RESULTS: time to quality (its targets) and the
disaggregation sweep, on runs written here."""

import json
import os
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import disagg_sweep  # noqa: E402  pylint: disable=g-import-not-at-top
import time_to_quality as ttq  # noqa: E402  pylint: disable=g-import-not-at-top


def _run(root, name, seed, accuracies, step_s):
  """A workdir whose metrics.jsonl has a training row a step (wall_s step_s, 16 samples) and an
  eval row every 50 steps with `accuracies`."""
  wd = os.path.join(root, f'{name}_s{seed}')
  os.makedirs(wd)
  with open(os.path.join(wd, 'metrics.jsonl'), 'w') as f:
    for step in range(1, 50 * (len(accuracies) - 1) + 1):
      f.write(
          json.dumps({'step': step, 'reward_mean': 0.5, 'wall_s': step_s, 'samples': 16}) + '\n'
      )
    for i, a in enumerate(accuracies):
      f.write(json.dumps({'step': 50 * i, 'eval/strict_accuracy': a}) + '\n')
  return wd


def test_time_to_quality_reports_the_targets_per_seed(tmp_path):
  root = str(tmp_path)
  curves = {}
  for seed, (g, n) in enumerate(
      [([0.18, 0.30, 0.40], [0.18, 0.55, 0.60]), ([0.18, 0.28, 0.36], [0.18, 0.33, 0.50])]
  ):
    curves[('grpo', seed)] = ttq.curve(_run(root, 'grpo', seed, g, 2.0))
    curves[('nft', seed)] = ttq.curve(_run(root, 'nft', seed, n, 2.0))
  text = ttq.targets(curves, 'grpo', 100)
  assert text.startswith('grpo mean final accuracy 38.00 % over seeds [0, 1]; its wall 200, 200 s')
  rows = {l.split('|')[1].strip(): l for l in text.splitlines() if l.startswith('| nft')}
  # seed 0: 55 % at step 50 (100 s = 0.50 of grpo's wall: no), +42 at its wall (yes)
  assert '| 100 (0.50) | no | +42.00 | yes |' in rows['nft s0']
  # seed 1: 38 % first at step 100 (200 s), +32 at its wall
  assert '| 200 (1.00) | no | +32.00 | no |' in rows['nft s1']
  assert ttq.table(curves, 'grpo', 100).count('\n') == 5  # head, rule, 4 runs
  incomplete = {('grpo', 0): curves[('grpo', 0)]}
  assert 'need every grpo run finished' in ttq.targets(incomplete, 'grpo', 150)


def test_the_disaggregation_sweep_writes_a_row_per_plan(tmp_path, monkeypatch):
  monkeypatch.setattr(disagg_sweep, 'MODELS', disagg_sweep.MODELS[:1])
  monkeypatch.setattr(disagg_sweep, 'OBJECTIVES', ('nft',))
  monkeypatch.setattr(disagg_sweep, 'K_VALUES', ('2',))
  assert (
      disagg_sweep.main(
          ['--out', str(tmp_path), '--clusters', '8xH100+8xH20', '--prices', 'H20=1.5']
      )
      == 0
  )
  with open(tmp_path / 'disagg_sweep.json') as f:
    rows = json.load(f)['rows']
  assert len(rows) == 2  # CFG on and off
  for r in rows:
    assert (
        r['objective'] == 'nft'
        and r['K'] == 2
        and r['usd_per_hour'] == pytest.approx(8 * 4.916 + 12)
    )
    assert set(r['against']) == {'verl_omni', 'ours_colocated', 'naive_disagg'}
  table = (tmp_path / 'disagg_sweep.md').read_text()
  assert (
      table.count('| Qwen-Image-20B LoRA | nft |') == 2 and (tmp_path / 'disagg_sweep.png').exists()
  )
