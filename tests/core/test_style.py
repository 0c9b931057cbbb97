"""One code style: pyink formats and ruff lints the repository, as configured in
pyproject.toml with the versions pinned in requirements-test.txt. A missing or differently
versioned tool fails here (it does not skip), so CI enforces the style. To fix a failure:
`python -m pyink . && python -m ruff check --fix`."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

FOLDERS = ['digen_jax', 'tests', 'benchmarks', 'launch', 'configs']
TOOLS = ['pyink', 'ruff']


def _pinned(name):
  with open(os.path.join(REPO, 'requirements-test.txt')) as f:
    for line in f:
      m = re.match(rf'{name}==(\S+)', line.strip())
      if m:
        return m.group(1)
  raise AssertionError(f'{name} is not pinned (==) in requirements-test.txt')


@pytest.mark.parametrize('name', TOOLS)
def test_style_tool_is_the_pinned_version(name):
  try:
    installed = importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    raise AssertionError(f'{name} is not installed: pip install -r requirements-test.txt') from None
  assert installed == _pinned(name), (
      f'{name} {installed} is installed, requirements-test.txt pins {_pinned(name)}: another '
      'version may format or lint differently'
  )


def _run(args):
  proc = subprocess.run(
      [sys.executable, '-m', *args, *FOLDERS], cwd=REPO, capture_output=True, text=True, timeout=300
  )
  return proc.returncode, (proc.stdout + proc.stderr).strip()


def test_pyink_formatting():
  rc, out = _run(['pyink', '--check'])
  assert rc == 0, f'pyink --check failed (rc={rc}); run `python -m pyink .`:\n{out}'


def test_ruff_lint():
  rc, out = _run(['ruff', 'check', '--no-cache'])
  assert rc == 0, f'ruff check failed (rc={rc}); run `python -m ruff check --fix`:\n{out}'
