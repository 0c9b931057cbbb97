"""The test suite as CI runs it (README "Run the tests"), in two phases:

  python tests/run.py [PYTEST ARGS...]        e.g. -x, -k ladder, -m 'not slow'

1. every test not marked `serial`, on DIGEN_TEST_WORKERS pytest-xdist workers (default 2, one
   per core here; --dist loadfile, so a module's fixtures are built once; the files in
   conftest's order, the longest first by tests/durations.json, so both workers finish
   together; --write-durations updates that file from this run's figures);
2. the `serial` tests alone on the machine: they measure throughput (tests/perf/test_sim_validation.py
   compares the simulator with timed runs) and another test beside them would skew the timing.
   Unless the arguments name test paths, only the files that mark a test serial are collected
   (serial_files: a text scan of tests/ and its subfolders; collecting the whole suite imports torch and more, ~18 s here);
   conftest checks in every full collection that the scan finds every serial test.

Exit code: the first failing phase's; 5 (no tests collected) only when neither phase ran a test.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

# The command is `python tests/run.py`: this file stays at the top of tests/, and as a script it
# cannot import tests.helpers.paths before it knows the root.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERIAL_MARK = 'pytest.mark.serial'
NO_TESTS = 5


def serial_files() -> list[str]:
  """The test files (repo-relative, in tests/ at any depth) whose text marks a test serial."""
  found = []
  for path in sorted(glob.glob(os.path.join(REPO, 'tests', '**', 'test_*.py'), recursive=True)):
    with open(path) as f:
      if SERIAL_MARK in f.read():
        found.append(os.path.relpath(path, REPO))
  return found


def _names_paths(args: list[str]) -> bool:
  """Whether the pytest arguments select test files or directories themselves."""
  return any(
      not a.startswith('-') and os.path.exists(os.path.join(REPO, a.split('::')[0])) for a in args
  )


def _split_marker(args: list[str]) -> tuple[list[str], str | None]:
  """(args without -m EXPR, EXPR or None)."""
  rest, expr, i = [], None, 0
  while i < len(args):
    a = args[i]
    if a == '-m' and i + 1 < len(args):
      expr, i = args[i + 1], i + 2
      continue
    if a.startswith('-m') and len(a) > 2:
      expr = a[2:]
    else:
      rest.append(a)
    i += 1
  return rest, expr


def _and(expr: str | None, extra: str) -> str:
  return extra if expr is None else f'({expr}) and {extra}'


def main(argv: list[str]) -> int:
  args, expr = _split_marker(argv)
  workers = os.environ.get('DIGEN_TEST_WORKERS', '2')
  pytest = [sys.executable, '-m', 'pytest']
  phases = [
      [
          *pytest,
          '-n',
          workers,
          '--dist',
          'loadfile',
          '--no-loadscope-reorder',
          '-m',
          _and(expr, 'not serial'),
          *args,
      ],
      [
          *pytest,
          '-m',
          _and(expr, 'serial'),
          *([] if _names_paths(args) else serial_files()),
          *args,
      ],
  ]
  # Bytecode caching on, whatever the caller's PYTHONDONTWRITEBYTECODE: the suite starts a few
  # hundred interpreters that import the package (and each worker rewrites every test module's
  # asserts); without the caches each compiles it all again (~0.3 s a process, ~3.5 s a
  # collection, here). The caches are __pycache__ folders, ignored by git.
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONDONTWRITEBYTECODE'}
  codes = []
  for cmd in phases:
    print('tests/run.py:', ' '.join(cmd[1:]), flush=True)
    codes.append(subprocess.call(cmd, cwd=REPO, env=env))
  failed = [c for c in codes if c not in (0, NO_TESTS)]
  if failed:
    return failed[0]
  return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
