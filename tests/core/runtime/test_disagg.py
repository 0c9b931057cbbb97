"""Disaggregated runtime: cluster specs, versioned publish and batch moves on device, and exactness
(naive disagg in one process == colocated; two processes == one process)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.experiment import config as configlib
from digen_jax import programs
from digen_jax.experiment import build as experiment
from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import publish
from digen_jax.runtime import links
from digen_jax.runtime import rollout as rollout_lib
from digen_jax.experiment import run as run_lib
from tests.helpers import xla_env
from tests.mp_scripts import launcher_util as util
from tests.helpers.paths import REPO

STEPS = 3


def _tiny(**overrides):
  return configlib.apply_overrides(
      qwenimage.get_config('tiny'), {'total_steps': STEPS, **overrides}
  )


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _max_abs_diff(a, b) -> float:
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  return max(
      float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) for x, y in zip(la, lb)
  )


def _rows(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]


# ------------------------------------------------------------------------ config and cluster


def test_set_disagg_fills_the_cluster_block():
  c = configlib.set_disagg(_tiny(), trainer=(0, 1), rollout=[2, 3], rollout_param_dtype='bfloat16')
  assert c.runtime.mode == 'disagg' and c.cluster.layout == 'explicit'
  assert c.cluster.trainer.devices == (0, 1) and c.cluster.rollout.devices == (2, 3)
  assert c.cluster.rollout.processes == () and c.cluster.rollout.param_dtype == 'bfloat16'
  c = configlib.set_disagg(_tiny(), trainer=[0], rollout=[1], by='processes')
  assert c.cluster.trainer.processes == (0,) and c.cluster.trainer.devices == ()
  auto = qwenimage.get_config('tiny_disagg')
  assert auto.runtime.mode == 'disagg' and auto.cluster.layout == 'auto'
  # Full fine-tuning of the real model publishes a bf16 copy; LoRA its float32 adapters.
  assert qwenimage.get_config('full,disagg').cluster.rollout.param_dtype == 'bfloat16'
  assert qwenimage.get_config('disagg').cluster.rollout.param_dtype == 'float32'
  with pytest.raises(ValueError, match='both'):
    configlib.set_disagg(_tiny(), trainer=(0,))


def test_resolve_layouts_and_meshes():
  devs = jax.devices()
  auto = cluster_lib.resolve(run_lib.cluster_spec(configlib.set_disagg(_tiny())))
  assert auto.trainer.devices == tuple(devs[:2]) and auto.rollout.devices == tuple(devs[2:])
  assert not auto.multi_process and not auto.is_colocated and auto.num_devices == 4
  c = configlib.set_disagg(_tiny(), trainer=(3,), rollout=(0, 1))
  c.cluster.rollout.mesh_shape = (1, 2)
  c.cluster.rollout.axis_names = ('replica,data',)  # as --config...axis_names=replica,data
  c.cluster.rollout.speed = 2.5
  cl = cluster_lib.resolve(run_lib.cluster_spec(c))
  assert cl.trainer.devices == (devs[3],) and cl.rollout.size == 2
  assert dict(cl.rollout.mesh.shape) == {'replica': 1, 'data': 2} and cl.rollout.speed == 2.5
  # A batch over a 2-D mesh is split over both axes.
  assert mesh_lib.batch_sharding(cl.rollout.mesh, 2).spec[0] == ('replica', 'data')
  col = cluster_lib.colocated(devs[:2])
  assert col.is_colocated and col.num_devices == 2 and col.role_of(0) == 'both'


@pytest.mark.parametrize(
    'roles, extra, message',
    [
        (
            ((0, 1), (1, 2)),
            {},
            r'config.cluster.trainer and config.cluster.rollout overlap on device',
        ),
        (((0, 1), (2, 7)), {}, r'config.cluster.rollout.devices=\(2, 7\) names device 7'),
        (((0, 1), ()), {}, r'config.cluster.rollout is empty'),
        (((), (2, 3)), {}, r'config.cluster.trainer is empty'),
        (
            ((0, 1), (2, 3)),
            {'cluster.trainer.mesh_shape': (3,)},
            r'config.cluster.trainer.mesh_shape=\(3,\) holds 3 devices',
        ),
        (
            ((0, 1), (2, 3)),
            {'cluster.rollout.mesh_shape': (2, 1)},
            r'config.cluster.rollout.axis_names',
        ),
        (
            ((0, 1), (2, 3)),
            {'cluster.rollout.processes': (0,)},
            r'config.cluster.rollout: give devices',
        ),
        (
            ((0, 1), (2, 3)),
            {'cluster.layout': 'auto'},
            r"config.cluster.trainer.devices=.*layout='auto'",
        ),
    ],
)
def test_resolve_rejects_bad_specs_naming_the_field(roles, extra, message):
  c = _tiny(**extra)
  c.runtime.mode = 'disagg'
  c.cluster.layout = extra.get('cluster.layout', 'explicit')
  c.cluster.trainer.devices, c.cluster.rollout.devices = roles
  with pytest.raises(ValueError, match=message):
    cluster_lib.resolve(run_lib.cluster_spec(c))


def test_resolve_rejects_unknown_process_and_odd_auto_split():
  c = configlib.set_disagg(_tiny(), trainer=(0,), rollout=(1,), by='processes')
  with pytest.raises(ValueError, match=r'config.cluster.rollout.processes=\(1,\) names process 1'):
    cluster_lib.resolve(run_lib.cluster_spec(c))
  with pytest.raises(ValueError, match=r"layout='auto' splits this process's devices in half"):
    cluster_lib.resolve(
        run_lib.cluster_spec(configlib.set_disagg(_tiny())), devices=jax.devices()[:3]
    )


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
  """Stands in for another process's device (validation only looks at process_index)."""

  id: int
  process_index: int


