"""The likelihood-free objectives (config.rl.algorithm 'nft' | 'awm') through the one step loop:
their rollout hands over clean samples only, and every on-policy schedule (GAP by sample and by
group, TSP over the noise-level axis, TAG/BTS, two processes) gives colocated's update."""

import os
import sys

import jax
import numpy as np
import pytest

from configs import qwenimage
from digen_jax import programs
from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.experiment import run as run_lib
from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.rewards import registry as reward_registry
from digen_jax.rl import old_policy
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from tests.helpers import runs
from tests.mp_scripts import launcher_util as util

STEPS = 3
# The schedules cut and place the batch differently (and TAG samples some fragments on the
# trainer's mesh), so reductions round in another order: the gradients agree to ~1e-6 of their
# scale (test_fragment_and_tsp_gradients_equal_the_whole_batch, the sharp check). Adam then
# moves each weight by ~lr whatever |g| is, so a weight whose gradient is itself at the
# rounding level (|g| ~ 1e-6, a few per run) takes a step set by rounding: with Adam's eps 1e-8
# one or two of 32768 weights differed by 3.5e-5 after 3 steps at lr 1e-4 (measured). eps 1e-4
# keeps such a step proportional to its gradient. The two-process test scores with the
# config's JPEG-size reward (its processes cannot see this module's reward), which a last-bit
# image difference can move: a few weights then differ by up to 6.4e-5 (2 of 8192, measured)
# of the 9e-4 that 3 steps at lr 3e-4 can move one. So: 5e-5 for all but 0.1 % of the
# weights, 2e-4 for every one (a wrong noise key, level or denominator moves them all), and
# the moments to 1e-3 of each kind's scale. In one process (this module's continuous reward)
# the deviation is <= 1.2e-7 (measured).
PARAM_ATOL = 5e-5
ADAM_EPS = 1e-4
LR = 3e-4  # the recipes' (tiny's 1e-4 with eps 1e-4 moves the weights too little to compare)
# nft with its old policy trailing the params (decay 0.3 from the first step, so the second
# forward and the old policy's publish are exercised); awm with its EMA KL on.
OBJECTIVES = {
    'nft': {
        'rl.algorithm': 'nft',
        'rl.train_noise_levels': 3,
        'rl.old_policy_uprate': 0.3,
        'rl.old_policy_uphold': 0.3,
        'rl.kl_beta': 1e-2,
    },
    'awm': {
        'rl.algorithm': 'awm',
        'rl.train_noise_levels': 3,
        'rl.clip_range': 1.0,
        'rl.old_policy_uprate': 0.3,
        'rl.old_policy_uphold': 0.3,
    },
}


@reward_registry.register('lf_test_brightness')
def _brightness(images, prompts):
  """A reward continuous in the pixels. nft samples with its old policy, a copy the fused
  update (colocated) and the apply after fragments (GAP) compute in different programs, equal to
  the last bits; the tiny config's JPEG-size reward jumps by whole bytes on a one-bit change of
  an image (measured: nft, GAP by group, 331 weights off by up to 1.5e-4 after 3 steps with it,
  6e-8 with this reward), which tests the JPEG encoder, not the schedule."""
  del prompts
  x = np.asarray(images, np.float32)
  return x.mean(axis=tuple(range(1, x.ndim)))


def _tiny(algorithm, **overrides):
  return configlib.apply_overrides(
      qwenimage.get_config('tiny'),
      {
          'total_steps': STEPS,
          'optim.eps': ADAM_EPS,
          'optim.lr': LR,
          'reward.weights': 'lf_test_brightness',
          **OBJECTIVES[algorithm],
          **overrides,
      },
  )


def _states(opt_state):
  """The optimizer state's float leaves grouped by the subtree (params-shaped tree) they sit in:
  [[leaves of mu], [leaves of nu], [leaves of the old policy]]."""
  groups = {}
  for path, x in jax.tree_util.tree_leaves_with_path(jax.device_get(opt_state)):
    x = np.asarray(x)
    if x.dtype.kind == 'f' and x.size and x.ndim:
      i = next((i for i, k in enumerate(path) if isinstance(k, jax.tree_util.DictKey)), len(path))
      groups.setdefault(jax.tree_util.keystr(path[:i]), []).append(x)
  return list(groups.values())


