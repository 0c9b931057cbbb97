"""The schedule state machine (runtime/schedule.py) driven by a virtual clock and synthetic
costs: no devices, no threads, no compilation."""

import heapq
import itertools
import math

import pytest

from digen_jax.runtime import bts
from digen_jax.experiment import fragments
from digen_jax.runtime import schedule as sched

COSTS = dict(
    roll=1.0,
    train=0.3,
    tag=1.2,
    switch=0.05,
    publish=0.1,
    pull=0.1,
    apply=0.1,
    deliver=0.05,
    gap=0.02,
)


def _simulate(sm: sched.Schedule, **costs):
  """Runs both roles of `sm` on a virtual clock: every action takes its cost in seconds.
  Returns the log [(t, role, action)] of every non-Wait action as it started, and the end."""
  c = dict(COSTS, **costs)
  now = 0.0
  events, seq = [], itertools.count()
  busy = {sched.TRAINER: False, sched.ROLLOUT: False}
  done = {sched.TRAINER: False, sched.ROLLOUT: False}
  log = []

  def at(t, fn):
    heapq.heappush(events, (t, next(seq), fn))

  def free(role, fn=None):
    def finish():
      busy[role] = False
      if fn is not None:
        fn()

    return finish

  def run_trainer(a):
    if isinstance(a, sched.Publish):
      at(now + c['publish'], free(sched.TRAINER, lambda v=a.version: sm.published(v, now)))
    elif isinstance(a, sched.TrainFragment):
      at(now + c['train'], free(sched.TRAINER, lambda: sm.trained(a.step, a.index, c['train'])))
    elif isinstance(a, sched.Apply):
      at(now + c['apply'], free(sched.TRAINER, lambda: sm.applied(a.step)))
    elif isinstance(a, sched.SampleFragment):
      sm.claimed(a.step, a.index, sched.TRAINER, now)
      t0 = now

      def end():
        sm.fragment_arrived(a.step, a.index, a.version, sched.TRAINER)
        sm.sampled_by_trainer(c['tag'], now - t0)

      at(now + c['switch'] + c['tag'], free(sched.TRAINER, end))
    else:
      raise AssertionError(a)

  def run_rollout(a):
    if isinstance(a, sched.ReceivePolicy):
      at(now + c['pull'], free(sched.ROLLOUT, lambda: sm.policy_received(a.version)))
    elif isinstance(a, sched.SampleFragment):
      sm.claimed(a.step, a.index, sched.ROLLOUT, now)
      t0, t1 = now, now + c['roll']
      at(
          t1 + c['deliver'],
          lambda: sm.fragment_arrived(
              a.step,
              a.index,
              a.version,
              sched.ROLLOUT,
              sample_s=c['roll'],
              t_start=t0,
              t_end=t1,
              arrived=t1 + c['deliver'],
          ),
      )
      at(t1 + c['gap'], free(sched.ROLLOUT))
    elif isinstance(a, sched.EndRolloutStep):
      sm.rollout_step_ended(a.step)
      busy[sched.ROLLOUT] = False
    else:
      raise AssertionError(a)

  def kick():
    moved = True
    while moved:
      moved = False
      for role in (sched.TRAINER, sched.ROLLOUT):
        if busy[role] or done[role]:
          continue
        if role == sched.TRAINER:
          a = sm.trainer_action(now)
        else:
          ready = sm.stale_window() and sm.rollout_step in sm.published_at
          a = sm.rollout_action(next_policy_ready=ready)
          if isinstance(a, sched.ReceivePolicy) and a.version not in sm.published_at:
            continue  # waits for the publish
        if isinstance(a, sched.Done):
          done[role] = True
          continue
        if isinstance(a, sched.Wait):
          log.append((now, role, a)) if a.decision else None
          continue
        log.append((now, role, a))
        busy[role] = True
        (run_trainer if role == sched.TRAINER else run_rollout)(a)
        moved = True

  while True:
    kick()
    if not events:
      break
    now, _, fn = heapq.heappop(events)
    fn()
  assert all(done.values()), f'deadlock at t={now}: {busy}, {done}'
  return log, now


def _plan(groups=4, group_size=2, num=4, unit='sample'):
  return fragments.FragmentPlan(groups, group_size, num, unit)


def _actions(log, kind, role=None):
  return [a for _, r, a in log if isinstance(a, kind) and (role is None or r == role)]


CASES = [
    dict(num=m, unit=u, tag=tag, phi=phi, costs=costs)
    for m, u in ((1, 'group'), (2, 'group'), (4, 'group'), (4, 'sample'), (8, 'sample'))
    for tag in (False, True)
    for phi in (0.0, 0.5)
    for costs in (dict(), dict(roll=0.2, train=1.0), dict(roll=2.0, train=0.1, tag=0.5))
    if not (phi and m == 1)
]