@pytest.mark.parametrize(
    'trainer, rollout, message',
    [
        ((2, 3), (0, 1), r'config.cluster.trainer must be process 0'),
        ((0, 2), (1, 3), r'config.cluster.trainer spans processes \[0, 1\]'),
        ((0,), (1,), r'process\(es\) \[1\] have no role'),
    ],
)
def test_resolve_multi_process_rules(trainer, rollout, message):
  devs = [_FakeDevice(0, 0), _FakeDevice(1, 0), _FakeDevice(2048, 1), _FakeDevice(2049, 1)]
  c = configlib.set_disagg(_tiny(), trainer=trainer, rollout=rollout)
  with pytest.raises(ValueError, match=message):
    cluster_lib.resolve(run_lib.cluster_spec(c), devices=devs)


# ------------------------------------------------------------------------ publish / batch moves


def test_publish_and_fragment_hand_over_stay_on_device(tmp_path):
  """Trainer FSDP f32 -> rollout replicated (or FSDP) bf16 on other devices, stamped with the
  version (LocalLink.publish / wait_policy: the one publish path); a fragment onto the
  trainer's layout (send_fragment / receive_fragment); all under transfer_guard('disallow')."""
  c = configlib.set_disagg(_tiny(), trainer=(0, 1), rollout=(2, 3), rollout_param_dtype='bfloat16')
  cl = cluster_lib.resolve(run_lib.cluster_spec(c))
  exp = experiment.build(c, str(tmp_path), 2)
  params = exp.params
  trainer_params = jax.device_put(params, mesh_lib.fsdp_shardings(params, cl.trainer.mesh))
  want = [np.asarray(x).astype(jnp.bfloat16) for x in jax.tree.leaves(params)]
  traj_sh = programs.trajectory_shardings(cl.trainer.mesh)
  for sharding in ('replicated', 'fsdp'):
    cl = dataclasses.replace(cl, rollout_param_sharding=sharding)
    targets = publish.rollout_param_shardings(cl, params)
    link = links.LocalLink(cl, exp.weights, traj_sh, targets, publish.rollout_param_dtype(cl))
    with jax.transfer_guard('disallow'):
      link.publish(trainer_params, 7)
      policy, _ = link.wait_policy(7)
    assert policy.version == 7
    for got, w, t in zip(jax.tree.leaves(policy.params), want, jax.tree.leaves(targets)):
      assert got.dtype == jnp.bfloat16 and got.sharding == t
      assert got.sharding.device_set == set(cl.rollout.devices)
      np.testing.assert_array_equal(np.asarray(got), w)
    with pytest.raises(RuntimeError, match='expected policy version 8, got 7'):
      publish.accept(exp.weights, policy, 8)
  mb = publish.publish_megabytes(params, jnp.bfloat16)
  assert mb == pytest.approx(sum(x.size for x in jax.tree.leaves(params)) * 2 / 1e6)

  rng = np.random.default_rng(0)
  T, B, N, C = 3, 8, 4, 2
  host = sampler_lib.Trajectory(
      latents=rng.standard_normal((T + 1, B, N, C)).astype(np.float32),
      log_probs=rng.standard_normal((T, B)).astype(np.float32),
      sigmas=np.linspace(1, 0, T + 1).astype(np.float32),
      sde_steps=np.ones(T, bool),
      stds=rng.random((T, B)).astype(np.float32),
  )
  on_rollout = jax.device_put(host, programs.trajectory_shardings(cl.rollout.mesh))
  frag = links.Fragment(0, 0, 0, on_rollout, np.zeros(B, np.float32), 'rollout')
  with jax.transfer_guard('disallow'):
    link.send_fragment(frag, [])
    moved, _, _ = link.receive_fragment()
  for got, w, s in zip(
      jax.tree.leaves(moved.traj), jax.tree.leaves(host), jax.tree.leaves(traj_sh)
  ):
    assert got.sharding == s
    np.testing.assert_array_equal(np.asarray(got), w)