def _assert_same_update(params, opt_state, rows, ref):
  got, want = np.concatenate([x.ravel() for x in runs.leaves(params)]), np.concatenate(
      [y.ravel() for y in runs.leaves(ref['params'])]
  )
  dev = np.abs(got - want)
  print(
      f'max |dparams| {dev.max():.3g}; {int((dev > PARAM_ATOL).sum())} of {dev.size} > {PARAM_ATOL}'
  )
  # Every weight within 4x the tolerance, all but 0.1 % of them within it (measured: at most
  # 2 of 32768 above 5e-5, none above 6.4e-5).
  assert dev.max() <= 4 * PARAM_ATOL
  assert (dev > PARAM_ATOL).mean() <= 1e-3
  # The moments and the old policy (inside the optimizer state) follow the gradient's scale,
  # which a wrong loss denominator would change while Adam's params hid it.
  # Against the scale of each kind of state (first moments, second moments, old policy) over
  # the whole tree, not leaf by leaf: a leaf whose gradient is itself rounding noise (nft, GAP
  # by group + TAG: a [1, 128] bias whose moments are ~1e-6 where others are ~1e-2, measured)
  # has no reproducible moments of its own, while a wrong denominator scales every leaf.
  for part, ref_part in zip(_states(opt_state), _states(ref['opt_state'])):
    scale = max(float(np.abs(y).max()) for y in ref_part)
    for x, y in zip(part, ref_part):
      np.testing.assert_allclose(x, y, atol=1e-3 * scale + 1e-12)
  assert [r['step'] for r in rows] == list(range(1, STEPS + 1))
  for a, b in zip(rows, ref['rows']):
    assert a['reward_mean'] == pytest.approx(b['reward_mean'], rel=1e-5, abs=1e-6)
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-3)
    # awm's loss is -mean(advantage) (ratio 1) + KLs: ~0, a sum with cancellations.
    assert a['loss'] == pytest.approx(b['loss'], rel=1e-4, abs=1e-5)


def _colocated(algorithm, wd, **overrides):
  """The colocated run of `algorithm` on 2 devices: its params, optimizer state and rows."""
  exp = experiment.build(_tiny(algorithm, **overrides), wd, 2)
  out = loop.train(exp, wd, cluster_lib.colocated(jax.devices()[:2]))
  out['rows'] = runs.train_rows(wd)
  out['algorithm'] = algorithm
  return out


@pytest.fixture(scope='module', params=sorted(OBJECTIVES))
def colocated_ref(request, tmp_path_factory):
  algorithm = request.param
  out = _colocated(algorithm, str(tmp_path_factory.mktemp(f'colocated_{algorithm}')))
  init = experiment.build_model(_tiny(algorithm))[2]
  moved = max(
      float(np.abs(a - b).max()) for a, b in zip(runs.leaves(out['params']), runs.leaves(init))
  )
  assert moved > 8 * PARAM_ATOL, 'the updates are too small for the tolerance to mean much'
  # The old policy trails the params: neither the initial weights nor the trained ones.
  old = runs.leaves(old_policy.old_params(out['opt_state']))
  gap = max(float(np.abs(a - b).max()) for a, b in zip(old, runs.leaves(out['params'])))
  assert gap > PARAM_ATOL
  return out


