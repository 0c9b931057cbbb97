"""ShapesBench's eval metrics beside the reward (rewards/eval_metrics.py): the strict checker's
accuracy, its per-atom rates, and a second, hard-threshold accuracy; registered on import."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from digen_jax.rewards import eval_metrics
from digen_jax.rewards import registry as reward_registry
from digen_jax.tasks.shapes import checker as shapes_checker
from digen_jax.tasks.shapes import grammar


def accepts(prompts: Sequence[str]) -> bool:
  """Whether every prompt is a ShapesBench prompt (parses under the grammar)."""
  try:
    for p in prompts:
      grammar.parse(p)
    return True
  except ValueError:
    return False


def score(images, prompts: list[str], metrics: dict) -> np.ndarray:
  """The strict checker's accuracy (and per-atom rates, and the hard-threshold second path)
  into `metrics`; returns each sample's strict pass. A video passes when every frame does
  (the atom rates count frames)."""
  frames, per = images, 1
  if images.ndim == 5:  # uint8 videos: every frame checked against the prompt
    per = images.shape[1]
    frames = reward_registry.video_frames(images)
    prompts = [p for p in prompts for _ in range(per)]
  checked = shapes_checker.check_all(frames, prompts)
  passed = np.array([r.strict for r in checked], bool).reshape(-1, per).all(axis=1)
  metrics['eval/strict_accuracy'] = float(passed.mean())
  metrics.update(
      {f'eval/atom_{kind}': rate for kind, rate in shapes_checker.atom_rates(checked).items()}
  )
  # A second scoring path that shares none of the reward's margin code (plain thresholds): a
  # policy that games the smoothed reward shows up as a gap between the two accuracies.
  hard = shapes_checker.strict_atoms_all(frames, prompts)
  hard_pass = np.array([all(h.values()) for h in hard], bool).reshape(-1, per).all(axis=1)
  metrics['eval/strict_accuracy_hard'] = float(hard_pass.mean())
  return passed


eval_metrics.register('shapes_bench', accepts, score)