def test_abstract_fragment_has_the_rollout_shapes(tmp_path):
  """What a trainer process receives: traced from the rollout program, not compiled."""
  c = _tiny(**{'schedule.fragments': 2})
  exp = experiment.build(c, str(tmp_path), 1)
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  ab = rollout_lib.abstract_fragment(exp, exp.plan, programs.trajectory_shardings(mesh))
  T, n = c.sampler.num_steps, exp.plan.size
  assert n == exp.batch_size // 2
  assert ab.latents.shape == (T + 1, n, *exp.latent_shape)
  assert ab.log_probs.shape == (T, n) and ab.sde_steps.dtype == jnp.bool_
  assert ab.latents.sharding == programs.trajectory_shardings(mesh).latents


@pytest.mark.parametrize('fragments', [1, 2])
@pytest.mark.slow
def test_trainer_compile_leaves_nothing_for_the_first_fragment(tmp_path, fragments):
  """Trainer.compile compiles its programs (the fused update; or the fragment gradient and the
  optimizer step) from a fragment's abstract layout while the rollout samples the first
  fragment; training the first fragment then traces and compiles nothing."""
  from jax import monitoring

  from digen_jax.runtime import bookkeeping
  from digen_jax.runtime import trace as trace_lib
  from digen_jax.runtime import trainer as trainer_lib

  # An lr no other test uses: its update programs are not compiled in this process yet.
  lr = 1.2345e-4 + fragments * 1e-7
  c = configlib.set_disagg(
      _tiny(**{'optim.lr': lr, 'schedule.fragments': fragments}), trainer=(0, 1), rollout=(2, 3)
  )
  cl = cluster_lib.resolve(run_lib.cluster_spec(c))
  exp = experiment.build(c, str(tmp_path), 2)
  tracer = trace_lib.Tracer(False)
  ckpt = bookkeeping.checkpointer(exp.output, str(tmp_path), False)
  trainer = trainer_lib.Trainer(exp, cl.trainer.mesh, ckpt, exp.plan, tag=False)
  assert trainer.fused == (fragments == 1)
  sh = publish.rollout_param_shardings(cl, exp.params)
  sampler = rollout_lib.Sampler(exp, cl.rollout.mesh, sh, exp.plan, 'rollout', tracer, 'allow')
  prompts = [p for p in exp.prompts.next_batch() for _ in range(exp.plan.group_size)]
  policy = jax.device_put(exp.params, sh)
  frag = sampler.sample(policy, 0, prompts, 0, 0)
  traj = jax.device_put(frag.traj, trainer.traj_shardings)
  rewards = np.resize(frag.rewards, exp.plan.batch)
  cond = trainer.encode(exp.plan.prompts(0, prompts))
  state = trainer.begin(0)
  adv = trainer.advantages(0, rewards)
  events = []
  record = lambda name, *_, **__: events.append(name) if '/compile' in name else None
  monitoring.register_event_listener(record)
  monitoring.register_event_duration_secs_listener(record)
  try:
    trainer.compile(state)
    compiled = list(events)
    events.clear()
    state = jax.block_until_ready(trainer.train(state, traj, cond, *adv))
  finally:
    monitoring.unregister_event_listener(record)
    monitoring.unregister_event_duration_listener(record)
    trainer.close()
  assert '/jax/core/compile/jaxpr_trace_duration' in compiled, compiled
  assert events == [], events


