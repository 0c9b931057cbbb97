"""Bubble-triggered search (BTS): should idle trainer devices sample a pending fragment (TAG)?

Called when the trainer has no trainable fragment. It predicts the makespan of the rest of the
logical batch with and without one trainer-side insertion, from per-fragment costs profiled
online (exponential moving averages of measured device spans):

  c_roll    rollout mesh: sample one fragment (its device span)
  c_deliver from the end of a rollout fragment's span to the trainer holding it (scoring,
            offer, pull): the hand-over latency a trainer-side fragment does not pay
  c_gap     rollout host time between two of its fragments (scoring, hand-over, claim)
  c_start   from a policy's publish to the rollout's first fragment of that step (weight pull,
            claim): at a step's start the rollout is late by this much, the trainer is not
  c_tag     trainer mesh: sample + score one fragment (the TAG program)
  c_switch  trainer host overhead of switching to the helper and back (measured: wall time of
            a TAG insertion minus its device span)
  c_train   trainer mesh: gradient of one fragment

and inserts only if the prediction goes down (docs/design.md#execution-modes). Every decision is
returned as a record the schedule logs and stores in the trace.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Costs:
  """Online per-fragment cost profile (seconds); None = not measured yet."""

  roll: float | None = None
  tag: float | None = None
  switch: float = 0.0
  deliver: float = 0.0
  gap: float = 0.0
  start: float = 0.0
  train: float | None = None
  alpha: float = 0.5  # EMA weight of a new measurement
  counts: dict = dataclasses.field(default_factory=dict)

  def observe(self, name: str, seconds: float) -> None:
    """Adds a measurement. The first one of each kind usually includes compilation, so the
    second replaces it outright; later ones enter the moving average."""
    n = self.counts.get(name, 0)
    self.counts[name] = n + 1
    old = getattr(self, name)
    setattr(self, name, seconds if n <= 1 else (1 - self.alpha) * old + self.alpha * seconds)

  def warm(self, name: str) -> bool:
    """Whether `name`'s estimate comes from a measurement after its first (cold) one."""
    return self.counts.get(name, 0) >= 2


def predict_makespan(
    *,
    now: float,
    rollout_free_at: float,
    in_flight: int,
    unclaimed: int,
    backlog: int,
    c_roll: float,
    c_train: float,
    c_tag: float = 0.0,
    c_switch: float = 0.0,
    c_deliver: float = 0.0,
    c_gap: float = 0.0,
    insert: bool = False,
) -> float:
  """Predicted time at which the trainer has trained every fragment of the batch.

  now: current time; rollout_free_at: when the rollout's device finishes its fragment in
  flight (in_flight=1), or, with none in flight, when it can start the next one (at a step's
  start: once it holds the policy); unclaimed: fragments nobody has started; backlog:
  fragments already here but not yet trained (0 when BTS is asked, by definition). A rollout
  fragment reaches the trainer c_deliver after its span ends; the rollout starts the next one
  c_gap after. With insert, the trainer first samples one unclaimed fragment (c_switch +
  c_tag; it is at hand at once) and the rollout does one fewer. The trainer trains fragments
  in arrival order, one at a time, c_train each.
  """
  arrivals = []
  t_r = max(now, rollout_free_at)
  if in_flight:
    arrivals.append(max(now, rollout_free_at + c_deliver))
    t_r = max(now, rollout_free_at + c_gap)
  n_roll = unclaimed - (1 if insert else 0)
  for _ in range(n_roll):
    t_r += c_roll
    arrivals.append(t_r + c_deliver)
    t_r += c_gap
  t = now
  if insert:
    t += c_switch + c_tag
    arrivals.append(t)
  t += backlog * c_train
  for a in sorted(arrivals):
    t = max(t, a) + c_train
  return t


def decide(
    costs: Costs,
    *,
    now: float,
    rollout_free_at: float,
    in_flight: int,
    unclaimed: int,
    backlog: int,
    trainer_speed: float = 1.0,
    rollout_speed: float = 1.0,
) -> dict:
  """{'action': 'insert'|'wait', 'reason', predicted makespans...}. Until two TAG spans are
  measured (the first is cold), the trainer's sampling cost is at most the estimate from c_roll
  and the roles' speed labels; `c_tag_measured` says whether a warm measurement was used."""
  rec = {'now': now, 'unclaimed': unclaimed, 'in_flight': in_flight, 'backlog': backlog}
  if unclaimed <= 0:
    return dict(rec, action='wait', reason='no unclaimed fragment')
  if costs.roll is None or costs.train is None:
    # Nothing profiled yet: no prediction is possible; wait for a measurement.
    return dict(rec, action='wait', reason='costs not profiled yet')
  # c_tag is measured only when BTS inserts, so a first measurement inflated by one-time costs
  # (the TAG program's first execution on the trainer: 3-4x its steady span on the CPU ladder)
  # would stop the very insertions that correct it. Until a second, warm one exists, the
  # estimate from c_roll caps it: one more insertion confirms or refutes the first.
  prior = costs.roll * rollout_speed / trainer_speed
  if costs.warm('tag'):
    c_tag = costs.tag
  elif costs.tag is None:
    c_tag = prior
  else:
    c_tag = min(costs.tag, prior)
  kw = dict(
      now=now,
      rollout_free_at=rollout_free_at,
      in_flight=in_flight,
      unclaimed=unclaimed,
      backlog=backlog,
      c_roll=costs.roll,
      c_train=costs.train,
      c_tag=c_tag,
      c_switch=costs.switch,
      c_deliver=costs.deliver,
      c_gap=costs.gap,
  )
  base = predict_makespan(**kw, insert=False)
  ins = predict_makespan(**kw, insert=True)
  rec.update(
      makespan_wait=base - now,
      makespan_insert=ins - now,
      c_roll=costs.roll,
      c_tag=c_tag,
      c_tag_measured=costs.warm('tag'),
      c_switch=costs.switch,
      c_train=costs.train,
      c_deliver=costs.deliver,
      c_gap=costs.gap,
      rollout_free_at=rollout_free_at,
  )
  if ins < base:
    return dict(rec, action='insert', reason='predicted makespan drops')
  return dict(rec, action='wait', reason='predicted makespan does not drop')
