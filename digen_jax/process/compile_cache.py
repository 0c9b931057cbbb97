"""JAX's persistent compilation cache, so a restarted run does not recompile its programs.

JAX writes entries from process 0 only (jax/_src/compiler.py, _cache_write): in a disaggregated
run of several processes the other processes' programs (the rollout's) compile again on every
restart (measured: benchmarks/sim_validation.py's ladder runs recompile the rollout process's
programs that its profile had compiled minutes before)."""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser('~'), '.cache', 'digen_jax', 'jax_cache')


def enable(directory: str | None = None) -> str:
  """Turns the cache on (DIGEN_COMPILATION_CACHE overrides the folder; '0' disables it)."""
  directory = directory or os.environ.get('DIGEN_COMPILATION_CACHE', DEFAULT_DIR)
  if directory == '0':
    jax.config.update(
        'jax_enable_compilation_cache', False
    )  # also when JAX_COMPILATION_CACHE_DIR is set
    return ''
  os.makedirs(directory, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', directory)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:  # the caller's choice wins
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return directory