def _cli(workdir, *flags, env=None, timeout=600):
  cmd = [sys.executable, '-m', 'digen_jax.main', f'--workdir={workdir}', *flags]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_one_device_cannot_split_fails_before_compiling(tmp_path):
  """The auto layout with one CPU device (the fuzz cases run with 4: roles_overlap there)."""
  env = xla_env.env_with_devices(1)
  wd = tmp_path / 'run'
  r = _cli(wd, '--config=configs/qwenimage.py:tiny_disagg', env=env)
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  message = "layout='auto' splits this process's devices in half, but it has 1"
  assert last.startswith('digen_jax: ') and message in last, r.stderr[-2000:]
  assert not os.path.exists(wd / 'metrics.jsonl') and not os.path.exists(wd / 'config.json')


# ------------------------------------------------------------------------ exactness


@pytest.fixture(scope='module')
def disagg_one_process(tmp_path_factory):
  """Naive disagg in one process: trainer on devices 0-1, rollout on devices 2-3."""
  wd = str(tmp_path_factory.mktemp('disagg1p'))
  c = configlib.set_disagg(_tiny(), trainer=(0, 1), rollout=(2, 3))
  cl = cluster_lib.resolve(run_lib.cluster_spec(c))
  out = loop.train(experiment.build(c, wd, 2), wd, cl)
  return out, wd