def test_the_rollout_hands_over_clean_samples_drawn_by_the_ode(tmp_path):
  """The same rollout program with the trajectory outputs off: CleanSamples whose latents are
  the ODE's final samples (the eval rollout's, which draws the same initial noise), and
  per-sample training keys that do not depend on how the batch is cut."""
  exp = experiment.build(_tiny('nft'), str(tmp_path), 1)
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  texts = ['a red square', 'a blue circle', 'a red square', 'a blue circle']
  cond = exp.conditioning(texts)
  key, step = jax.random.key(3), np.int32(0)
  rollout = programs.make_rollout(exp, mesh, with_offset=True)
  samples, images = rollout(exp.params, cond, cond, key, step, np.int32(0))
  assert isinstance(samples, sampler_lib.CleanSamples)
  assert samples.latents.shape == (4, *exp.latent_shape) and samples.keys.shape == (4, 2)
  ode = programs.make_rollout(exp, mesh, with_offset=True, deterministic=True)
  ode_images = ode(exp.params, cond, cond, key, step, np.int32(0))
  np.testing.assert_array_equal(np.asarray(images), np.asarray(ode_images))
  # The second half as its own fragment (offset 2): the same keys, and the same samples to the
  # rounding of a 2-row batch's matmuls against a 4-row one.
  half = {k: v[2:] for k, v in cond.items()}
  part, _ = rollout(exp.params, half, half, key, step, np.int32(2))
  np.testing.assert_allclose(np.asarray(part.latents), np.asarray(samples.latents)[2:], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(part.keys), np.asarray(samples.keys)[2:])
  assert len(set(map(tuple, np.asarray(samples.keys).tolist()))) == 4


def test_colocated_rows_carry_the_objectives_metrics(colocated_ref):
  """The colocated run of each objective (the fixture's parameter): finite rows with the
  objective's own metrics."""
  algorithm, rows = colocated_ref['algorithm'], colocated_ref['rows']
  assert all(np.isfinite(r['loss']) and r['nonfinite'] == 0 for r in rows)
  if algorithm == 'nft':
    assert all(0 <= r['r_mean'] <= 1 for r in rows)
  else:
    assert all(abs(r['ratio_mean'] - 1.0) < 1e-6 for r in rows)  # on-policy: ratio 1


@pytest.mark.parametrize('algorithm', sorted(OBJECTIVES))
def test_fragment_and_tsp_gradients_equal_the_whole_batch(tmp_path, algorithm):
  """One batch's gradient and metric sums as one fragment, as 4 fragments (each with its own
  rows, offset and training keys) and with TSP over the noise levels: equal to float rounding,
  with the old policy and (nft) the KL reference in the loss."""
  exp = experiment.build(_tiny(algorithm), str(tmp_path), 2)
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  texts = [t for t in exp.prompts.next_batch() for _ in range(exp.rl.group_size)]
  b = len(texts)
  cond = exp.conditioning(texts)
  rollout = programs.make_rollout(exp, mesh, with_offset=True)
  samples, _ = rollout(exp.params, cond, cond, jax.random.key(1), np.int32(0), np.int32(0))
  psh = mesh_lib.fsdp_layout(exp.params, mesh).shardings
  params = jax.device_put(exp.params, psh)
  ref = jax.tree.map(lambda x: x * 0.999, params)
  old = jax.tree.map(lambda x: x * 1.001, params)
  adv = np.random.RandomState(0).randn(b).astype(np.float32)
  valid = np.ones(b, bool)
  sh = programs.trajectory_shardings(mesh, exp)
  zero = programs.make_zero_acc(psh, mesh, exp)
  indices = programs.make_select(exp, mesh)(jax.random.key(0), np.int32(0))

  def grads(tsp, fragments):
    grad = programs.make_fragment_grad(exp, mesh, psh, sh, tsp=tsp)
    acc, n = zero(params), b // fragments
    for f in range(fragments):
      rows = slice(f * n, (f + 1) * n)
      part = jax.device_put(jax.tree.map(lambda a: a[rows], samples), sh)
      c = {k: v[rows] for k, v in cond.items()}
      acc = grad(params, acc, part, c, c, adv[rows], valid[rows], indices, ref, old)
    return jax.device_get(acc)

  whole = grads(False, 1)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(whole['grads']))
  assert scale > 0
  for got in (grads(False, 4), grads(True, 1)):
    for x, y in zip(jax.tree.leaves(got['grads']), jax.tree.leaves(whole['grads'])):
      np.testing.assert_allclose(x, y, atol=1e-5 * scale)
    for k, v in whole['sums'].items():
      assert float(got['sums'][k]) == pytest.approx(float(v), rel=1e-4, abs=1e-6), k


