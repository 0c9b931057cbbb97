"""What the schedule tests read from a run: its parameters as arrays, its training rows, and a
reward made slower so that BTS has bubbles to fill."""

import dataclasses
import json
import os
import time

import jax
import numpy as np


def leaves(tree) -> list[np.ndarray]:
  """A tree's leaves on the host, in tree order."""
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def train_rows(workdir) -> list[dict]:
  """metrics.jsonl's training rows (those with a reward_mean), in order."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if 'reward_mean' in r]


def slow_reward(exp, seconds: float):
  """`exp` whose reward sleeps `seconds` a call: sampling a fragment becomes slower than training
  one, so BTS has bubbles to fill."""
  fn = exp.reward_fn

  def slow(images, prompts):
    time.sleep(seconds)
    return fn(images, prompts)

  return dataclasses.replace(exp, reward_fn=slow)