@pytest.mark.slow
def test_disagg_one_process_equals_colocated(disagg_one_process, tmp_path):
  """Same seed and config: identical parameters after 3 steps. The colocated mesh has the same
  2 devices as each role, so the programs and their reduction orders are the same: the
  expected difference is 0 (asserted to 1e-6 relative)."""
  dis, dis_wd = disagg_one_process
  wd = str(tmp_path / 'colocated')
  col = loop.train(experiment.build(_tiny(), wd, 2), wd, cluster_lib.colocated(jax.devices()[:2]))
  diff = _max_abs_diff(dis['params'], col['params'])
  print(f'disagg(1 process, 2+2 devices) vs colocated(2 devices): max |dparams| = {diff:.3g}')
  for x, y in zip(_leaves(dis['params']), _leaves(col['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)
  init = experiment.build_model(_tiny())[2]
  assert _max_abs_diff(dis['params'], init) > 1e-6, 'the updates did nothing'
  rd, rc = _rows(dis_wd), _rows(wd)
  assert [r['step'] for r in rd] == [1, 2, 3] and [r['policy_version'] for r in rd] == [0, 1, 2]
  for a, b in zip(rd, rc):
    assert a['reward_mean'] == pytest.approx(b['reward_mean'], rel=1e-6)
    assert a['loss'] == pytest.approx(b['loss'], rel=1e-5, abs=1e-12)
    assert a['publish_s'] > 0 and a['publish_mb'] > 0
    assert abs(a['ratio_mean'] - 1.0) < 1e-5  # on-policy: ratio 1 before the update


@pytest.mark.slow
def test_two_processes_equal_one_process_and_resume(disagg_one_process, tmp_path):
  """launch/local.py: process 0 trains, process 1 rolls out (2 CPU devices each). 2 steps, then a
  restart on the same workdir resumes to 3 (with an eval at the end); the trainer's final
  checkpoint equals the one-process disagg parameters (to float32 rounding, see below)."""
  dis, _ = disagg_one_process
  wd = str(tmp_path / 'run')
  launch = ['--num_processes=2', '--devices_per_process=2', '--timeout_s=280']
  main = [
      sys.executable,
      '-m',
      'digen_jax.main',
      '--config=configs/qwenimage.py:tiny_disagg',
      f'--workdir={wd}',
  ]
  code, out = util.run(launch, main + ['--config.total_steps=2'], timeout_s=300)
  assert code == 0, out[-4000:]
  assert '(trainer)' in out and '(rollout)' in out
  evals = [
      '--config.eval.every=2',
      '--config.eval.num_prompts=2',
      '--config.eval.samples_per_prompt=2',
      '--config.eval.batch_size=4',
  ]
  code, out = util.run(launch, main + [f'--config.total_steps={STEPS}', *evals], timeout_s=300)
  assert code == 0, out[-4000:]
  assert '[0] ' in out and 'resumed from' in out, out[-4000:]

  ckpt = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  assert ckpt.latest_step() == STEPS
  template = {
      'params': dis['params'],
      'opt_state': dis['opt_state'],
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  state, meta = ckpt.restore(STEPS, template)
  ckpt.close()
  diff = _max_abs_diff(state['params'], dis['params'])
  moved = _max_abs_diff(state['params'], experiment.build_model(_tiny())[2])
  print(
      f'disagg 2 processes (with a resume) vs 1 process: max |dparams| = {diff:.3g} '
      f'(the 3 updates moved params by up to {moved:.3g})'
  )
  # Bitwise equal on the AVX-512 hosts this was written on. On an AVX2-only CPU, XLA's matmuls in
  # the two-process run (one 2-thread pool per process) round differently from the one-process
  # run (one pool for 4 devices): max |dparams| ~3e-8 there. A schedule error (a stale policy,
  # a lost or repeated fragment) changes params on the scale of the updates, which are asserted
  # to be 1000x larger than this tolerance.
  atol = 1e-8  # with rtol 1e-6: the AVX2 run's worst element is 2.4e-9 off at magnitude 5.9e-4
  assert moved > 1000 * atol, 'the updates did nothing'
  for x, y in zip(_leaves(state['params']), _leaves(dis['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=atol)
  assert _max_abs_diff(state['opt_state'], dis['opt_state']) <= 1e-6
  assert meta['data_position'] == STEPS * 2 and meta['policy_version'] == STEPS

  rows = _rows(wd)
  train = [r for r in rows if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert [r['policy_version'] for r in train] == [0, 1, 2]
  assert all(r['publish_s'] > 0 and r['publish_mb'] > 0 for r in train)
  assert [r['step'] for r in rows if 'eval/reward_mean' in r] == [3]
  assert os.path.exists(os.path.join(wd, 'eval', 'eval_000003.json'))  # written by the rollout
  assert os.path.exists(os.path.join(wd, 'summary.json'))
