"""Each test file's seconds in tests/run.py's parallel phase, as pytest measured them, so the
workers get the longest files first and the many short ones fill the end (with xdist's default
order a long file could start last and run on one worker while the other sat idle).

tests/durations.json maps repository-relative file paths to seconds (setup + call + teardown of
the file's tests that are not marked `serial`, summed). `python tests/run.py --write-durations`
rewrites the figures of the files that ran; see docs/testing.md. Stale or missing figures cost
balance, never a test.
"""

from __future__ import annotations

import collections
import json
import os

from tests.helpers.paths import REPO, TESTS

PATH = os.path.join(TESTS, 'durations.json')
# A file missing from the table (a new one) counts as this many seconds: after every listed
# file, in collection order. The next --write-durations run gives it its real place.
DEFAULT_SECONDS = 0.0
OPTION = '--write-durations'


def load(path: str = PATH) -> dict[str, float]:
  """{repo-relative path: seconds}; {} when there is no file."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    table = json.load(f)
  if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
    raise ValueError(
        f'{path}: expected {{"tests/test_x.py": seconds, ...}}; regenerate it with '
        f'`python tests/run.py {OPTION}`'
    )
  return {str(k): float(v) for k, v in table.items()}


def file_key(path) -> str:
  """The table's key of a test file: its path under the repository root, with '/'."""
  return os.path.relpath(os.fspath(path), REPO).replace(os.sep, '/')


def order(items: list, seconds: dict[str, float]) -> None:
  """Sorts pytest items longest file first, in place; stable, so a file's tests keep their
  order (its module fixtures are built once) and equal files keep collection order."""
  items.sort(key=lambda item: -seconds.get(file_key(item.path), DEFAULT_SECONDS))


def merged(old: dict[str, float], new: dict[str, float]) -> dict[str, float]:
  """`old` with `new`'s files replaced, files gone from the repository dropped; longest first
  (so the committed file reads as the order it gives)."""
  table = {**old, **new}
  table = {k: v for k, v in table.items() if os.path.exists(os.path.join(REPO, k))}
  return dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))


class Recorder:
  """A pytest plugin summing each file's report durations (in xdist's controller the workers'
  reports arrive here too) and merging them into the table at the session's end."""

  def __init__(self, path: str = PATH):
    self.path = path
    self.seconds: dict[str, float] = collections.defaultdict(float)

  def pytest_runtest_logreport(self, report):
    if 'serial' in report.keywords:  # run alone in the second phase: not ordered
      return
    self.seconds[report.nodeid.split('::')[0]] += report.duration

  def pytest_sessionfinish(self, session):
    del session
    if not self.seconds:
      return
    new = {k: round(v, 1) for k, v in self.seconds.items()}
    table = merged(load(self.path), new)
    with open(self.path, 'w') as f:
      json.dump(table, f, indent=1)
      f.write('\n')