@pytest.mark.parametrize(
    'case',
    CASES,
    ids=lambda c: f"M{c['num']}{c['unit'][0]}"
    f"{'-tag' if c['tag'] else ''}-phi{c['phi']}-{sorted(c['costs'].items())}",
)
def test_every_fragment_is_sampled_once_and_trained_once(case):
  plan = _plan(num=case['num'], unit=case['unit'])
  sm = sched.Schedule(
      plan, start=0, total_steps=4, tag=case['tag'], tcss_fraction=case['phi'], final_policy=True
  )
  log, _ = _simulate(sm, **case['costs'])
  every = {(s, f) for s in range(4) for f in range(plan.num)}
  sampled = [(a.step, a.index) for a in _actions(log, sched.SampleFragment)]
  trained = [(a.step, a.index) for a in _actions(log, sched.TrainFragment)]
  assert sorted(sampled) == sorted(every) and len(set(sampled)) == len(sampled)
  assert sorted(trained) == sorted(every) and len(set(trained)) == len(trained)
  assert [a.step for a in _actions(log, sched.Apply)] == [0, 1, 2, 3]
  assert [a.version for a in _actions(log, sched.Publish)] == [0, 1, 2, 3, 4]
  assert [a.version for a in _actions(log, sched.ReceivePolicy)] == [0, 1, 2, 3, 4]
  # A fragment is trained after it was sampled, and before its batch's optimizer step.
  order = {
      (type(a).__name__, getattr(a, 'step', None), getattr(a, 'index', None)): i
      for i, (_, _, a) in enumerate(log)
  }
  for s, f in every:
    assert (
        order[('SampleFragment', s, f)] < order[('TrainFragment', s, f)] < order[('Apply', s, None)]
    )
  if not case['tag']:
    assert not _actions(log, sched.SampleFragment, sched.TRAINER)


@pytest.mark.parametrize('start', [0, 2])
def test_one_fragment_is_the_colocated_order(start):
  """M = 1, no TAG/TCSS: publish, sample the batch, train it, apply, publish the next."""
  sm = sched.Schedule(_plan(num=1, unit='group'), start=start, total_steps=4)
  log, _ = _simulate(sm)
  trainer = [a for _, r, a in log if r == sched.TRAINER]
  rollout = [a for _, r, a in log if r == sched.ROLLOUT]
  expect_t, expect_r = [sched.Publish(start)], []
  for s in range(start, 4):
    expect_t += [sched.TrainFragment(s, 0), sched.Apply(s)]
    expect_t += [sched.Publish(s + 1)] if s + 1 < 4 else []
    expect_r += [
        sched.ReceivePolicy(s),
        sched.SampleFragment(s, 0, sched.ROLLOUT, s),
        sched.EndRolloutStep(s),
    ]
  assert trainer == expect_t and rollout == expect_r
  # Strictly sequential: nothing of a batch starts before the previous one's publish ended.
  times = {a: t for t, _, a in log}
  for s in range(start + 1, 4):
    assert times[sched.ReceivePolicy(s)] >= times[sched.Publish(s)] + COSTS['publish']


def test_tag_inserts_only_when_bts_predicts_a_shorter_makespan():
  plan = _plan(num=8)
  slow_rollout = dict(roll=2.0, train=0.1, tag=0.5)
  with_tag = sched.Schedule(plan, start=0, total_steps=3, tag=True)
  log, end_tag = _simulate(with_tag, **slow_rollout)
  inserts = _actions(log, sched.SampleFragment, sched.TRAINER)
  assert inserts, 'a slow rollout leaves bubbles BTS fills'
  for a in inserts:
    d = a.decision
    assert d['action'] == 'insert' and d['makespan_insert'] < d['makespan_wait']
    assert a.version == a.step  # the trainer's params are the published
  waits = [a.decision for _, _, a in log if isinstance(a, sched.Wait) and a.decision]
  assert all(d['action'] == 'wait' for d in waits)
  assert all(d['makespan_insert'] >= d['makespan_wait'] for d in waits if 'makespan_wait' in d)
  _, end_plain = _simulate(sched.Schedule(plan, start=0, total_steps=3), **slow_rollout)
  assert end_tag < end_plain
  # A trainer far slower at sampling than the rollout helps twice: before its sampling cost is
  # measured (BTS then estimates it from the rollout's), once more because a single measurement
  # may be a cold start, never after the second confirms it.
  log, _ = _simulate(
      sched.Schedule(plan, start=0, total_steps=3, tag=True), roll=0.5, train=0.1, tag=20.0
  )
  inserts = _actions(log, sched.SampleFragment, sched.TRAINER)
  assert len(inserts) == 2, [a.decision for a in inserts]
  assert not any(a.decision['c_tag_measured'] for a in inserts)


