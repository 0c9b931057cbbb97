"""Numerical faults: a NaN/inf reward, advantage, loss or gradient skips its
update (counted in metrics.jsonl) and never reaches the weights or the optimizer state; K skips
in a row stop the run with a clear error and the last good checkpoint intact; a reward that
raises or hangs is reported with the prompt that caused it."""

import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.outputs import faults
from digen_jax.rewards import registry
from digen_jax.rl import advantages
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop

# ------------------------------------------------------------------------------------- units


def test_a_nan_reward_poisons_only_its_group_and_is_not_zeroed():
  r = jnp.array([0.1, 0.9, 0.3, 0.5, np.nan, 0.2, 0.4, 0.4])
  adv, valid = advantages.grpo_advantages(r, 2)
  adv, valid = np.asarray(adv), np.asarray(valid)
  assert np.all(np.isnan(adv[4:6])) and not valid[4:6].any()
  ref, _ = advantages.grpo_advantages(r[:4], 2)
  np.testing.assert_array_equal(adv[:4], np.asarray(ref))  # other groups untouched
  assert np.all(adv[6:] == 0) and not valid[6:].any()  # zero spread: still 0
  adv_g, _ = advantages.grpo_advantages(r.at[4].set(np.inf), 2, std_mode='global')
  assert np.isnan(np.asarray(adv_g)[:6]).all()  # global std: every group with spread


def _images(n):
  return np.zeros((n, 4, 4, 3), np.float32)


def test_guarded_reward_names_the_prompt_that_raises(caplog):
  def fn(images, prompts):
    if any('bad' in p for p in prompts):
      raise ValueError('cannot parse')
    return np.arange(len(prompts), dtype=np.float32) + 1

  prompts = ['a red circle', 'a bad prompt', 'two blue squares', 'a red circle']
  with caplog.at_level(logging.ERROR):
    out = registry.guarded(fn)(_images(4), prompts)
  assert np.isnan(out[1]) and list(out[[0, 2, 3]]) == [1, 1, 1]  # each scored alone
  msgs = ' '.join(r.getMessage() for r in caplog.records)
  assert "ValueError: cannot parse on prompt 'a bad prompt' (sample 1 of 4)" in msgs


def test_guarded_reward_turns_nan_scores_into_named_faults(caplog):
  def fn(images, prompts):
    return np.array([np.nan if p == 'x' else 0.5 for p in prompts], np.float32)

  g = registry.guarded(fn)
  with caplog.at_level(logging.ERROR):
    out = g(_images(3), ['y', 'x', 'y'])
  assert np.isnan(out[1]) and out[0] == out[2] == 0.5
  assert len(g.faults) == 1 and "on prompt 'x'" in g.faults[0]
  assert list(g(_images(2), ['y', 'y'])) == [0.5, 0.5] and g.faults == []


def test_a_reward_that_fails_on_every_sample_logs_one_line(caplog):
  """All-NaN scores on a batch of 64: one error line with the count and the first fault, and
  what happens next as config.reward.failed says, not a line per sample."""
  g = registry.guarded(lambda im, p: np.full(len(p), np.nan, np.float32), on_failure='mask')
  with caplog.at_level(logging.ERROR):
    out = g(_images(64), [f'prompt {i}' for i in range(64)])
  assert np.isnan(out).all() and len(g.faults) == 64
  errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
  assert len(errors) == 1, errors
  assert errors[0].startswith('64 faults in a batch of 64 samples; the first: reward raised ')
  assert "on prompt 'prompt 0'" in errors[0] and 'masked out of their groups' in errors[0]
  caplog.clear()
  skip = registry.guarded(lambda im, p: np.full(len(p), np.nan, np.float32), on_failure='skip')
  with caplog.at_level(logging.ERROR):
    skip(_images(2), ['a', 'b'])
  assert 'the update is skipped' in caplog.records[-1].getMessage()


def test_guarded_reward_times_out_and_does_not_pile_up_threads():
  gate = {'sleep': 5.0}

  def slow(images, prompts):
    time.sleep(gate['sleep'])
    return np.zeros(len(prompts), np.float32)

  g = registry.guarded(slow, timeout_s=0.2)
  t = time.perf_counter()
  out = g(_images(2), ['p', 'q'])
  assert time.perf_counter() - t < 2.0 and np.isnan(out).all()
  assert 'timed out' in g.faults[0] and "'p', 'q'" in g.faults[0]
  assert 'config.reward.timeout_s' in g.faults[0]
  gate['sleep'] = 0.0
  out = g(_images(2), ['p', 'q'])  # the hung call still runs: fail at once
  assert np.isnan(out).all() and 'still running' in g.faults[0]


