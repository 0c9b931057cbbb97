"""Test session setup: fake several CPU devices before JAX is imported anywhere, and one JAX
compilation cache for the whole session (the tests and every process they start), so the same
tiny program is compiled once per session instead of once per test and process."""

import atexit
import os
import shutil
import tempfile

from tests import xla_env  # imports nothing from jax

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=4",
        *xla_env.COMPILE_FAST_FLAGS,
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "DIGEN_COMPILATION_CACHE" not in os.environ:  # a cold cache per session, never ~/.cache
  _cache = tempfile.mkdtemp(prefix="digen_test_jax_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["DIGEN_COMPILATION_CACHE"] = _cache  # the CLIs' compile_cache.enable()
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache  # in-process programs and library subprocesses
  # Every program, however small: each process of the suite would otherwise recompile its few
  # dozen sub-0.5 s programs (about 1 s a process).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
