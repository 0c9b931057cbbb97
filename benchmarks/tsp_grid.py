"""The fragment gradient under 2-D time-step parallelism against the 1-D layout it replaced and
against no TSP: program-level timing on N fake CPU devices.

    python benchmarks/tsp_grid.py --devices=8 --cases=5x8,3x8,5x4,5x2 --json=/tmp/tsp_grid.json
    python benchmarks/tsp_grid.py --config=configs/qwenimage.py:tiny --devices=8 --repeats=7

Per case KxB (K trained steps: all but the last of 6 sampling steps for K = 5, else a fixed
window; B samples in the fragment) and layout:

  tsp_auto  programs.make_fragment_grad(tsp=True), the steps axis t chosen by
            parallel/tsp_grid.choose (the least per-device work, ties to the larger t)
  tsp_1d    the same program with t forced to N: the timestep axis alone over the mesh, K
            padded to a multiple of N (the layout before the 2-D grid)
  no_tsp    make_fragment_grad(tsp=False): rl.step_loop over K (vmap on several devices), the
            batch sharded over the mesh

The fragment reaches each program as the runtime gives it: B rows padded to a multiple of N with
weight-0 rows. Reported: the layout (K_pad, t, b), sample-steps per device and in all (what N
real devices would each run, and what this machine's cores share), the compile seconds, the
median of --repeats calls (after one warm call), and the collectives in the compiled program
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute: ops in XLA's optimised
HLO text, a loop body counted once). The programs compile with XLA's default flags (none of the
test suite's compile-speed flags). On a CPU the N fake devices share the host's cores, so the
time follows the total work more than the per-device work.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from digen_jax.perf import devices as devices_lib  # pylint: disable=g-import-not-at-top  (no jax)

if __name__ == '__main__':
  devices_lib.force_host_devices(sys.argv[1:])  # before anything imports jax

# pylint: disable=g-import-not-at-top,wrong-import-position  (after force_host_devices)
from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

from digen_jax import programs
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.parallel import mesh as mesh_lib
import digen_jax.tasks  # noqa: F401  (registers the tasks: the config's prompt set and reward)

# pylint: enable=g-import-not-at-top,wrong-import-position

CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(REPO, 'configs', 'qwenimage.py') + ':tiny', 'Config file[:variant].'
)
DEVICES = flags.DEFINE_integer('devices', 8, 'N: fake CPU devices, the trainer mesh.')
CASES = flags.DEFINE_list('cases', ['5x8', '3x8', '5x4', '5x2'], 'KxB cases.')
LAYOUTS = flags.DEFINE_list('layouts', ['tsp_1d', 'tsp_auto', 'no_tsp'], 'Layouts to time.')
REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed calls per program (median reported).')
JSON = flags.DEFINE_string('json', '', 'Write the rows here too.')

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')


def case_config(base, K: int, B: int, layout: str, n: int):
  """The config of one case: K trained steps, a one-fragment batch of B samples, the layout."""
  steps = int(base.sampler.num_steps)
  over = {
      'rl.prompts_per_step': B // 2 if B % 2 == 0 else 1,
      'rl.group_size': 2 if B % 2 == 0 else B,
      'schedule.tsp': layout != 'no_tsp',
      'schedule.tsp_steps_axis': n if layout == 'tsp_1d' else 0,
  }
  if K != steps - 1:
    over.update({'rl.timesteps': 'fixed_window', 'rl.window_start': 0, 'rl.window_size': K})
  return configlib.apply_overrides(copy.deepcopy(base), over)


def fragment(exp, mesh, B: int):
  """A fragment of B samples padded to the mesh (weight-0 rows), laid out as the trainer's."""
  n = mesh.devices.size
  rows = -(-B // n) * n
  rng = np.random.default_rng(0)
  traj = programs.abstract_trajectory(exp, rows)
  T = traj.log_probs.shape[0]
  host = traj.replace(
      latents=rng.standard_normal(traj.latents.shape).astype(np.float32),
      log_probs=np.zeros(traj.log_probs.shape, np.float32),
      sigmas=np.asarray(exp.sigmas, np.float32),
      sde_steps=np.ones((T,), bool),
      stds=np.full(traj.stds.shape, 0.1, np.float32),
  )
  cond = {
      k: np.ones(s.shape, s.dtype) if k == 'text_mask' else np.zeros(s.shape, s.dtype)
      for k, s in exp.cond_abstract(rows).items()
  }
  data = mesh_lib.batch_sharding(mesh, 1)
  adv = rng.standard_normal(rows).astype(np.float32) * (np.arange(rows) < B)
  return (
      jax.device_put(host, programs.trajectory_shardings(mesh)),
      jax.device_put(cond, programs.cond_shardings(mesh, cond)),
      jax.device_put(adv, data),
      jax.device_put(np.arange(rows) < B, data),
  )


def collectives(hlo: str) -> dict:
  return {c: len(re.findall(rf'= [^=]*? {c}(-start)?\(', hlo)) for c in COLLECTIVES}


def build(base, K: int, B: int, layout: str, devices, workdir: str) -> dict:
  """One layout's compiled fragment gradient, its arguments and its shape figures."""
  n = len(devices)
  mesh = mesh_lib.make_mesh(devices)
  config = case_config(base, K, B, layout, n)
  exp = experiment.build(case_config(base, K, B, 'no_tsp', n), workdir, 1)
  exp = experiment.respec(exp, config)
  psh = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = jax.device_put(exp.params, psh)
  traj, cond, adv, valid = fragment(exp, mesh, B)
  rep = mesh_lib.replicated(mesh)
  indices = programs.make_select(exp, mesh)(jax.device_put(jax.random.key(0), rep), np.int32(0))
  zero = programs.make_zero_acc(psh, mesh)
  tsp = layout != 'no_tsp'
  grad = programs.make_fragment_grad(
      exp, mesh, psh, programs.trajectory_shardings(mesh), tsp=tsp, samples=B
  )
  args = lambda: (params, zero(params), traj, cond, cond, adv, valid, indices, None, None)
  t0 = time.perf_counter()
  compiled = grad.lower(*args()).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args()))  # warm
  rows = traj.log_probs.shape[1]
  if tsp:
    lay = programs.tsp.layout(exp, mesh, B)
    shape = dict(K_pad=lay.K_pad, t=lay.t, b=lay.b, per_device=lay.work)
  else:
    shape = dict(K_pad=K, t=1, b=n, per_device=K * rows // n)
  row = dict(K=K, B=B, layout=layout, **shape, total=shape['per_device'] * n)
  row.update(compile_s=round(compile_s, 2), collectives=collectives(compiled.program.as_text()))
  return dict(row=row, program=compiled, args=args)


def time_round_robin(built: list[dict]) -> None:
  """--repeats calls of each program, interleaved (a shared host's load hits all alike): wall
  and process CPU seconds (every thread: what the fake devices cost the cores), medians."""
  wall = [[] for _ in built]
  cpu = [[] for _ in built]
  for _ in range(REPEATS.value):
    for i, b in enumerate(built):
      a = b['args']()
      jax.block_until_ready(a)
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(b['program'](*a))
      wall[i].append(time.perf_counter() - t0)
      cpu[i].append(time.process_time() - c0)
  for b, w, c in zip(built, wall, cpu):
    b['row'].update(
        median_s=round(statistics.median(w), 4),
        cpu_median_s=round(statistics.median(c), 4),
        times_s=[round(t, 4) for t in w],
    )


def main(argv):
  del argv
  devices = jax.devices()[: DEVICES.value]
  rows = []
  print('| K x B | layout | K_pad | t x b | sample-steps/device | in all | median s | CPU s | '
        'x tsp_1d (CPU) | all-gathers |')  # fmt: skip
  print('|---|---|---|---|---|---|---|---|---|---|')
  with tempfile.TemporaryDirectory() as workdir:
    for case in CASES.value:
      K, B = (int(x) for x in case.split('x'))
      built = [build(CONFIG.value, K, B, lay, devices, workdir) for lay in LAYOUTS.value]
      time_round_robin(built)
      ref = next((b['row'] for b in built if b['row']['layout'] == 'tsp_1d'), None)
      for b in built:
        r = b['row']
        rows.append(r)
        ratio = f"{ref['cpu_median_s'] / r['cpu_median_s']:.2f}" if ref else ''
        print(
            f"| {K} x {B} | {r['layout']} | {r['K_pad']} | {r['t']} x {r['b']} | "
            f"{r['per_device']} | {r['total']} | {r['median_s']:.4f} | {r['cpu_median_s']:.4f} | "
            f"{ratio} | {r['collectives']['all-gather']} |",
            flush=True,
        )
  out = dict(
      machine=f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
      command=' '.join(['python', *sys.argv]),
      date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
      devices=len(devices),
      jax=jax.__version__,
      rows=rows,
  )
  if JSON.value:
    with open(JSON.value, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  app.run(main)