def test_guarded_reward_batch_level_failure_fails_the_batch():
  def only_singles(images, prompts):
    if len(prompts) > 1:
      raise RuntimeError('batch too large')
    return np.ones(1, np.float32)

  g = registry.guarded(only_singles)
  out = g(_images(3), ['a', 'b', 'c'])
  assert list(out) == [1, 1, 1] and g.faults == []  # scored one at a time: no fault remains


@pytest.mark.parametrize(
    'field, value, match',
    [
        ('runtime.max_consecutive_skips', 0, 'max_consecutive_skips=0 must be an int >= 1'),
        ('reward.timeout_s', -1.0, 'timeout_s=-1.0 must be a finite number'),
        ('reward.timeout_s', float('inf'), 'timeout_s=inf must be a finite number'),
    ],
)
def test_fault_settings_are_validated(field, value, match):
  config = configlib.apply_overrides(qwenimage.get_config('tiny'), {field: value})
  with pytest.raises(ValueError, match=match):
    configlib.validate(config, 2)


@registry.register('test_faults_overflowing')
def _overflowing_reward(images, prompts):
  """1e38 (finite in float32) on prompts that say 'huge', else 0.5."""
  return np.asarray([1e38 if 'huge' in p else 0.5 for p in prompts], np.float32)


def test_a_finite_score_too_large_for_the_statistics_counts_as_failed(caplog):
  """A reward of 1e38 is finite, but its group's float32 statistics overflow (reward_mean inf,
  nothing learned): it counts as failed, named in one line."""
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top
  from digen_jax.rewards import scoring  # pylint: disable=g-import-not-at-top

  r = configlib.base_config().reward
  r.weights = 'test_faults_overflowing:1'
  rewards = scoring.build(r, registry.parse_weights(r.weights))
  try:
    with caplog.at_level(logging.ERROR):
      s = rewards.submit(_images(4), ['a', 'a huge one', 'b', 'huge']).result()
  finally:
    rewards.close()
  assert s.failed == 2 and list(np.isnan(s.total)) == [False, True, False, True]
  assert list(s.total[[0, 2]]) == [0.5, 0.5]
  line = caplog.records[-1].getMessage()
  assert line.startswith("2 scores beyond +-1e+15 (the first: reward 'test_faults_overflowing' ")
  assert 'count as failed' in line and s.faults == [line]


@registry.register('test_faults_parser')
def _parsing_reward(images, prompts):
  """A task reward that parses its prompts (as ShapesBench's does): others raise."""
  if not all(p.startswith('task:') for p in prompts):
    raise ValueError(f'cannot parse prompt {prompts[0]!r}')
  return np.full(len(prompts), np.nan if 'nan' in prompts[0] else 0.5, np.float32)


def test_the_probe_fails_a_reward_that_cannot_score_the_runs_prompts():
  """Before: the probe swallowed the error and the run compiled for minutes before every call
  failed. Now one line before anything compiles; a NaN on the grey probe images passes (masked
  at run time)."""
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top
  from digen_jax.rewards import scoring  # pylint: disable=g-import-not-at-top

  r = configlib.base_config().reward
  r.weights = 'test_faults_parser:1'
  rewards = scoring.build(r, registry.parse_weights(r.weights))
  try:
    with pytest.raises(ValueError) as e:
      rewards.probe(['a cat on a mat'])
    said = str(e.value)
    assert said.startswith("config.reward.weights='test_faults_parser:1': a probe batch")
    assert "reward 'test_faults_parser' raised ValueError: cannot parse prompt 'a cat" in said
    rewards.probe(['task: two circles'])
    rewards.probe(['task: nan'])
  finally:
    rewards.close()


# --------------------------------------------------------------------------------- end to end

_PLAN = {'nan_at': set(), 'raise_at': set(), 'calls': 0, 'prompts': {}, 'bad': None}


@registry.register('test_faults_scripted')
def _scripted_reward(images, prompts):
  """Mean brightness, except at the scripted calls (1-based batch calls: one per step, or one
  per fragment): the first prompt of that call scores NaN (nan_at) or raises (raise_at), also
  when the guard retries its samples one at a time."""
  if len(prompts) > 1:  # a batch call, not the guard's one-sample retry
    _PLAN['calls'] += 1
    call = _PLAN['calls']
    _PLAN['prompts'][call] = list(prompts)
    hit = call in _PLAN['nan_at'] | _PLAN['raise_at']
    _PLAN['bad'] = (prompts[0], 'nan' if call in _PLAN['nan_at'] else 'raise') if hit else None
  bad = _PLAN['bad']
  if bad and bad[1] == 'raise' and bad[0] in prompts:
    raise KeyError('scripted failure')
  r = np.asarray(images, np.float32).mean(axis=(1, 2, 3))
  if bad and bad[1] == 'nan':
    r[[i for i, p in enumerate(prompts) if p == bad[0]]] = np.nan
  return r