@pytest.mark.slow
@pytest.mark.parametrize('unit, m', [('sample', 4), ('group', 2)])
def test_gap_tsp_tag_one_process_equals_colocated(colocated_ref, tmp_path, unit, m):
  """GAP (M fragments) + TSP over the noise levels + TAG/BTS in one process: colocated's
  params, moments and old policy after 3 steps."""
  wd = str(tmp_path / 'run')
  c = configlib.set_disagg(
      _tiny(
          colocated_ref['algorithm'],
          **{
              'schedule.fragments': m,
              'schedule.fragment_unit': unit,
              'schedule.tsp': True,
              'schedule.tag': True,
          },
      ),
      trainer=(0, 1),
      rollout=(2, 3),
  )
  exp = runs.slow_reward(experiment.build(c, wd, 2), 0.4)
  out = loop.train(exp, wd, cluster_lib.resolve(run_lib.cluster_spec(c)))
  rows = runs.train_rows(wd)
  _assert_same_update(out['params'], out['opt_state'], rows, colocated_ref)
  assert all(r['fragments'] == m for r in rows)
  assert sum(r['tag_fragments'] for r in rows) >= 1


@pytest.mark.slow
@pytest.mark.parametrize('algorithm', sorted(OBJECTIVES))
def test_gap_tsp_two_processes_equal_colocated(tmp_path, algorithm):
  """launch/local.py, one process per role (2 CPU devices each), GAP by sample (M=4) + TSP:
  colocated's update, the old policy published over the transfer server (the subprocesses score
  with the config's JPEG reward, the reference with it too)."""
  # The processes score with the config's own (JPEG) reward, a registry name the test's
  # reward is not in theirs: the reference here does too.
  jpeg = qwenimage.get_config('tiny').reward.weights
  colocated_ref = _colocated(algorithm, str(tmp_path / 'colocated'), **{'reward.weights': jpeg})
  wd = str(tmp_path / 'run')
  launch = ['--num_processes=2', '--devices_per_process=2', '--timeout_s=240', '--grace_s=45']
  overrides = [f'--config.{k}={v}' for k, v in OBJECTIVES[algorithm].items()]
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
      '--config.runtime.shutdown_timeout_s=30',
      f'--config.optim.eps={ADAM_EPS}',
      f'--config.optim.lr={LR}',
      *overrides,
  ]
  code, out = util.run(launch, main, timeout_s=330)
  assert code == 0, out[-12000:]
  ckpt = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  template = {
      'params': colocated_ref['params'],
      'opt_state': colocated_ref['opt_state'],
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  state, _ = ckpt.restore(STEPS, template)
  ckpt.close()
  _assert_same_update(state['params'], state['opt_state'], runs.train_rows(wd), colocated_ref)


@pytest.mark.slow
def test_tcss_trains_on_samples_at_most_one_version_old(tmp_path):
  """TCSS with nft: up to half of a batch's fragments may come from the previous sampling
  policy (docs/design.md#objectives: the loss takes them as they are); rows report the mix."""
  wd = str(tmp_path / 'run')
  c = configlib.set_disagg(
      _tiny(
          'nft',
          **{
              'schedule.fragments': 4,
              'schedule.fragment_unit': 'sample',
              'schedule.tcss_fraction': 0.5,
          },
      ),
      trainer=(0, 1),
      rollout=(2, 3),
  )
  out = loop.train(experiment.build(c, wd, 2), wd, cluster_lib.resolve(run_lib.cluster_spec(c)))
  rows = runs.train_rows(wd)
  assert [r['step'] for r in rows] == [1, 2, 3]
  for r in rows:
    mix = r['staleness_mix']
    assert set(mix) == {'0', '1'} and mix['1'] <= 0.5 + 1e-9
    assert np.isfinite(r['loss']) and r['nonfinite'] == 0
  assert any(r['staleness_mix']['1'] > 0 for r in rows[1:])
  assert all(np.isfinite(x).all() for x in runs.leaves(out['params']))
