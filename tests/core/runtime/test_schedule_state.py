"""The schedule state machine (runtime/schedule.py) driven by the simulator's virtual clock
(perf/engine.py, through runtime/roles.py's handlers) and synthetic costs: no devices, no
threads, no compilation."""

import math

import pytest

from digen_jax.runtime import bts
from digen_jax.runtime import roles
from digen_jax.experiment import fragments
from digen_jax.runtime import schedule as sched
from digen_jax.perf import engine

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


def _simulate(plan, steps, *, start=0, with_tag=False, phi=0.0, final_policy=False, **costs):
  """Runs both roles on perf/engine.py's virtual clock (runtime/roles.py's handlers, each role
  its own Schedule): every action takes its cost in seconds. Returns the log [(t, role,
  action)] of what the roles took (actions, lost claims) and the Result (spans, makespan)."""
  c = dict(COSTS, **costs)
  sim = engine.Simulation(
      engine.StepCosts(
          rollout=c['roll'],
          grad=c['train'],
          apply=c['apply'],
          tag_rollout=c['switch'] + c['tag'],
          publish=c['publish'],
          pull=c['pull'],
          deliver=c['deliver'],
          gap=c['gap'],
      ),
      engine.Layout(),
      engine.Modes(fragments=plan.num, unit=plan.unit, tag=with_tag, tcss_fraction=phi),
      groups=plan.groups,
      group_size=plan.group_size,
      steps=steps,
      start=start,
      final_policy=final_policy,
  )
  result = sim.run()
  return _taken(sim.log), result


def _taken(log):
  """The log without the samples whose claim the other role had won (and their ClaimLost)."""
  lost = {(r, a.step, a.index) for _, r, a in log if isinstance(a, roles.ClaimLost)}
  return [
      (t, r, a)
      for t, r, a in log
      if not isinstance(a, roles.ClaimLost)
      and not (isinstance(a, sched.SampleFragment) and (r, a.step, a.index) in lost)
  ]


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
  log, _ = _simulate(
      plan, 4, with_tag=case['tag'], phi=case['phi'], final_policy=True, **case['costs']
  )
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
  log, result = _simulate(_plan(num=1, unit='group'), 4, start=start)
  trainer = [a for _, r, a in log if r == sched.TRAINER and not isinstance(a, sched.Wait)]
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
  spans = {(x.program, x.version): x for x in result.spans}
  for s in range(start + 1, 4):
    assert (
        spans[('rollout', s)].t0
        >= spans[('publish', s)].t1
        == (spans[('publish', s)].t0 + COSTS['publish'])
    )


def test_tag_inserts_only_when_bts_predicts_a_shorter_makespan():
  plan = _plan(num=8)
  slow_rollout = dict(roll=2.0, train=0.1, tag=0.5)
  log, with_tag = _simulate(plan, 3, with_tag=True, **slow_rollout)
  inserts = _actions(log, sched.SampleFragment, sched.TRAINER)
  assert inserts, 'a slow rollout leaves bubbles BTS fills'
  for a in inserts:
    d = a.decision
    assert d['action'] == 'insert' and d['makespan_insert'] < d['makespan_wait']
    assert a.version == a.step  # the trainer's params are the published
  waits = [a.decision for _, _, a in log if isinstance(a, sched.Wait) and a.decision]
  assert all(d['action'] == 'wait' for d in waits)
  assert all(d['makespan_insert'] >= d['makespan_wait'] for d in waits if 'makespan_wait' in d)
  _, plain = _simulate(plan, 3, **slow_rollout)
  assert with_tag.makespan < plain.makespan
  # A trainer far slower at sampling than the rollout helps twice: before its sampling cost is
  # measured (BTS then estimates it from the rollout's), once more because a single measurement
  # may be a cold start, never after the second confirms it.
  log, _ = _simulate(plan, 3, with_tag=True, roll=0.5, train=0.1, tag=20.0)
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
  # A slow update: the rollout finishes its share long before the next publish.
  log, _ = _simulate(plan, 5, phi=phi, roll=0.1, train=0.5, apply=1.0)
  stale = {}
  for a in _actions(log, sched.SampleFragment):
    assert a.step - a.version in (0, 1)
    if a.version < a.step:
      stale.setdefault(a.step, []).append(a.index)
  assert stale, 'a slow trainer leaves the rollout time for stale fragments'
  assert 0 not in stale  # nothing precedes the first batch
  assert all(len(v) <= math.floor(phi * m + 1e-9) for v in stale.values())
  # Without TCSS nothing is stale.
  log, _ = _simulate(plan, 5, roll=0.1, train=0.5, apply=1.0)
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
