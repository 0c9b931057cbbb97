"""benchmarks/shapes_eval_breakdown.py groups a run's per-prompt eval results correctly."""

import json
import os
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))

import shapes_eval_breakdown  # noqa: E402


def test_breakdown_by_kind_and_count(tmp_path, capsys):
  per_prompt = {
      'a red circle on a white background': {'pass_rate': 1.0, 'reward_mean': 0.9},
      'two red circles on a black background': {'pass_rate': 0.5, 'reward_mean': 0.8},
      'three green squares on a gray background': {'pass_rate': 0.0, 'reward_mean': 0.5},
      'three blue triangles on a white background': {'pass_rate': 0.25, 'reward_mean': 0.6},
      'a red circle above a yellow square on a white background': {
          'pass_rate': 0.75,
          'reward_mean': 0.9,
      },
  }
  (tmp_path / 'eval').mkdir()
  for step, scale in ((0, 0.0), (300, 1.0)):
    rows = {p: dict(d, pass_rate=d['pass_rate'] * scale) for p, d in per_prompt.items()}
    with open(tmp_path / 'eval' / f'eval_{step:06d}.json', 'w') as f:
      json.dump({'step': step, 'eval/strict_accuracy': 0.5 * scale, 'per_prompt': rows}, f)
  table = shapes_eval_breakdown.main([str(tmp_path), '--json', str(tmp_path / 'b.json')])
  final = table[300]
  assert final['all'] == pytest.approx(2.5 / 5)
  assert final['single'] == pytest.approx(1.75 / 4) and final['n_single'] == 4
  assert final['single_count1'] == 1.0 and final['single_count2'] == 0.5
  assert final['single_count3'] == pytest.approx(0.125) and final['n_single_count3'] == 2
  assert final['relation'] == 0.75 and final['n_relation'] == 1
  # Per held-out pair: red circle is in the 1st, 2nd and 5th prompt, green square in the 3rd;
  # blue triangle (4th) is held out too, yellow square is not (it only rides along in the 5th).
  assert final['red_circle'] == pytest.approx((1.0 + 0.5 + 0.75) / 3) and final['n_red_circle'] == 3
  assert final['green_square'] == 0.0 and final['blue_triangle'] == 0.25
  assert 'yellow_square' not in final
  assert table[0]['all'] == 0.0
  assert json.load(open(tmp_path / 'b.json'))['300']['relation'] == 0.75
  assert '50.00%' in capsys.readouterr().out


def test_breakdown_refuses_a_directory_without_evals(tmp_path):
  with pytest.raises(SystemExit, match='no eval/eval_'):
    shapes_eval_breakdown.main([str(tmp_path)])
