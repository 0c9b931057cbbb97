"""The XLA flags a digen_jax process sets (process/xla_flags.py): FSDP's collectives overlapped
with compute on GPUs, the user's own XLA_FLAGS winning."""

import subprocess
import sys

from digen_jax.process import xla_flags


def test_overlap_flags_are_added_once_and_the_users_value_wins():
  out = xla_flags.with_overlap('--xla_force_host_platform_device_count=4')
  assert out.split()[0] == '--xla_force_host_platform_device_count=4'
  assert all(f in out.split() for f in xla_flags.OVERLAP)
  assert xla_flags.with_overlap(out) == out
  mine = xla_flags.with_overlap('--xla_gpu_enable_latency_hiding_scheduler=false')
  assert '--xla_gpu_enable_latency_hiding_scheduler=false' in mine.split()
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' not in mine.split()


def test_every_flag_is_known_to_this_xla():
  """An unknown flag aborts the process when the backend starts: each must parse here (the
  CPU backend reads the GPU compiler's flags and ignores them)."""
  code = 'import jax; print(float(jax.numpy.ones(3).sum()))'
  env = {'XLA_FLAGS': ' '.join(xla_flags.OVERLAP), 'JAX_PLATFORMS': 'cpu', 'PATH': ''}
  r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
  assert r.returncode == 0 and r.stdout.strip() == '3.0', r.stderr[-2000:]
