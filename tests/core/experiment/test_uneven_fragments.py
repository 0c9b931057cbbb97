"""Batches and fragments that do not divide the devices (experiment/fragments.py: padded with
weight-0 rows to a multiple of the roles' device counts): the plan, the config and cluster
checks that no longer refuse them, the update programs on 4 devices against one device, and
whole runs (colocated, GAP on two meshes, an uneven 3 + 1 split with TSP) against colocated on
one device."""

import json
import os

import jax
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.experiment import fragments
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.experiment import run as run_lib
from tests.mp_scripts import fragment_exactness as exactness

STEPS = 2
# Whole runs: the padded programs sum the same pairs in another order than one device does;
# parameters agree to ~1e-6 after 2 Adam steps that move them by ~2e-4 (as
# tests/core/runtime/test_schedule_modes.py's schedules do).
PARAM_ATOL = 1e-5


def test_plan_pads_a_fragment_to_the_devices():
  plan = fragments.FragmentPlan(groups=2, group_size=3, num=1, unit='group', devices=4)
  assert (plan.size, plan.rows) == (6, 8)
  assert plan.pad_prompts(list('abcdef')) == list('abcdefab')
  plan = fragments.FragmentPlan(groups=2, group_size=3, num=3, unit='sample', devices=3)
  assert (plan.size, plan.rows, list(plan.samples(2))) == (2, 3, [4, 5])
  assert fragments.FragmentPlan(2, 4, 2, 'group', devices=2).rows == 4  # even: no padding


def _tiny(**overrides):
  over = {'total_steps': STEPS, 'rl.group_size': 3, 'eval.every': 0, **overrides}
  return configlib.apply_overrides(qwenimage.get_config('tiny'), over)


def test_a_batch_the_devices_do_not_divide_is_valid_and_padded():
  plan = configlib.validate(_tiny(), 4)  # 2 prompts x 3 samples on 4 devices
  assert (plan.size, plan.rows, plan.devices) == (6, 8, 4)
  c = configlib.set_disagg(_tiny(), trainer=(0, 1, 2), rollout=(3,))
  cluster = cluster_lib.resolve(run_lib.cluster_spec(c), jax.devices()[:4])
  assert (cluster.trainer.size, cluster.rollout.size) == (3, 1)


@pytest.mark.parametrize('program', ['update', 'grad'])
@pytest.mark.slow
def test_six_samples_on_four_devices_update_as_on_one(program, tmp_path):
  """The fused update, and the fragment gradient (no TSP) then the optimizer step, of 6
  samples padded to 8 rows on 4 devices: the one-device update of the 6 samples."""
  case = {'K': 5, 'B': 6, 'program': program, 'workdir': str(tmp_path)}
  exactness.check(exactness.run_case(case, jax.devices()[:4]))


# ------------------------------------------------------------------------------ whole runs


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _rows(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return [r for r in rows if 'reward_mean' in r]


def _run(config, workdir, cluster, num_devices):
  out = loop.train(experiment.build(config, workdir, num_devices), workdir, cluster)
  out['rows'] = _rows(workdir)
  return out


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
  """Colocated on one device: no padding anywhere."""
  wd = str(tmp_path_factory.mktemp('one_device'))
  out = _run(_tiny(), wd, cluster_lib.colocated(jax.devices()[:1]), 1)
  init = experiment.build_model(_tiny())[2]
  moved = max(float(np.abs(a - b).max()) for a, b in zip(_leaves(out['params']), _leaves(init)))
  assert moved > 10 * PARAM_ATOL, 'the updates are too small for the tolerance to mean much'
  return out


def _assert_same_run(out, ref):
  for x, y in zip(_leaves(out['params']), _leaves(ref['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=PARAM_ATOL)
  for x, y in zip(_leaves(out['opt_state']), _leaves(ref['opt_state'])):
    if x.dtype.kind == 'f' and x.size:
      np.testing.assert_allclose(x, y, atol=1e-3 * float(np.abs(y).max()) + 1e-12)
  assert len(out['rows']) == len(ref['rows']) == STEPS
  for a, b in zip(out['rows'], ref['rows']):
    # The padding rows are never scored, valid or counted.
    assert a['reward_mean'] == pytest.approx(b['reward_mean'], rel=1e-5, abs=1e-6)
    assert a['valid_frac'] == b['valid_frac']
    assert a['weight_sum'] == b['weight_sum']
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-3)
    assert abs(a['ratio_mean'] - 1.0) < 1e-5


@pytest.mark.slow
def test_colocated_on_four_devices_equals_one_device(one_device, tmp_path):
  """6 samples on 4 devices: sampled and trained as 8 rows, 2 of them weight 0."""
  out = _run(_tiny(), str(tmp_path), cluster_lib.colocated(jax.devices()[:4]), 4)
  _assert_same_run(out, one_device)


@pytest.mark.slow
def test_gap_on_two_meshes_with_padded_fragments_equals_one_device(one_device, tmp_path):
  """Disaggregated 2 + 2 devices, GAP by group (M = 2: 3 samples a fragment, 4 rows on each
  mesh): the rollout samples the padding rows, the trainer gives them weight 0."""
  c = configlib.set_disagg(
      _tiny(**{'schedule.fragments': 2}), trainer=(0, 1), rollout=(2, 3)
  )  # fmt: skip
  out = _run(c, str(tmp_path), cluster_lib.resolve(run_lib.cluster_spec(c), jax.devices()[:4]), 2)
  _assert_same_run(out, one_device)
  assert all(r['fragments'] == 2 for r in out['rows'])


@pytest.mark.slow
def test_uneven_split_with_tsp_equals_one_device(one_device, tmp_path):
  """Trainer on 3 devices, rollout on 1, GAP by sample (M = 3: 2 samples a fragment, 3 rows):
  the rollout samples 2 rows and repeats one, the trainer's TSP grid (t = 3, b = 1) computes
  the 2 real rows only."""
  c = configlib.set_disagg(
      _tiny(**{'schedule.fragments': 3, 'schedule.fragment_unit': 'sample', 'schedule.tsp': True}),
      trainer=(0, 1, 2),
      rollout=(3,),
  )
  cluster = cluster_lib.resolve(run_lib.cluster_spec(c), jax.devices()[:4])
  out = _run(c, str(tmp_path), cluster, 3)
  _assert_same_run(out, one_device)