def _config(total_steps, **overrides):
  return configlib.apply_overrides(
      qwenimage.get_config('tiny'),
      {
          'total_steps': total_steps,
          'reward.weights': 'test_faults_scripted',
          'keep_checkpoints': 10,
          **overrides,
      },
  )


def _restore(wd, step, exp_state):
  ck = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  state, _ = ck.restore(step, exp_state)
  ck.close()
  return jax.device_get(state)


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def _moved(a, b) -> bool:
  return any(np.any(x != y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
def test_nan_rewards_skip_updates_and_k_in_a_row_stop_the_run(tmp_path):
  """reward.failed='skip': steps 2, 4 and 5 get a NaN reward; with max_consecutive_skips=2 the
  run stops at step 5.
  Skipped steps leave params and optimizer state bitwise unchanged; checkpoint 4 is the last."""
  _PLAN.update(nan_at={2, 4, 5}, raise_at=set(), calls=0, prompts={}, bad=None)
  wd = str(tmp_path / 'run')
  config = _config(6, **{'runtime.max_consecutive_skips': 2, 'reward.failed': 'skip'})
  exp = experiment.build(config, wd, 2)
  _PLAN.update(calls=0, prompts={}, bad=None)  # the build's probe batch is no step's call
  with pytest.raises(faults.NonFiniteError) as e:
    loop.train(exp, wd, cluster_lib.colocated(jax.local_devices()[:2]))
  msg = str(e.value)
  assert msg.startswith('2 consecutive updates skipped') and 'last checkpoint (step 4)' in msg
  assert repr(_PLAN['prompts'][5][0]) in msg and 'step 4:' in msg and 'step 5:' in msg
  rows = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'))]
  assert [r['step'] for r in rows] == [1, 2, 3, 4, 5]
  assert [r['nonfinite'] for r in rows] == [0, 1, 0, 1, 1]
  assert [r['skipped_updates'] for r in rows] == [0, 1, 1, 2, 3]
  assert [r['nonfinite_rewards'] for r in rows] == [0, 4, 0, 4, 4]  # a group each
  assert all(np.isfinite(r['reward_mean']) for r in rows)  # over the finite rewards
  ck = ckpt_lib.Checkpointer(os.path.join(wd, 'checkpoints'))
  assert ck.all_steps() == [1, 2, 3, 4]
  ck.close()
  template = {
      'params': exp.params,
      'opt_state': exp.optimizer.init(exp.params),
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  s = {k: _restore(wd, k, template) for k in (1, 2, 3, 4)}
  _assert_same(s[1]['params'], s[2]['params'])
  _assert_same(s[1]['opt_state'], s[2]['opt_state'])
  assert _moved(s[2]['params'], s[3]['params'])  # a good step trains
  _assert_same(s[3]['params'], s[4]['params'])
  _assert_same(s[3]['opt_state'], s[4]['opt_state'])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(s[4]))


@pytest.mark.slow
def test_gap_fragments_skip_a_batch_whose_reward_raises(tmp_path, caplog):
  """reward.failed='skip': the pipelined schedule (GAP, 2 fragments on one mesh) accumulates per-fragment gradients:
  a reward that raises on one prompt of step 2 makes that fragment's advantages NaN, and the
  one optimizer step of the batch is skipped; the error names the prompt."""
  # Two reward calls per step (one per fragment): call 3 is step 2's first fragment.
  _PLAN.update(nan_at=set(), raise_at={3}, calls=0, prompts={}, bad=None)
  wd = str(tmp_path / 'run')
  config = _config(3, **{'schedule.fragments': 2, 'schedule.trace': False, 'reward.failed': 'skip'})
  exp = experiment.build(config, wd, 2)
  _PLAN.update(calls=0, prompts={}, bad=None)  # the build's probe batch is no step's call
  with caplog.at_level(logging.ERROR):
    loop.train(exp, wd, cluster_lib.colocated(jax.local_devices()[:2]))
  rows = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'))]
  assert [r['nonfinite'] for r in rows] == [0, 1, 0]
  assert [r['skipped_updates'] for r in rows] == [0, 1, 1]
  bad = _PLAN['prompts'][3][0]
  logged = ' '.join(r.getMessage() for r in caplog.records)
  assert f"KeyError: 'scripted failure' on prompt {bad!r}" in logged, logged
  template = {
      'params': exp.params,
      'opt_state': exp.optimizer.init(exp.params),
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  s = {k: _restore(wd, k, template) for k in (1, 2, 3)}
  _assert_same(s[1]['params'], s[2]['params'])
  _assert_same(s[1]['opt_state'], s[2]['opt_state'])
  assert _moved(s[2]['params'], s[3]['params'])


@pytest.mark.slow
def test_failed_rewards_are_masked_out_of_their_group_and_the_step_trains(tmp_path):
  """reward.failed='mask' (the default): step 2's NaN group is left out of the advantages (it
  counts in reward_failed, valid_frac drops by its share), the update is not skipped and
  trains on the other group; a step where every reward failed is skipped and counted."""
  _PLAN.update(nan_at={2}, raise_at=set(), calls=0, prompts={}, bad=None)
  wd = str(tmp_path / 'run')
  exp = experiment.build(_config(3), wd, 2)
  _PLAN.update(calls=0, prompts={}, bad=None)  # the build's probe batch is no step's call
  loop.train(exp, wd, cluster_lib.colocated(jax.local_devices()[:2]))
  rows = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'))]
  assert [r['nonfinite'] for r in rows] == [0, 0, 0]
  assert [r['skipped_updates'] for r in rows] == [0, 0, 0]
  assert [r['reward_failed'] for r in rows] == [0, 4, 0]  # one prompt's group of 4
  assert rows[1]['valid_frac'] <= 0.5 < rows[0]['valid_frac']
  template = {
      'params': exp.params,
      'opt_state': exp.optimizer.init(exp.params),
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  s = {k: _restore(wd, k, template) for k in (1, 2)}
  assert _moved(s[1]['params'], s[2]['params'])  # step 2 trained on the group that scored
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(s[2]))


def test_masking_failed_rewards_keeps_clean_groups_bitwise():
  r = jnp.array([0.1, 0.9, 0.3, 0.5, np.nan, 0.2, 0.7, 0.4, 0.3, 0.6, 0.2, 0.9])
  adv, valid = (np.asarray(x) for x in advantages.grpo_advantages(r, 3, mask_failed=True))
  ref, ref_valid = (np.asarray(x) for x in advantages.grpo_advantages(r, 3))
  clean = np.r_[0:3, 6:12]
  np.testing.assert_array_equal(adv[clean], ref[clean])  # groups without a failure: as before
  np.testing.assert_array_equal(valid[clean], ref_valid[clean])
  # The failed sample: adv 0, invalid; its group normalised over the other two (0.5, 0.2).
  assert adv[4] == 0 and not valid[4] and valid[3] and valid[5]
  np.testing.assert_allclose(adv[[3, 5]], [0.15 / (0.15 + 1e-4), -0.15 / (0.15 + 1e-4)], 1e-5)
  assert np.all(np.isfinite(adv))
  # A group left with one sample has no signal; every reward failed: non-finite (skipped).
  a1, v1 = advantages.grpo_advantages(jnp.array([np.nan, 0.3, 0.1, 0.2]), 2, mask_failed=True)
  assert list(np.asarray(v1)) == [False, False, True, True] and np.asarray(a1)[1] == 0
  a2, _ = advantages.grpo_advantages(jnp.full(4, np.nan), 2, mask_failed=True)
  assert np.isnan(np.asarray(a2)).all()


def test_multi_reward_advantages_normalise_each_reward_in_its_group():
  """combine='advantages': sum_k w_k A_k (each reward normalised within its group, DanceGRPO's
  multi-reward GRPO), so a reward on a 100x scale does not drown a small one; 'sum' normalises
  the weighted sum. A sample that failed on any reward is masked from all of them."""
  small = jnp.array([0.1, 0.3, 0.2, 0.4])
  big = jnp.array([50.0, 10.0, 20.0, 30.0])
  w = [1.0, 0.5]
  kw = dict(clip=None, eps=0.0)
  adv, _ = advantages.reward_advantages(jnp.stack([small, big]), w, 2, combine='advantages', **kw)
  a_s, _ = advantages.grpo_advantages(small, 2, **kw)
  a_b, _ = advantages.grpo_advantages(big, 2, **kw)
  np.testing.assert_allclose(np.asarray(adv), np.asarray(a_s + 0.5 * a_b), 1e-6)
  summed, _ = advantages.reward_advantages(jnp.stack([small, big]), w, 2, combine='sum', **kw)
  ref, _ = advantages.grpo_advantages(small + 0.5 * big, 2, **kw)
  np.testing.assert_allclose(np.asarray(summed), np.asarray(ref), 1e-6)
  parts = jnp.stack([small.at[0].set(np.nan), big])
  adv, valid = advantages.reward_advantages(parts, w, 2, combine='advantages', mask_failed=True)
  assert np.asarray(adv)[0] == 0 and not np.asarray(valid)[:2].any()
  assert np.all(np.isfinite(np.asarray(adv)))