def test_trainer_action_is_the_bts_rule_on_the_state():
  """The decision equals runtime/bts.py's on the numbers the state implies."""
  plan = _plan(num=4)
  sm = sched.Schedule(plan, start=0, total_steps=2, tag=True)
  assert sm.trainer_action(0.0) == sched.Publish(0)
  sm.published(0, 0.5)
  a = sm.trainer_action(0.6)
  assert isinstance(a, sched.Wait) and a.decision['reason'] == 'costs not profiled yet'
  for name, v in (
      ('roll', 1.0),
      ('roll', 1.0),
      ('train', 0.2),
      ('train', 0.2),
      ('tag', 0.8),
      ('tag', 0.8),
  ):
    sm.costs.observe(name, v)
  sm.claimed(0, 0, sched.ROLLOUT, 0.7)
  assert sm.needs_claims()
  a = sm.trainer_action(1.0)
  want = bts.decide(sm.costs, now=1.0, rollout_free_at=1.7, in_flight=1, unclaimed=3, backlog=0)
  assert a.decision['action'] == want['action'] == 'insert'
  assert a.decision['makespan_insert'] == pytest.approx(want['makespan_insert'])
  assert a == sched.SampleFragment(0, 1, sched.TRAINER, 0)
  # Once the fragment is here the trainer trains rather than asking BTS.
  sm.fragment_arrived(0, 0, 0, sched.ROLLOUT)
  assert not sm.needs_claims() and sm.trainer_action(1.1) == sched.TrainFragment(0, 0)


@pytest.mark.parametrize('phi, m', [(0.5, 4), (0.25, 8), (0.3, 8), (1.0, 4)])
def test_tcss_stays_within_phi_and_one_version(phi, m):
  plan = _plan(num=m)
  sm = sched.Schedule(plan, start=0, total_steps=5, tcss_fraction=phi)
  # A slow update: the rollout finishes its share long before the next publish.
  log, _ = _simulate(sm, roll=0.1, train=0.5, apply=1.0)
  stale = {}
  for a in _actions(log, sched.SampleFragment):
    assert a.step - a.version in (0, 1)
    if a.version < a.step:
      stale.setdefault(a.step, []).append(a.index)
  assert stale, 'a slow trainer leaves the rollout time for stale fragments'
  assert 0 not in stale  # nothing precedes the first batch
  assert all(len(v) <= math.floor(phi * m + 1e-9) for v in stale.values())
  # Without TCSS nothing is stale.
  log, _ = _simulate(sched.Schedule(plan, start=0, total_steps=5), roll=0.1, train=0.5, apply=1.0)
  assert all(a.version == a.step for a in _actions(log, sched.SampleFragment))


def test_tcss_stops_once_the_next_policy_is_published():
  sm = sched.Schedule(_plan(num=4), start=0, total_steps=3, tcss_fraction=1.0)
  sm.policy_received(0)
  for f in range(4):
    a = sm.rollout_action()
    assert a == sched.SampleFragment(0, f, sched.ROLLOUT, 0)
    sm.claimed(0, f, sched.ROLLOUT, 0.0)
  assert sm.rollout_action() == sched.EndRolloutStep(0)
  sm.rollout_step_ended(0)
  assert sm.stale_window()
  assert sm.rollout_action(next_policy_ready=False) == sched.SampleFragment(1, 0, sched.ROLLOUT, 0)
  sm.claimed(1, 0, sched.ROLLOUT, 0.0)
  assert sm.rollout_action(next_policy_ready=True) == sched.ReceivePolicy(1)
  sm.policy_received(1)
  assert sm.rollout_action() == sched.SampleFragment(1, 1, sched.ROLLOUT, 1)


def test_fragments_claimed_elsewhere_are_skipped_and_bad_events_fail():
  sm = sched.Schedule(_plan(num=2), start=0, total_steps=1)
  sm.policy_received(0)
  sm.note_claims(0, {0: (sched.TRAINER, 0.0)})
  assert sm.rollout_action() == sched.SampleFragment(0, 1, sched.ROLLOUT, 0)
  with pytest.raises(ValueError, match='not scored'):
    sm.trained(0, 1)
  sm.fragment_arrived(0, 1, 0, sched.ROLLOUT)
  with pytest.raises(ValueError, match='arrived twice'):
    sm.fragment_arrived(0, 1, 0, sched.ROLLOUT)
  with pytest.raises(ValueError, match='1/2 fragments'):
    sm.trained(0, 1)
    sm.applied(0)
