"""DigenRL scheduling modes (runtime/loop.py, every mode one loop): config checks, TSP ==
serial, and exactness of GAP + TSP + TAG against colocated in one process and in two; TCSS
staleness bookkeeping."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax import programs
from digen_jax.rl import objective
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import inputs
from digen_jax.experiment import run as run_lib
from tests.helpers import runs
from tests.mp_scripts import launcher_util as util

STEPS = 3
# The schedules change how the batch is cut and where it is sampled, so reductions round in a
# different order than colocated's one-batch programs: parameters agree to ~1e-6 after 3 Adam
# steps that move them by ~3e-4 (measured: 6e-7 .. 1e-6).
PARAM_ATOL = 1e-5


def _tiny(**overrides):
  return configlib.apply_overrides(
      qwenimage.get_config('tiny'), {'total_steps': STEPS, **overrides}
  )


def _assert_same_update(params, opt_state, rows, ref):
  """params/opt_state/rows of a scheduled run vs the colocated reference (dict)."""
  for x, y in zip(runs.leaves(params), runs.leaves(ref['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=PARAM_ATOL)
  # Adam is invariant to a constant gradient scale; its moments and the grad norm are not, so
  # they catch a wrong loss denominator the parameters alone would hide.
  for x, y in zip(runs.leaves(opt_state), runs.leaves(ref['opt_state'])):
    if x.dtype.kind == 'f' and x.size:
      np.testing.assert_allclose(x, y, atol=1e-3 * float(np.abs(y).max()) + 1e-12)
  assert [r['step'] for r in rows] == list(range(1, STEPS + 1))
  assert [r['policy_version'] for r in rows] == list(range(STEPS))
  for a, b in zip(rows, ref['rows']):
    assert a['reward_mean'] == pytest.approx(b['reward_mean'], rel=1e-5, abs=1e-6)
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-3)
    assert abs(a['ratio_mean'] - 1.0) < 1e-5  # strictly on-policy
    assert 0 < a['utilization'] <= 1


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    'overrides, message',
    [
        ({'schedule.fragments': 3}, r'schedule.fragments=3 must divide rl.prompts_per_step=2'),
        ({'schedule.fragments': 3, 'schedule.fragment_unit': 'sample'}, 'must divide the batch'),
        ({'schedule.fragments': 2, 'rl.adv_std': 'global'}, "rl.adv_std='group'"),
        ({'schedule.fragment_unit': 'prompt'}, 'schedule.fragment_unit'),
        ({'schedule.tag': True}, 'runtime.mode=disagg'),
        ({'schedule.tcss_fraction': 1.5}, r'tcss_fraction=1.5 must be a finite number in \[0, 1\]'),
        ({'schedule.fragments': 2, 'schedule.tcss_fraction': 0.25}, 'allows no stale fragment'),
    ],
)
def test_bad_schedule_fails_naming_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    configlib.validate(_tiny(**overrides), 2)


@pytest.mark.slow
def test_schedule_defaults_are_one_fragment_trained_by_the_fused_update(tmp_path):
  from digen_jax.runtime import bookkeeping
  from digen_jax.runtime import trainer as trainer_lib

  c = _tiny()
  assert (
      c.schedule.fragments,
      c.schedule.fragment_unit,
      c.schedule.tsp,
      c.schedule.tag,
      c.schedule.tcss_fraction,
      c.schedule.trace,
  ) == (1, 'group', False, False, 0.0, True)
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  for overrides, fused in (
      ({}, True),
      ({'schedule.fragments': 2}, False),
      ({'schedule.tsp': True}, False),
  ):
    exp = experiment.build(_tiny(**overrides), str(tmp_path), 2)
    ckpt = bookkeeping.checkpointer(exp.output, str(tmp_path / 'ckpt'), False)
    trainer = trainer_lib.Trainer(exp, mesh, ckpt, exp.plan, tag=False)
    assert trainer.fused == fused, overrides
    trainer.close()


# ------------------------------------------------------------------------------ TSP


@pytest.mark.slow
def test_tsp_gradient_equals_the_serial_loop(tmp_path):
  """K = 5 timesteps padded to 6 over a 2-device trainer mesh (steps axis forced to 2; auto
  would pick t = 1 for these 8 samples), one batched fwd/bwd, vs the per-timestep lax.scan: same
  loss sums and gradients to float32 rounding."""
  c = _tiny(**{'schedule.tsp': True, 'schedule.tsp_steps_axis': 2})
  exp = experiment.build(c, str(tmp_path), 2)
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  K, K_pad = programs.tsp_steps(exp, mesh)
  assert (K, K_pad) == (5, 6)
  psh = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = jax.device_put(exp.params, psh)
  prompts = [p for p in exp.prompts.next_batch() for _ in range(c.rl.group_size)]
  cond = inputs.encode(exp, prompts, mesh)
  traj, _ = programs.make_rollout(exp, mesh)(
      exp.params, cond, cond, jax.random.key(3), jnp.int32(0)
  )
  rng = np.random.default_rng(0)
  data = mesh_lib.batch_sharding(mesh, 1)
  adv = jax.device_put(rng.standard_normal(exp.batch_size).astype(np.float32), data)
  valid = jax.device_put(np.arange(exp.batch_size) % 3 != 0, data)
  indices = jax.device_put(np.arange(K, dtype=np.int32), mesh_lib.replicated(mesh))
  traj = jax.device_put(traj, programs.trajectory_shardings(mesh))
  zero = programs.make_zero_acc(psh, mesh)
  tsp = programs.make_fragment_grad(exp, mesh, psh, programs.trajectory_shardings(mesh), tsp=True)
  with jax.transfer_guard('disallow'):
    acc = tsp(params, zero(params), traj, cond, cond, adv, valid, indices, None, None)
  velocity_fn = programs.velocity_fn_of(exp)

  def serial(p):
    return objective.grpo_objective(
        velocity_fn,
        p,
        traj,
        cond,
        adv,
        valid,
        indices,
        sde_cfg=exp.sde_cfg,
        clip_range=c.rl.clip_range,
        step_loop='scan',
        denominator=1.0,
    )

  (loss, m), g = jax.jit(jax.value_and_grad(serial, has_aux=True))(exp.params)
  assert float(acc['sums']['loss']) == pytest.approx(float(loss), rel=1e-4, abs=1e-7)
  assert float(acc['sums']['weight_sum']) == float(m['weight_sum']) == 5 * int(valid.sum())
  scale = max(float(np.abs(x).max()) for x in runs.leaves(g))
  assert scale > 0
  for x, y in zip(runs.leaves(acc['grads']), runs.leaves(g)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * scale)


# ------------------------------------------------------------------------------ exactness


@pytest.fixture(scope='module')
def colocated_ref(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp('colocated'))
  out = loop.train(experiment.build(_tiny(), wd, 2), wd, cluster_lib.colocated(jax.devices()[:2]))
  out['rows'] = runs.train_rows(wd)
  init = experiment.build_model(_tiny())[2]
  moved = max(
      float(np.abs(a - b).max()) for a, b in zip(runs.leaves(out['params']), runs.leaves(init))
  )
  assert moved > 30 * PARAM_ATOL, 'the updates are too small for the tolerance to mean much'
  return out


@pytest.mark.slow
@pytest.mark.parametrize('unit, m', [('sample', 4), ('group', 2)])
def test_gap_tsp_tag_one_process_equals_colocated(colocated_ref, tmp_path, unit, m, plots):
  """GAP (M fragments) + TSP + TAG/BTS in one process (trainer devices 0-1, rollout 2-3,
  the rollout a thread): same parameters as colocated after 3 steps, whoever sampled what."""
  wd = str(tmp_path / 'run')
  c = configlib.set_disagg(
      _tiny(
          **{
              'schedule.fragments': m,
              'schedule.fragment_unit': unit,
              'schedule.tsp': True,
              'schedule.tag': True,
          }
      ),
      trainer=(0, 1),
      rollout=(2, 3),
  )
  exp = runs.slow_reward(experiment.build(c, wd, 2), 0.4)
  out = loop.train(exp, wd, cluster_lib.resolve(run_lib.cluster_spec(c)))
  rows = runs.train_rows(wd)
  print(
      f'GAP({unit}, M={m})+TSP+TAG vs colocated: max |dparams| = '
      f'{max(float(np.abs(a - b).max()) for a, b in zip(runs.leaves(out["params"]), runs.leaves(colocated_ref["params"]))):.3g}; '
      f'TAG fragments per step {[r["tag_fragments"] for r in rows]}'
  )
  _assert_same_update(out['params'], out['opt_state'], rows, colocated_ref)
  assert all(r['fragments'] == m for r in rows)
  decisions = out['decisions']
  assert decisions and all(d['action'] in ('insert', 'wait') and d['reason'] for d in decisions)
  # The trainer did sample (TAG) and BTS recorded why; the update was still colocated's.
  assert sum(r['tag_fragments'] for r in rows) >= 1
  assert any(
      d['action'] == 'insert' and d['makespan_insert'] < d['makespan_wait'] for d in decisions
  )
  trace_json = json.load(open(os.path.join(wd, 'trace.json')))
  names = {e['name'] for e in trace_json['traceEvents'] if e['ph'] == 'X'}
  assert {'rollout', 'tag_rollout', 'grad', 'apply', 'publish'} <= names
  assert len(trace_json['decisions']) == len(decisions)
  assert os.path.getsize(os.path.join(wd, 'timeline.png')) > 1000


@pytest.mark.slow
@pytest.mark.parametrize('wait_for_pull', [False, True])
def test_gap_tsp_tag_two_processes_equal_colocated(colocated_ref, tmp_path, wait_for_pull, plots):
  """launch/local.py, process 0 trains and process 1 rolls out (2 CPU devices each), GAP by
  sample (M=4) + TSP + TAG: same parameters as colocated; both roles' spans in one trace. The
  rollout's hand-over mode (schedule.wait_for_pull) changes when fragments move, not what."""
  wd = str(tmp_path / 'run')
  # A hang (never seen here; once, in CI, this run outlived 300 s) ends at the launcher's timeout:
  # each copy then prints its threads' stacks (runtime.shutdown_timeout_s) and the assert shows
  # them. A run takes 30-60 s.
  launch = ['--num_processes=2', '--devices_per_process=2', '--timeout_s=240', '--grace_s=45']
  main = [
      sys.executable,
      '-m',
      'digen_jax.main',
      '--config=configs/qwenimage.py:tiny_disagg',
      f'--workdir={wd}',
      f'--config.total_steps={STEPS}',
      '--config.schedule.fragments=4',
      '--config.schedule.fragment_unit=sample',
      '--config.schedule.tsp=True',
      '--config.schedule.tag=True',
      f'--config.schedule.wait_for_pull={wait_for_pull}',
      '--config.runtime.shutdown_timeout_s=30',
  ]
  code, out = util.run(launch, main, timeout_s=330)
  assert code == 0, out[-12000:]
  assert 'BTS step' in out
  ckpt = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  assert ckpt.latest_step() == STEPS
  template = {
      'params': colocated_ref['params'],
      'opt_state': colocated_ref['opt_state'],
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  state, meta = ckpt.restore(STEPS, template)
  ckpt.close()
  assert meta['data_position'] == STEPS * 2
  _assert_same_update(state['params'], state['opt_state'], runs.train_rows(wd), colocated_ref)
  trace_json = json.load(open(os.path.join(wd, 'trace.json')))
  roles = {e['cat'] for e in trace_json['traceEvents'] if e['ph'] == 'X'}
  assert roles == {'rollout', 'trainer'}
  assert os.path.exists(os.path.join(wd, 'timeline.png'))


@pytest.mark.slow
def test_tcss_mixes_at_most_one_version_of_staleness(tmp_path):
  """phi = 0.5 of M = 4 fragments may start with the previous policy: rows report the
  staleness mix, every sample is at most one version old, ratios use the behaviour log-probs."""
  wd = str(tmp_path / 'run')
  c = configlib.set_disagg(
      _tiny(
          **{
              'schedule.fragments': 4,
              'schedule.fragment_unit': 'sample',
              'schedule.tcss_fraction': 0.5,
          }
      ),
      trainer=(0, 1),
      rollout=(2, 3),
  )
  out = loop.train(experiment.build(c, wd, 2), wd, cluster_lib.resolve(run_lib.cluster_spec(c)))
  rows = runs.train_rows(wd)
  assert [r['step'] for r in rows] == [1, 2, 3]
  for r in rows:
    mix = r['staleness_mix']
    assert set(mix) == {'0', '1'} and sum(mix.values()) == pytest.approx(1.0)
    assert mix['1'] <= 0.5 + 1e-9
    assert r['policy_version'] >= r['step'] - 2
  assert rows[0]['staleness_mix']['1'] == 0.0  # nothing precedes the first batch
  # The rollout finishes its share before the trainer's last gradient + step + publish, so
  # later batches do start with the previous policy.
  assert any(r['staleness_mix']['1'] > 0 for r in rows[1:])
  assert all(np.isfinite(x).all() for x in runs.leaves(out['params']))
