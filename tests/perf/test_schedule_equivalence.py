"""The schedule's roles are written once (runtime/roles.py): every mode, run through the runtime
on CPU devices and through the simulator, takes the same actions per role in the same order.

Each mode runs STEPS optimizer steps of the tiny config through runtime/loop.train in one
process (colocated on devices 0-1; disaggregated: trainer 0-1, rollout 2-3 in a thread), which
returns what each role's handlers took: the Schedule's actions, and ClaimLost where a role named
a fragment the other had claimed first. perf/engine.py then runs the same plan and modes on its
virtual clock, its programs costed at the run's own measured spans (trace.json), and logs what
the same handlers took there.

What is compared, per role, is the log without Wait: how often a role finds nothing to do
depends on how long each program takes to the millisecond, which no model reproduces.
- colocated, disagg, GAP, TSP: the logs are equal. Nothing in these modes depends on time: the
  rollout samples its batch in order after each policy, the trainer trains fragments in the
  order they become trainable and applies after the last.
- TCSS: whether the rollout starts a fragment of the next batch with its previous policy
  depends on whether the next one is published yet; the simulator is given the run's own
  answer at each such point (Simulation(policy_ready=...)), and the logs are then equal.
- TAG/BTS: BTS decides from measured times, so which fragments the trainer samples, and when
  it trains others in between, is the run's own. Compared: the rollout's log without lost
  claims (it names every fragment in order either way), the trainer's publishes and applies in
  order, and in each log every fragment claimed by exactly one role (what one lost the other
  sampled) and trained once, after it was sampled.
It fails when a role's handlers on devices and on the virtual clock take different actions from
the same Schedule state: a lost claim handled on one side only, a publish before the optimizer
step on one side, a step ended or a policy received at another point, a stale fragment that one
side starts and the other does not given the same answer.
"""

import collections
import dataclasses
import json
import os
import statistics
import time

import jax
import pytest

from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.experiment import run as run_lib
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.runtime import roles
from digen_jax.runtime import schedule as sched
from digen_jax.perf import engine

STEPS = 2
GAP = {'schedule.fragments': 4, 'schedule.fragment_unit': 'sample'}
MODES = {
    'colocated': {},
    'disagg': {},
    'gap': GAP,
    'tsp': {'schedule.fragments': 2, 'schedule.tsp': True},
    'tag': {**GAP, 'schedule.tsp': True, 'schedule.tag': True},
    'tcss': {**GAP, 'schedule.tcss_fraction': 0.5},
}


def _run(mode: str, workdir: str):
  """(config, {role: actions}, {program: median seconds}) of a runtime run of `mode`."""
  c = configlib.apply_overrides(qwenimage.get_config('tiny'), {'total_steps': STEPS, **MODES[mode]})
  if mode != 'colocated':
    configlib.set_disagg(c, trainer=(0, 1), rollout=(2, 3))
  exp = experiment.build(c, workdir, 2)
  if mode == 'tag':  # sampling slower than training: BTS has bubbles to fill
    score = exp.reward_fn

    def slow(images, prompts):
      time.sleep(0.4)
      return score(images, prompts)

    exp = dataclasses.replace(exp, reward_fn=slow)
  cluster = (
      cluster_lib.colocated(jax.devices()[:2])
      if mode == 'colocated'
      else cluster_lib.resolve(run_lib.cluster_spec(c))
  )
  out = loop.train(exp, workdir, cluster)
  events = json.load(open(os.path.join(workdir, 'trace.json')))['traceEvents']
  durations = collections.defaultdict(list)
  for e in events:
    if e['ph'] == 'X':
      durations[e['name']].append(e['dur'] * 1e-6)
  return c, out['actions'], {k: statistics.median(v) for k, v in durations.items()}


