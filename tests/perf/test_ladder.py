"""benchmarks/ladder.py: the rungs' override sets, the run plan, ratios, bad input, and a real
short ladder (colocated and naive disagg in one process) with docs/design.md#measuring's JSON
keys."""

import csv
import json
import os
import re
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import ladder  # noqa: E402  (benchmarks/ is not a package; it imports launch/sweep.py)

TINY_DISAGG = os.path.join(REPO, 'configs', 'qwenimage.py') + ':tiny_disagg'


def test_rungs_add_one_technique_each():
  none = lambda field: False
  assert ladder.rung_overrides('colocated', none) == ('--config.runtime.mode=colocated',)
  assert ladder.rung_overrides('disagg', none) == ()
  assert ladder.rung_overrides('gap', none, fragments=3, fragment_unit='group') == (
      '--config.schedule.fragments=3',
      '--config.schedule.fragment_unit=group',
  )
  assert ladder.rung_overrides('tag', none) == (
      '--config.schedule.fragments=4',
      '--config.schedule.fragment_unit=sample',
      '--config.schedule.tsp=True',
      '--config.schedule.tag=True',
  )
  assert ladder.rung_overrides('tcss', none, tcss_fraction=0.25)[-1] == (
      '--config.schedule.tcss_fraction=0.25'
  )
  # Where the config has the fields, the techniques a rung leaves off are set off explicitly.
  every = lambda field: True
  assert ladder.rung_overrides('disagg', every) == (
      '--config.schedule.fragments=1',
      '--config.schedule.tsp=False',
      '--config.schedule.tag=False',
      '--config.schedule.tcss_fraction=0.0',
      '--config.schedule.trace=True',
  )
  assert ladder.rung_overrides('tsp', every)[:5] == (
      '--config.schedule.fragments=4',
      '--config.schedule.fragment_unit=sample',
      '--config.schedule.tsp=True',
      '--config.schedule.tag=False',
      '--config.schedule.tcss_fraction=0.0',
  )


def test_plan_runs_colocated_once_then_each_variant():
  plan = ladder.build_runs(
      ['colocated', 'disagg', 'tag'],
      ['mp2', 'sp'],
      lambda f: False,
      devices=2,
      common=('--config.total_steps=5',),
  )
  names = [(run.name, rung, variant) for run, rung, variant in plan]
  assert names == [
      ('colocated', 'colocated', '-'),
      ('mp2-disagg', 'disagg', 'mp2'),
      ('mp2-tag', 'tag', 'mp2'),
      ('sp-disagg', 'disagg', 'sp'),
      ('sp-tag', 'tag', 'sp'),
  ]
  run = {r.name: r for r, _, _ in plan}
  assert (run['colocated'].num_processes, run['colocated'].devices_per_process) == (1, 4)
  assert (run['mp2-tag'].num_processes, run['mp2-tag'].devices_per_process, run['mp2-tag'].pin) == (
      2,
      2,
      True,
  )
  assert (run['sp-tag'].num_processes, run['sp-tag'].devices_per_process) == (1, 4)
  assert run['sp-tag'].overrides[0] == '--config.total_steps=5'
  unpinned = ladder.build_runs(['tag'], ['mp2u'], lambda f: False)[0][0]
  assert (unpinned.name, unpinned.num_processes, unpinned.pin) == ('mp2u-tag', 2, False)
  assert ladder.parse_args([]).variants == ['mp2', 'sp']  # mp2u only when asked


def test_ratios():
  rows = [
      {'name': 'colocated', 'variant': '-', 'status': 'ok', 'samples_per_s': 10.0},
      {'name': 'mp2-disagg', 'variant': 'mp2', 'status': 'ok', 'samples_per_s': 8.0},
      {'name': 'mp2-tag', 'variant': 'mp2', 'status': 'ok', 'samples_per_s': 12.0},
      {'name': 'mp2-gap', 'variant': 'mp2', 'status': 'invalid', 'samples_per_s': None},
      {'name': 'sp-tag', 'variant': 'sp', 'status': 'ok', 'samples_per_s': 5.0},
  ]
  ladder.add_ratios(rows)
  got = {r['name']: (r['x_colocated'], r['x_disagg']) for r in rows}
  assert got == {
      'colocated': (1.0, None),
      'mp2-disagg': (0.8, 1.0),
      'mp2-tag': (1.2, 1.5),
      'mp2-gap': (None, None),
      'sp-tag': (0.5, None),
  }  # sp has no disagg row


