"""The schedule's two roles written once: what each action does to the Schedule, in what order.

A role's turn asks its runtime/schedule.Schedule for the next action and runs it through an
executor. The executor owns the devices and the clock; these handlers own the order of the
state machine's effects around what the executor runs. runtime/loop.py (the trainer) and
runtime/rollout.py (the rollout) are executors that run the real programs and call each
completion at once; perf/engine.py is an executor that charges modelled seconds on a virtual
clock and calls each completion when its program ends there.

The trainer's executor (`TrainerSide`) and the rollout's (`RolloutSide`) take these calls:

  trainer                                      rollout
  now() -> seconds                             now() -> seconds
  claims(step) -> {index: (role, t)}           policy_ready(step) -> bool (TCSS: published?)
  claim(step, index, role) -> bool (won it)    claim(step, index, role) -> bool (won it)
  publish(version, done(t_end))                flush() (before any action but a sample)
  after_publish(version)                       pull_policy(version, done())
  train(step, index, done(seconds))            after_receive(version)
  apply(step, done())                          sample(step, index, version)
  after_apply(step)                            end_rollout_step(step)
  tag_sample(step, index, done(device_s, wall_s))
  decided(decision)    (a BTS record)          took(action)
  wait_fragment()      (until one arrives)
  took(action)         (the action log: an action, or a ClaimLost)

A completion (`done`) applies the Schedule's event, then the executor's after-work
(after_publish, after_apply, after_receive): the one order both executors share. No devices,
threads or clocks in here.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from digen_jax.runtime import schedule as sched_lib

ROLLOUT, TRAINER = sched_lib.ROLLOUT, sched_lib.TRAINER


@dataclasses.dataclass(frozen=True)
class ClaimLost:
  """`role` named fragment `index` of `step` but the other role had claimed it first."""

  step: int
  index: int
  role: str


class TrainerSide(Protocol):

  def now(self) -> float:
    ...

  def claims(self, step: int) -> dict[int, tuple[str, float]]:
    ...

  def claim(self, step: int, index: int, role: str) -> bool:
    ...

  def publish(self, version: int, done) -> None:
    ...

  def after_publish(self, version: int) -> None:
    ...

  def train(self, step: int, index: int, done) -> None:
    ...

  def apply(self, step: int, done) -> None:
    ...

  def after_apply(self, step: int) -> None:
    ...

  def tag_sample(self, step: int, index: int, done) -> None:
    ...

  def decided(self, decision: dict) -> None:
    ...

  def wait_fragment(self) -> None:
    ...

  def took(self, action) -> None:
    ...


class RolloutSide(Protocol):

  def now(self) -> float:
    ...

  def policy_ready(self, step: int) -> bool:
    ...

  def claim(self, step: int, index: int, role: str) -> bool:
    ...

  def flush(self) -> None:
    ...

  def pull_policy(self, version: int, done) -> None:
    ...

  def after_receive(self, version: int) -> None:
    ...

  def sample(self, step: int, index: int, version: int) -> None:
    ...

  def end_rollout_step(self, step: int) -> None:
    ...

  def took(self, action) -> None:
    ...


# ------------------------------------------------------------------------------ trainer


def trainer_turn(sm: sched_lib.Schedule, ex: TrainerSide) -> bool:
  """Runs the trainer's next action on `ex`. False when the trainer is done.

  BTS reads the rollout's claims, so those are synced into `sm` first when it decides."""
  if sm.needs_claims():
    sm.note_claims(sm.trainer_step, ex.claims(sm.trainer_step))
  action = sm.trainer_action(ex.now())
  if isinstance(action, sched_lib.Done):
    return False
  ex.took(action)
  if isinstance(action, sched_lib.Publish):
    _publish(sm, ex, action.version)
  elif isinstance(action, sched_lib.TrainFragment):
    _train(sm, ex, action.step, action.index)
  elif isinstance(action, sched_lib.Apply):
    _apply(sm, ex, action.step)
  elif isinstance(action, sched_lib.SampleFragment):
    _tag_sample(sm, ex, action)
  elif isinstance(action, sched_lib.Wait):
    if action.decision is not None:
      ex.decided(action.decision)
    ex.wait_fragment()
  else:
    raise AssertionError(f'the trainer cannot {action}')
  return True


def _publish(sm, ex: TrainerSide, v: int) -> None:
  def done(t_end: float) -> None:
    sm.published(v, t_end)
    ex.after_publish(v)

  ex.publish(v, done)


def _train(sm, ex: TrainerSide, step: int, f: int) -> None:
  ex.train(step, f, lambda seconds: sm.trained(step, f, seconds))


def _apply(sm, ex: TrainerSide, step: int) -> None:
  def done() -> None:
    sm.applied(step)
    ex.after_apply(step)

  ex.apply(step, done)


def _tag_sample(sm, ex: TrainerSide, action: sched_lib.SampleFragment) -> None:
  """TAG: BTS chose to sample an unclaimed fragment on the trainer's devices with the
  published policy. If the rollout claimed it meanwhile, the decision turns into a wait."""
  step, f, dec = action.step, action.index, action.decision
  if not ex.claim(step, f, TRAINER):
    ex.took(ClaimLost(step, f, TRAINER))
    dec.update(action='wait', reason=f'fragment {f} was claimed by the rollout first')
    ex.decided(dec)
    ex.wait_fragment()
    return
  sm.claimed(step, f, TRAINER, ex.now())
  dec['fragment'] = f

  def done(device_s: float, wall_s: float) -> None:
    sm.fragment_arrived(step, f, step, TRAINER)
    sm.sampled_by_trainer(device_s, wall_s)
    ex.decided(dec)

  ex.tag_sample(step, f, done)


# ------------------------------------------------------------------------------ rollout


def rollout_turn(sm: sched_lib.Schedule, ex: RolloutSide) -> bool:
  """Runs the rollout's next action on `ex`. False when the rollout is done."""
  ready = sm.stale_window() and ex.policy_ready(sm.rollout_step)
  action = sm.rollout_action(next_policy_ready=ready)
  if isinstance(action, sched_lib.Done):
    return False
  ex.took(action)
  if not isinstance(action, sched_lib.SampleFragment):
    ex.flush()
  if isinstance(action, sched_lib.ReceivePolicy):
    _receive(sm, ex, action.version)
  elif isinstance(action, sched_lib.SampleFragment):
    _sample(sm, ex, action)
  elif isinstance(action, sched_lib.EndRolloutStep):
    ex.end_rollout_step(action.step)
    sm.rollout_step_ended(action.step)
  else:
    raise AssertionError(f'the rollout cannot {action}')
  return True


def _receive(sm, ex: RolloutSide, v: int) -> None:
  def done() -> None:
    sm.policy_received(v)
    ex.after_receive(v)

  ex.pull_policy(v, done)


def _sample(sm, ex: RolloutSide, action: sched_lib.SampleFragment) -> None:
  step, f = action.step, action.index
  if not ex.claim(step, f, ROLLOUT):  # the trainer took it (TAG)
    ex.took(ClaimLost(step, f, ROLLOUT))
    sm.claimed(step, f, TRAINER, ex.now())
    return
  sm.claimed(step, f, ROLLOUT, ex.now())
  ex.sample(step, f, action.version)
