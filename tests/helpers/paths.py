"""The repository's folders, for tests at any depth under tests/: a test file names files by
these, never by its own place (dirname(dirname(__file__)) breaks once the file moves)."""

import os

# This file stays at tests/helpers/paths.py: two levels below the repository root.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


def repo_path(*parts: str) -> str:
  """The absolute path of `parts` under the repository root."""
  return os.path.join(REPO, *parts)
