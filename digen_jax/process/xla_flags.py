"""XLA flags a digen_jax process sets before its backend starts.

On GPUs, FSDP's weight all-gathers and gradient reduce-scatters run inside the layer scan of
every program; XLA overlaps them with the layers' compute only when asked: the latency-hiding
scheduler moves the asynchronous collectives beside compute, and the pipelined collectives
prefetch the next layer's gather during the current layer (the while loop double-buffered).
The flags are read by the GPU compiler only (the CPU and TPU compilers ignore them), and a flag
the user already set in XLA_FLAGS keeps the user's value. JAX-Toolbox (NVIDIA's JAX images)
sets the first by default; docs.nvidia.com/jax-toolbox "GPU performance" describes the others.
"""

from __future__ import annotations

import os

OVERLAP = (
    '--xla_gpu_enable_latency_hiding_scheduler=true',
    '--xla_gpu_enable_pipelined_all_gather=true',
    '--xla_gpu_enable_pipelined_reduce_scatter=true',
    '--xla_gpu_enable_while_loop_double_buffering=true',
)


def with_overlap(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) with every OVERLAP flag it does not set already."""
  words = flags.split()
  named = {w.split('=', 1)[0] for w in words}
  return ' '.join(words + [f for f in OVERLAP if f.split('=', 1)[0] not in named])


def install() -> None:
  """Adds the overlap flags to this process's XLA_FLAGS (before any JAX backend starts)."""
  os.environ['XLA_FLAGS'] = with_overlap(os.environ.get('XLA_FLAGS', ''))
