"""Rewards for tests/core/rewards/test_reward_workers.py, loaded in reward worker processes through
config.reward.callables (uint8 images [B, H, W, 3], prompts) -> [B]. Each misbehaves on the
prompts that ask it to; 'once' faults happen the first time only (a marker file in the folder
the prompt names after '@')."""

import os
import time

import numpy as np


def _once(prompt: str) -> bool:
  """True the first time a prompt '... @/folder' is seen (then the folder holds a marker)."""
  folder = prompt.rpartition('@')[2]
  marker = os.path.join(folder, 'seen')
  if os.path.exists(marker):
    return False
  open(marker, 'w').close()
  return True


def brightness(images, prompts):
  del prompts
  return np.asarray(images, np.float32).mean(axis=(1, 2, 3)) / 255.0


def fragile(images, prompts):
  out = brightness(images, prompts)
  for i, p in enumerate(prompts):
    if 'raise' in p:
      raise KeyError(f'cannot score {p!r}')
    if 'nan' in p:
      out[i] = np.nan
  return out


def slow(images, prompts):
  time.sleep(0.25 * len(prompts))
  return brightness(images, prompts)


def hang_once(images, prompts):
  if any('hang' in p and _once(p) for p in prompts):
    time.sleep(600)
  return brightness(images, prompts)


def crash_once(images, prompts):
  if any('crash' in p and _once(p) for p in prompts):
    os._exit(3)
  return brightness(images, prompts)


def always_crash(images, prompts):
  del images, prompts
  os._exit(3)


def wrong_shape(images, prompts):
  return np.zeros(len(prompts) + 1, np.float32)


def batch_len(images, prompts):
  """Each sample scores the size of the batch it came in (the pool's batching, seen)."""
  del images
  return np.full(len(prompts), len(prompts), np.float32)


def pid(images, prompts):
  """Each sample scores the id of the process that scored it (which worker; float32 holds
  Linux pids exactly: pid_max <= 2**22)."""
  del images
  return np.full(len(prompts), os.getpid(), np.float32)


def crash_unless_grey(images, prompts):
  """Scores the build's probe batch (uniform grey images), then dies on every real batch."""
  if np.any(np.asarray(images) != np.asarray(images).flat[0]):
    os._exit(3)
  return brightness(images, prompts)
