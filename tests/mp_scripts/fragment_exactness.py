"""A fragment's update on n devices against the colocated update of the same batch on one device
(tests/core/parallel/test_tsp_grid.py, tests/core/experiment/test_uneven_fragments.py). Run as a script under a forced CPU
device count:

  python -m tests.mp_scripts.fragment_exactness N '[{"K": 5, "B": 4}, ...]'

prints one line 'RESULT {json}' per case: the TSP layout and the largest differences (gradient,
loss, pair weight, params and Adam moments after the optimizer step, grad norm). Importable:
`run_case(case, devices)` does one case in this process.

A case: K trained steps (configs/qwenimage.py:tiny, 6 sampling steps: K = 5 trains all but the
last, smaller K a fixed window), B samples (prompts_per_step x group 2; odd B: group B), the
program on the n devices (`program`: 'tsp', the default: the TSP fragment gradient, `t` forcing
its steps axis, 0 auto; 'grad': the fragment gradient without TSP; then the optimizer step
(make_apply); 'update': the fused update). The batch reaches the n-device program padded to a
multiple of n with weight-0 rows (valid False, advantage 0, copies of a sample), as the
runtime pads a fragment (experiment/fragments.py).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from configs import qwenimage
from digen_jax import programs
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.rl import objective
import digen_jax.tasks  # noqa: F401  (registers the config's prompt set and reward)

# The n-device program sums the K x B pairs in another order (and the model's matmuls see
# another batch shape) than the one-device program: measured |dgrad| / max|grad| <= 7e-7, loss
# 1.2e-7, Adam moments <= 7e-7 of the largest, params after one Adam step (moving them by 1e-4)
# <= 2.2e-6 (Adam divides each entry by its own magnitude, so the tiniest gradient entries move
# as much as the largest and carry their rounding into the step).
GRAD_RTOL = 1e-5  # of the largest |gradient| entry
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-6  # 5 % of the step's move (lr 1e-4)
MOMENT_RTOL = 1e-5  # of the largest moment
GRAD_NORM_RTOL = 1e-5


def check(r: dict) -> None:
  """AssertionError unless one case's differences (run_case) are within the tolerances."""
  assert r['weight_sum'][0] == r['weight_sum'][1] > 0, r
  assert r['loss_rel'] <= LOSS_RTOL, r
  assert r['grad_rel'] is None or r['grad_rel'] <= GRAD_RTOL, r
  assert r['moved'] > 15 * PARAM_ATOL, 'the step is too small for the tolerance to mean much'
  assert r['params_abs'] <= PARAM_ATOL, r
  assert r['moments_rel'] <= MOMENT_RTOL, r
  gn, ref = r['grad_norm']
  assert abs(gn - ref) <= GRAD_NORM_RTOL * ref, r


def _config(K: int, B: int, t: int):
  group = 2 if B % 2 == 0 else B
  over = {
      'rl.prompts_per_step': B // group,
      'rl.group_size': group,
      'schedule.tsp': True,
      'schedule.tsp_steps_axis': t,
  }
  if K != 5:
    over.update({'rl.timesteps': 'fixed_window', 'rl.window_start': 1, 'rl.window_size': K})
  return configlib.apply_overrides(qwenimage.get_config('tiny'), over)


def _pad_rows(tree, rows: int, axis: int = 0):
  """Host arrays with row 0 repeated up to `rows` rows along `axis`."""

  def pad(a):
    a = np.asarray(a)
    extra = np.repeat(np.take(a, [0], axis=axis), rows - a.shape[axis], axis=axis)
    return np.concatenate([a, extra], axis=axis)

  return jax.tree.map(pad, tree)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _max_rel(xs, ys) -> float:
  """max |x - y| over every leaf, relative to the largest |y| of all leaves."""
  scale = max(float(np.abs(y).max()) for y in ys if y.size)
  return max(float(np.abs(x - y).max()) for x, y in zip(xs, ys) if y.size) / scale


def _reference(exp, traj, cond, adv, valid, key, step):
  """The colocated update of the B samples on one device (the fused program) and the serial
  gradient of sum(w * l) (per-step scan)."""
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  psh = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = jax.device_put(jax.device_get(exp.params), psh)  # a copy: the updates donate
  opt_sh = mesh_lib.fsdp_shardings(jax.eval_shape(exp.optimizer.init, params), mesh)
  opt = jax.jit(exp.optimizer.init, out_shardings=opt_sh)(params)
  indices = programs.make_select(exp, mesh)(key, step)
  velocity_fn = programs.velocity_fn_of(exp)
  traj, cond, adv, valid = jax.device_put((traj, cond, adv, valid), mesh_lib.replicated(mesh))

  def serial(p, traj, cond, adv, valid):
    return objective.grpo_objective(
        velocity_fn,
        p,
        traj,
        cond,
        adv,
        valid,
        indices,
        sde_cfg=exp.sde_cfg,
        clip_range=exp.rl.clip_range,
        step_loop='scan',
        denominator=1.0,
    )

  (loss, m), grads = jax.jit(jax.value_and_grad(serial, has_aux=True))(
      params, traj, cond, adv, valid
  )
  update = programs.make_update(exp, mesh, psh, opt_sh)
  new_p, new_o, metrics = update(params, opt, traj, cond, cond, adv, valid, key, step, None)
  return dict(loss=loss, weight_sum=m['weight_sum'], grads=grads), (new_p, new_o, metrics)