@pytest.mark.parametrize(
    'args, match',
    [
        (['--rungs', 'colocated,gapp'], "unknown rung 'gapp'"),
        (['--variants', 'mp3'], "unknown variant 'mp3'"),
        (['--steps', '1'], '--steps=1'),
        (['--tcss_fraction', '0'], '--tcss_fraction=0.0'),
        (['--set', '--config.optim.lrr=1'], 'has no field config.optim.lrr'),
        (['--config', 'configs/nope.py'], 'no such file'),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, match):
  code = ladder.main(['--out', str(tmp_path / 'out'), '--config', TINY_DISAGG, *args])
  err = capsys.readouterr().err
  assert code == 2 and err.startswith('ladder: ') and match in err and err.count('\n') == 1, err
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_short_ladder_one_process(tmp_path, capsys, plots):
  out = tmp_path / 'ladder'  # docs/design.md#measuring: --out FILE.json, the rest under FILE/
  code = ladder.main(
      [
          '--config',
          TINY_DISAGG,
          '--out',
          f'{out}.json',
          '--steps',
          '2',
          '--rungs',
          'colocated,disagg',  # the rungs past disagg are test_ladder_accepts_the_flux_config's
          '--variants',
          'sp',
          '--eval_prompts',
          '2',
          '--timeout_s',
          '300',
      ]
  )
  text = capsys.readouterr().out
  result = json.load(open(f'{out}.json'))
  assert not (out / 'ladder.json').exists()
  rows = {r['name']: r for r in result['rows']}
  assert list(rows) == ['colocated', 'sp-disagg']
  for name in ('colocated', 'sp-disagg'):
    r = rows[name]
    assert r['status'] == 'ok', (name, r['log_tail'])
    assert r['steps'] == 2 and r['samples_per_s'] > 0 and 0 < r['utilization'] <= 1
    assert 0 <= r['eval_strict_accuracy'] <= 1 and r['eval_reward_mean'] is not None
  assert rows['colocated']['layout'] == '1x2' and rows['sp-disagg']['layout'] == '1x2'
  assert rows['colocated']['x_colocated'] == 1.0
  assert rows['sp-disagg']['x_colocated'] == pytest.approx(
      rows['sp-disagg']['samples_per_s'] / rows['colocated']['samples_per_s']
  )
  assert rows['sp-disagg']['x_disagg'] == 1.0 and code == 0
  assert re.search(r'^disagg +sp +1x2 +ok ', text, re.M) and 'x coloc' in text, text
  # docs/design.md#measuring's keys, from the same rows.
  assert result['variant'] == 'sp' and set(result['modes']) == {'colocated', 'disagg'}
  assert result['modes']['disagg']['samples_per_s'] == rows['sp-disagg']['samples_per_s']
  assert result['modes']['colocated']['utilization'] == rows['colocated']['utilization']
  assert result['command'].startswith('python benchmarks/ladder.py --config')
  assert result['machine']['cpu_count'] >= 1
  table = list(csv.DictReader(open(out / 'ladder.csv')))
  assert [r['name'] for r in table] == list(rows)
  for r in result['rows']:  # every timeline a run wrote is copied
    src = os.path.join(r['workdir'], 'timeline.png')
    assert (r['timeline'] is not None) == os.path.isfile(src)
    if r['timeline']:
      assert open(r['timeline'], 'rb').read() == open(src, 'rb').read()
  assert any(r['timeline'] for r in result['rows'])  # the `plots` fixture: runs draw them


@pytest.mark.slow
def test_ladder_accepts_the_flux_config(tmp_path):
  """configs/flux.py on the exact rungs: every run is ok, and the schedules reproduce colocated's
  rewards (same samples, same policy)."""
  out = tmp_path / 'flux'
  code = ladder.main(
      [
          '--config',
          'configs/flux.py:tiny,disagg',
          '--out',
          f'{out}.json',
          '--steps',
          '2',
          '--rungs',
          'colocated,tag',
          '--variants',
          'sp',
          '--eval_prompts',
          '0',
          '--timeout_s',
          '300',
      ]
  )
  rows = {r['name']: r for r in json.load(open(f'{out}.json'))['rows']}
  assert list(rows) == ['colocated', 'sp-tag'] and code == 0
  for name, r in rows.items():
    assert r['status'] == 'ok' and r['steps'] == 2, (name, r['log_tail'])
    # --eval_prompts 0 turns the config's own eval off (the tiny config evaluates every 2 steps).
    assert r['eval_strict_accuracy'] is None and r['eval_reward_mean'] is None, r
  # The naive disagg rung is the same loop as colocated on two meshes (tests/core/runtime/test_disagg.py
  # checks it bitwise for the Qwen-Image config); TAG exercises every schedule component.
  assert rows['sp-tag']['reward_mean'] == rows['colocated']['reward_mean']
