"""Faults that stop a run with one line saying what went wrong and what to do.

The entry points (main, eval) print a RunError's message as their last line and exit non-zero;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class RunError(RuntimeError):
  """A run-stopping fault whose message is complete: what happened, where, and the fix."""


class CheckpointError(RunError):
  """No checkpoint can be read, or one cannot be written."""


class NonFiniteError(RunError):
  """Too many consecutive updates skipped for NaN/inf rewards, advantages, loss or gradient."""


def short(e: BaseException, limit: int = 300) -> str:
  """An exception as one line of at most `limit` characters (tensorstore's are pages long)."""
  text = ' '.join(str(e).split()) or type(e).__name__
  return text if len(text) <= limit else text[: limit - 3] + '...'
