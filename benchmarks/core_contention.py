"""Do two XLA programs on two different cores slow each other down?

  python benchmarks/core_contention.py [--seconds=20] [--json OUT.json]

The simulator (perf/engine.py) times each program alone, on its pinned core, and assumes a program
runs as fast when the other role's core is busy. Where that is false (shared L3, memory bandwidth,
a hypervisor's sibling threads) the pipelined rungs, which keep both cores busy, are predicted too
fast: the balanced scenario's +15-20 % on TSP/TAG/TCSS (benchmarks/RESULTS.md). This measures it
directly for two workloads, each in one process pinned to one core:

  * matmul: the gradient of a 3-layer MLP on [256, 64, 128] activations (weights and activations
    fit in a core's L2: compute-bound, like the ShapesBench MMDiT's programs);
  * stream: a scaled add over two 64 MB float32 arrays (memory-bandwidth-bound).

For each: the median seconds per call on core 0 alone, core 1 alone, then both cores at once
(each process running the same workload), and the slowdown together / alone per core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ('matmul', 'stream')


def run_child(workload: str, core: int, seconds: float, start_at: float) -> dict:
  """Times `workload` on `core` for `seconds`, starting at wall time `start_at`."""
  os.sched_setaffinity(0, {core})
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  key = jax.random.PRNGKey(core)
  if workload == 'matmul':
    ws = [jax.random.normal(k, (128, 128)) * 0.1 for k in jax.random.split(key, 3)]
    x = jax.random.normal(key, (256, 64, 128))

    def loss(ws, x):
      for w in ws:
        x = jax.nn.gelu(x @ w)
      return jnp.mean(x**2)

    fn = jax.jit(jax.grad(loss))
    args = (ws, x)
  elif workload == 'stream':
    a = jnp.ones((16 * 1024 * 1024,), jnp.float32)
    b = jnp.full((16 * 1024 * 1024,), 2.0, jnp.float32)
    fn = jax.jit(lambda a, b: a * 1.0001 + b)
    args = (a, b)
  else:
    raise ValueError(f'workload={workload!r} must be one of {WORKLOADS}')
  jax.block_until_ready(fn(*args))  # compile
  while time.time() < start_at:
    time.sleep(0.001)
  times, end = [], time.time() + seconds
  while time.time() < end:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return {'core': core, 'calls': len(times), 'median_s': statistics.median(times)}


def _spawn(workload: str, cores: list[int], seconds: float) -> list[dict]:
  """Runs one child per core at once (same start time); returns their results."""
  start_at = time.time() + 15.0  # after every child has imported jax and compiled
  procs = [
      subprocess.Popen(
          [sys.executable, __file__, '--child', workload, str(c), str(seconds), str(start_at)],
          stdout=subprocess.PIPE,
          env=dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1'),
      )
      for c in cores
  ]
  results = []
  for p in procs:
    stdout, _ = p.communicate()
    if p.returncode:
      raise RuntimeError(f'core_contention child exited with {p.returncode}')
    results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
  return results


def measure(seconds: float) -> dict:
  """{workload: {'alone_s': {core: s}, 'together_s': {core: s}, 'slowdown': {core: ratio}}}."""
  if len(os.sched_getaffinity(0)) < 2:
    raise RuntimeError('core_contention needs two cores (cores 0 and 1)')
  out = {}
  for workload in WORKLOADS:
    alone = {r['core']: r['median_s'] for c in (0, 1) for r in _spawn(workload, [c], seconds)}
    together = {r['core']: r['median_s'] for r in _spawn(workload, [0, 1], seconds)}
    out[workload] = {
        'alone_s': alone,
        'together_s': together,
        'slowdown': {c: together[c] / alone[c] for c in (0, 1)},
    }
  return out


def main() -> None:
  if len(sys.argv) == 6 and sys.argv[1] == '--child':
    _, _, workload, core, seconds, start_at = sys.argv
    print(json.dumps(run_child(workload, int(core), float(seconds), float(start_at))))
    return
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--seconds', type=float, default=20.0, help='timed seconds per measurement')
  ap.add_argument('--json', help='also write the result here')
  args = ap.parse_args()
  result = measure(args.seconds)
  for workload, r in result.items():
    print(
        f"{workload:7s} alone {r['alone_s'][0] * 1e3:.2f} / {r['alone_s'][1] * 1e3:.2f} ms, "
        f"together {r['together_s'][0] * 1e3:.2f} / {r['together_s'][1] * 1e3:.2f} ms: "
        f"slowdown {r['slowdown'][0]:.3f} / {r['slowdown'][1]:.3f} (core 0 / core 1)"
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  main()