def _on_devices(exp, devices, program, traj, cond, adv, valid, key, step, B):
  """`program` (module docstring) on `devices`, the batch padded to them: (the accumulated
  metric sums and gradient, or None for the fused update; (params, opt_state, metrics))."""
  mesh = mesh_lib.make_mesh(devices)
  n = len(devices)
  rows = -(-B // n) * n
  traj, cond = _pad_rows(traj, rows, 1), _pad_rows(cond, rows)
  traj = traj.replace(sigmas=traj.sigmas[:, 0], sde_steps=traj.sde_steps[:, 0])
  adv = np.concatenate([adv, np.zeros(rows - B, np.float32)])
  valid = np.concatenate([valid, np.zeros(rows - B, bool)])
  data = mesh_lib.batch_sharding(mesh, 1)
  traj = jax.device_put(traj, programs.trajectory_shardings(mesh))
  cond = jax.device_put(cond, programs.cond_shardings(mesh, cond))
  adv, valid = jax.device_put(adv, data), jax.device_put(valid, data)
  psh = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = jax.device_put(jax.device_get(exp.params), psh)  # a copy: the updates donate
  opt_sh = mesh_lib.fsdp_shardings(jax.eval_shape(exp.optimizer.init, params), mesh)
  opt = jax.jit(exp.optimizer.init, out_shardings=opt_sh)(params)
  rep = mesh_lib.replicated(mesh)
  key, step = jax.device_put(key, rep), jax.device_put(step, rep)
  traj_sh = programs.trajectory_shardings(mesh)
  if program == 'update':
    update = programs.make_update(exp, mesh, psh, opt_sh, traj_sh, samples=B)
    with jax.transfer_guard('disallow'):
      return None, update(params, opt, traj, cond, cond, adv, valid, key, step, None)
  indices = programs.make_select(exp, mesh)(key, step)
  grad = programs.make_fragment_grad(exp, mesh, psh, traj_sh, tsp=program == 'tsp', samples=B)
  with jax.transfer_guard('disallow'):
    acc = grad(params, programs.make_zero_acc(psh, mesh)(params), traj, cond, cond, adv, valid,
               indices, None, None)  # fmt: skip
    sums = jax.device_get(acc['sums'])
    grads = jax.device_get(acc['grads'])
    return (sums, grads), programs.make_apply(exp, mesh, psh, opt_sh)(params, opt, acc)


def run_case(case: dict, devices) -> dict:
  """One case (module docstring) on `devices`; returns its layout and differences."""
  K, B, t = case['K'], case['B'], case.get('t', 0)
  # Built (and validated) for one device; the forced steps axis is checked against n by
  # tsp.layout, as the runtime's cluster check does before it.
  exp = experiment.build(_config(K, B, 0), case.get('workdir', '/tmp/fragment_exactness'), 1)
  exp = experiment.respec(exp, _config(K, B, t))
  mesh1 = mesh_lib.make_mesh(jax.devices()[:1])
  init = _leaves(exp.params)
  prompts = [p for p in exp.prompts.next_batch() for _ in range(exp.rl.group_size)]
  cond = exp.conditioning(prompts)
  key, step = jax.random.key(11), np.int32(0)
  traj, _ = programs.make_rollout(exp, mesh1)(exp.params, cond, cond, key, step)
  traj = jax.device_get(traj)
  rng = np.random.default_rng(K * 100 + B)
  adv = rng.standard_normal(B).astype(np.float32)
  valid = np.arange(B) % 3 != 1
  ref, (p1, o1, m1) = _reference(exp, traj, cond, adv, valid, key, step)
  # The trajectory's replicated fields as [T+1, 1] / [T, 1] so _pad_rows leaves them alone.
  traj2 = traj.replace(sigmas=traj.sigmas[:, None], sde_steps=traj.sde_steps[:, None])
  program = case.get('program', 'tsp')
  acc, (pn, on, mn) = _on_devices(exp, devices, program, traj2, cond, adv, valid, key, step, B)
  moments = lambda o: [x for x in _leaves(o) if x.dtype.kind == 'f' and x.size > 1]
  lay = programs.tsp.layout(exp, mesh_lib.make_mesh(devices), B)
  if acc is None:  # the fused update: its metrics against the one-device fused update's
    sums, ref_sums, grad_rel = mn, m1, None
  else:  # the accumulated sums against the serial loss of sum(w * l)
    sums, ref_sums, grad_rel = acc[0], ref, _max_rel(_leaves(acc[1]), _leaves(ref['grads']))
  loss, ref_loss = float(sums['loss']), float(ref_sums['loss'])
  return {
      'case': case,
      'n': len(devices),
      'layout': lay._asdict() | {'rows': lay.rows, 'work': lay.work},
      'weight_sum': [float(sums['weight_sum']), float(ref_sums['weight_sum'])],
      'loss_rel': abs(loss - ref_loss) / abs(ref_loss),
      'grad_rel': grad_rel,
      'params_abs': max(float(np.abs(x - y).max()) for x, y in zip(_leaves(pn), _leaves(p1))),
      'moved': max(float(np.abs(x - y).max()) for x, y in zip(_leaves(p1), init)),
      'moments_rel': _max_rel(moments(on), moments(o1)),
      'grad_norm': [float(mn['grad_norm']), float(m1['grad_norm'])],
  }


if __name__ == '__main__':
  n = int(sys.argv[1])
  assert jax.device_count() >= n, (jax.device_count(), n)
  for c in json.loads(sys.argv[2]):
    print('RESULT ' + json.dumps(run_case(c, jax.devices()[:n])), flush=True)
