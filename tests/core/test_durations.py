"""tests/helpers/durations.py: the parallel phase's order from pytest's own figures, a file the
table lacks placed by the stated default, and the table written back from a run's reports."""

import json
import os
import types

import pytest

from tests.helpers import durations
from tests.helpers.paths import REPO


def _item(path):
  return types.SimpleNamespace(path=os.path.join(REPO, path))


def test_longest_file_first_unlisted_after_in_collection_order():
  seconds = {'tests/test_b.py': 5.0, 'tests/sub/test_c.py': 50.0}
  names = ['tests/test_a.py', 'tests/test_b.py', 'tests/sub/test_c.py', 'tests/test_d.py']
  items = [_item(n) for n in names + ['tests/test_b.py']]
  durations.order(items, seconds)
  assert [durations.file_key(i.path) for i in items] == [
      'tests/sub/test_c.py',
      'tests/test_b.py',
      'tests/test_b.py',  # a file's tests stay together, in their order
      'tests/test_a.py',  # unlisted: DEFAULT_SECONDS, after the listed ones
      'tests/test_d.py',
  ]
  assert durations.DEFAULT_SECONDS == 0.0


def test_committed_table_names_existing_test_files():
  table = durations.load()
  assert table, f'{durations.PATH} is empty or missing'
  missing = [k for k in table if not os.path.isfile(os.path.join(REPO, k))]
  assert not missing, f'{missing}: not test files; regenerate with {durations.OPTION}'
  assert all(k.startswith('tests/') and os.path.basename(k).startswith('test_') for k in table)
  assert list(table.values()) == sorted(table.values(), reverse=True)


def test_recorder_merges_a_runs_figures(tmp_path):
  path = str(tmp_path / 'durations.json')
  here = durations.file_key(__file__)
  with open(path, 'w') as f:
    json.dump({'tests/conftest.py': 9.0, 'tests/gone/test_old.py': 3.0, here: 1.0}, f)
  recorder = durations.Recorder(path)
  report = lambda nodeid, seconds, *marks: types.SimpleNamespace(
      nodeid=nodeid, duration=seconds, keywords={m: 1 for m in marks}
  )
  for r in [
      report(f'{here}::test_a', 2.0),
      report(f'{here}::test_a', 0.5),  # its teardown
      report(f'{here}::test_timed', 100.0, 'serial'),  # the serial phase is not ordered
  ]:
    recorder.pytest_runtest_logreport(r)
  recorder.pytest_sessionfinish(None)
  # This run's file replaced, one it did not run kept, a file that no longer exists dropped.
  assert durations.load(path) == {'tests/conftest.py': 9.0, here: 2.5}
  assert list(json.load(open(path))) == ['tests/conftest.py', here]


def test_a_malformed_table_is_one_error_naming_the_fix(tmp_path):
  path = tmp_path / 'durations.json'
  path.write_text('{"tests/test_x.py": "long"}')
  with pytest.raises(ValueError, match=r'durations.json: expected .*--write-durations'):
    durations.load(str(path))
  assert durations.load(str(tmp_path / 'absent.json')) == {}
