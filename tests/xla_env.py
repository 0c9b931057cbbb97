"""Environments for the processes tests start: a forced CPU device count, and every other XLA flag
of the test session kept (conftest's compile-speed flags above all)."""

from __future__ import annotations

import os

DEVICE_COUNT = '--xla_force_host_platform_device_count'


def flags_with_devices(flags: str, devices: int | None) -> str:
  """XLA_FLAGS with any device count replaced by `devices` (None: removed)."""
  kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT)]
  if devices is not None:
    kept.append(f'{DEVICE_COUNT}={devices}')
  return ' '.join(kept)


def env_with_devices(devices: int | None, base: dict | None = None, **extra: str) -> dict:
  """A copy of `base` (default os.environ) plus `extra`, with XLA_FLAGS forcing `devices` CPUs."""
  env = {**(os.environ if base is None else base), **extra}
  env['XLA_FLAGS'] = flags_with_devices(env.get('XLA_FLAGS', ''), devices)
  return env
