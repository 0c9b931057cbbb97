"""Environments for the processes tests start: a forced CPU device count, and every other XLA flag
of the test session kept (conftest's compile-speed flags above all)."""

from __future__ import annotations

import importlib.metadata
import os

from digen_jax.perf import devices as devices_lib  # imports nothing from jax

# Tests check numbers, not speed: LLVM's optimisation of XLA's CPU code costs half of every
# compile of the suite's tiny programs and buys nothing at their size (a FLUX tiny_pipeline run
# compiles in 10 s instead of 23 s); XLA's newer fusion emitters (MLIR) cost half of what is left
# (configs/qwenimage.py:tiny's gradient program: 5.5 s -> 2.7 s; FLUX tiny's: 7.2 s -> 3.2 s).
# conftest sets them for the session and its subprocesses; tests that time real runs against a
# prediction take them out (production_flags).
# XLA aborts on a flag it does not know: jaxlib 0.11 dropped the fusion-emitter switch (its CPU
# backend has only the emitters), so the suite also runs on newer jax (README "Running on GPUs").
_JAXLIB = tuple(int(x) for x in importlib.metadata.version('jaxlib').split('.')[:2])
COMPILE_FAST_FLAGS = (
    '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true',
) + (('--xla_cpu_use_fusion_emitters=false',) if _JAXLIB < (0, 11) else ())


def production_flags(flags: str) -> str:
  """XLA_FLAGS without the session's compile-speed flags: programs compiled as users run them."""
  return ' '.join(f for f in flags.split() if f not in COMPILE_FAST_FLAGS)


def env_with_devices(devices: int | None, base: dict | None = None, **extra: str) -> dict:
  """A copy of `base` (default os.environ) plus `extra`, with XLA_FLAGS forcing `devices` CPUs."""
  env = {**(os.environ if base is None else base), **extra}
  env['XLA_FLAGS'] = devices_lib.flags_with_device_count(env.get('XLA_FLAGS', ''), devices)
  return env