def _simulate(mode, c, spans, runtime_rollout):
  """The simulator's log {role: [what the handlers took]} for the run of `mode`."""
  s = c.schedule
  costs = engine.StepCosts(
      rollout=spans['rollout'],
      grad=spans.get('grad', spans.get('update')),
      apply=spans.get('apply', 0.0),
      tag_rollout=spans.get('tag_rollout', spans['rollout']),
      publish=spans.get('publish', 0.0),
  )
  layout = engine.Layout(2, 2, colocated=mode == 'colocated')
  modes = engine.Modes(s.fragments, s.fragment_unit, s.tsp, s.tag, s.tcss_fraction)
  sim = None

  def replayed(step):
    # The run's own answer at the same point of the rollout's log: did it receive the policy
    # next (published), or start a stale fragment (not yet)?
    n = len([a for _, r, a in sim.log if r == sched.ROLLOUT])
    return isinstance(runtime_rollout[n], sched.ReceivePolicy)

  sim = engine.Simulation(
      costs,
      layout,
      modes,
      groups=c.rl.prompts_per_step,
      group_size=c.rl.group_size,
      steps=STEPS,
      final_policy=c.eval.every > 0,
      policy_ready=replayed if mode == 'tcss' else None,
  )
  sim.run()
  log = {sched.TRAINER: [], sched.ROLLOUT: []}
  for _, role, action in sim.log:
    log[role].append(action)
  return log


def _no_waits(actions):
  return [a for a in actions if not isinstance(a, sched.Wait)]


def _check_tag_log(log, num):
  """Each fragment named by the rollout, claimed by exactly one role (what one lost the other
  sampled), trained once and after it was sampled; returns the fragments the trainer sampled."""
  every = {(s, f) for s in range(STEPS) for f in range(num)}
  named = {(a.step, a.index) for a in log[sched.ROLLOUT] if isinstance(a, sched.SampleFragment)}
  assert named == every
  won, lost, at = collections.defaultdict(list), set(), {}
  for role, actions in log.items():
    lost |= {(a.step, a.index, role) for a in actions if isinstance(a, roles.ClaimLost)}
  for role, actions in log.items():
    for i, a in enumerate(actions):
      if isinstance(a, sched.SampleFragment) and (a.step, a.index, role) not in lost:
        won[(a.step, a.index)].append(role)
        at[(a.step, a.index)] = (role, i)
  assert set(won) == every and all(len(w) == 1 for w in won.values()), dict(won)
  assert all(won[(s, f)] != [r] for s, f, r in lost), (lost, dict(won))
  trained = {}
  for i, a in enumerate(log[sched.TRAINER]):
    if isinstance(a, sched.TrainFragment):
      assert (a.step, a.index) not in trained, a
      trained[(a.step, a.index)] = i
      role, j = at[(a.step, a.index)]
      assert role == sched.ROLLOUT or j < i, a  # a trainer-sampled fragment: sampled first
  assert set(trained) == every
  return sorted(k for k, w in won.items() if w == [sched.TRAINER])


@pytest.mark.slow
@pytest.mark.parametrize('mode', list(MODES))
def test_runtime_and_simulator_take_the_same_actions(mode, tmp_path):
  c, runtime, spans = _run(mode, str(tmp_path))
  assert set(runtime) == {sched.TRAINER, sched.ROLLOUT}
  run_t, run_r = _no_waits(runtime[sched.TRAINER]), _no_waits(runtime[sched.ROLLOUT])
  sim = _simulate(mode, c, spans, run_r)
  sim_t, sim_r = _no_waits(sim[sched.TRAINER]), _no_waits(sim[sched.ROLLOUT])
  num = c.schedule.fragments
  if mode != 'tag':
    assert run_r == sim_r
    assert run_t == sim_t
    if mode == 'tcss':  # the replay did meet a stale window (else this is GAP again)
      assert any(isinstance(a, sched.SampleFragment) and a.version < a.step for a in run_r)
    return
  not_lost = lambda actions: [a for a in actions if not isinstance(a, roles.ClaimLost)]
  assert not_lost(run_r) == not_lost(sim_r)
  order = lambda actions: [a for a in actions if isinstance(a, (sched.Publish, sched.Apply))]
  assert order(run_t) == order(sim_t)
  assert _check_tag_log({sched.TRAINER: run_t, sched.ROLLOUT: run_r}, num), 'BTS never inserted'
  _check_tag_log({sched.TRAINER: sim_t, sched.ROLLOUT: sim_r}, num)
