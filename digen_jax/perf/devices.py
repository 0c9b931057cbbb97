"""Fake host devices for ahead-of-time analysis. Imports nothing from jax: XLA reads
--xla_force_host_platform_device_count once, when the CPU backend starts, so a command line must
set it before anything touches a device (in practice: before jax is imported)."""

from __future__ import annotations

import os
import re
from typing import Sequence


def devices_flag(argv: Sequence[str]) -> int | None:
  """N from `--devices=N` or `--devices N` in argv, or None when absent or not a positive int
  (absl then reports the bad flag)."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith('--devices='):
      value = arg.split('=', 1)[1]
    elif arg == '--devices' and i + 1 < len(argv):
      value = argv[i + 1]
  if value is None or not value.isdigit() or int(value) < 1:
    return None
  return int(value)


def flags_with_device_count(flags: str, n: int | None) -> str:
  """XLA_FLAGS `flags` with any forced host device count replaced by n (None: removed); every
  other flag kept."""
  kept = re.sub(r'--xla_force_host_platform_device_count=\S+', '', flags).split()
  return ' '.join(kept + ([] if n is None else [f'--xla_force_host_platform_device_count={n}']))


def force_host_devices(argv: Sequence[str]) -> None:
  """Sets XLA_FLAGS (replacing any device count already there) and JAX_PLATFORMS=cpu so that jax
  sees `--devices` CPU devices. Call before jax is imported."""
  n = devices_flag(argv)
  if n is None:
    return
  os.environ['XLA_FLAGS'] = flags_with_device_count(os.environ.get('XLA_FLAGS', ''), n)
  os.environ['JAX_PLATFORMS'] = 'cpu'
