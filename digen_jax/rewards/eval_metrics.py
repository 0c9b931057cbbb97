"""Evaluation metrics that tasks provide beside the reward: e.g. ShapesBench's strict accuracy.

A task registers its metrics with `register(name, accepts, score)`:

    accepts(prompts: list[str]) -> bool: whether these eval prompts are the task's (all of them)
    score(images, prompts: list[str], metrics: dict) -> passed [N] bool or None: adds the task's
        figures to `metrics` ('eval/<figure>' -> float) and returns each sample's pass

images are the evaluator's samples: [N, H, W, 3] float32 in [-1, 1] or uint8 videos
[N, F, H, W, 3]; prompts has one entry per sample. The evaluator (experiment/evaluation.py) asks
`for_prompts(prompts)` once and runs what it returns: no task is named in the evaluator itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class EvalMetrics:
  name: str
  accepts: Callable[[Sequence[str]], bool]
  score: Callable[[np.ndarray, list[str], dict], np.ndarray | None]


_REGISTRY: dict[str, EvalMetrics] = {}


def register(
    name: str,
    accepts: Callable[[Sequence[str]], bool],
    score: Callable[[np.ndarray, list[str], dict], np.ndarray | None],
) -> EvalMetrics:
  """Adds a task's eval metrics (module docstring); registering a name again replaces it."""
  if not isinstance(name, str) or not name:
    raise ValueError(f'eval metrics need a non-empty name; got {name!r}')
  _REGISTRY[name] = EvalMetrics(name, accepts, score)
  return _REGISTRY[name]


def registered_names() -> list[str]:
  return sorted(_REGISTRY)


def for_prompts(prompts: Sequence[str]) -> EvalMetrics | None:
  """The registered metrics whose task these prompts are, or None (the reward alone). Two that
  both accept the prompts are a ValueError naming them: which one's `passed` counts is unclear."""
  found = [m for m in _REGISTRY.values() if m.accepts(list(prompts))]
  if len(found) > 1:
    raise ValueError(
        f'the eval prompts are the task of several registered eval metrics '
        f'{sorted(m.name for m in found)}; make their accepts() disjoint'
    )
  return found[0] if found else None
