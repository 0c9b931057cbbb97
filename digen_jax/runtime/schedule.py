"""The DigenRL schedule as a state machine: fragments in, next action out
(docs/design.md#execution-modes, docs/design.md#one-schedule-two-drivers).

One `Schedule` holds what a role knows about the run's fragments: per logical batch (step),
which fragments are claimed (by whom, when), which are scored and with which policy version,
which are trained, and which policy versions are published. Events go in as method calls
(`claimed`, `fragment_arrived`, `trained`, `applied`, `published`, `policy_received`); the
next action of a role comes out of `trainer_action` / `rollout_action`:

  SampleFragment(step, index, role, version)   sample + score one fragment with that policy
  TrainFragment(step, index)                   accumulate the gradient of one scored fragment
  Apply(step)                                  the optimizer step after the batch's last one
  Publish(version)                             send the trainer's weights to the rollout
  ReceivePolicy(version)                       the rollout waits for and takes that policy
  EndRolloutStep(step)                         the rollout has claimed all it will of a step
  Wait(role, reason)                           nothing to do until an event arrives
  Done()

The modes are parameters of the same machine: M = 1 is the colocated / naive-disaggregated
order (sample the batch, train it, apply, publish); M > 1 is GAP; `tag` lets the trainer
sample an unclaimed fragment when BTS (runtime/bts.py) predicts a shorter makespan;
`tcss_fraction` lets the rollout start up to floor(phi * M) fragments of the next batch with
the previous policy while the next one is not published. TSP is a trainer-side program
choice and enters here only through the profiled cost of a fragment's gradient.

No devices, threads or clocks in here: time enters only as numbers (`now`, measured seconds),
so the runtime drives this with real programs and wall-clock times, and a simulator with a
virtual clock and modelled costs. In a run whose roles live in different threads or
processes, each role drives its own Schedule; claims are arbitrated outside (the link) and
reported back with `claimed`.
"""

from __future__ import annotations

import dataclasses

from digen_jax.runtime import bts as bts_lib
from digen_jax.experiment import fragments as frag_lib

ROLLOUT, TRAINER = 'rollout', 'trainer'


@dataclasses.dataclass(frozen=True)
class SampleFragment:
  """Sample and score fragment `index` of step `step` on `role`'s mesh with policy `version`.

  decision: the BTS record behind a trainer-side (TAG) insertion."""

  step: int
  index: int
  role: str
  version: int
  decision: dict | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class TrainFragment:
  step: int
  index: int


@dataclasses.dataclass(frozen=True)
class Apply:
  step: int


@dataclasses.dataclass(frozen=True)
class Publish:
  version: int


@dataclasses.dataclass(frozen=True)
class ReceivePolicy:
  version: int


@dataclasses.dataclass(frozen=True)
class EndRolloutStep:
  step: int


@dataclasses.dataclass(frozen=True)
class Wait:
  """Nothing to do until an event: the trainer waits for a fragment, the rollout for a
  policy. decision: the BTS record when BTS chose to wait."""

  role: str
  reason: str
  decision: dict | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Done:
  pass


@dataclasses.dataclass
class Claim:
  role: str
  t: float


@dataclasses.dataclass
class StepState:
  """The fragments of one logical batch."""

  claims: dict[int, Claim] = dataclasses.field(default_factory=dict)
  versions: dict[int, int] = dataclasses.field(default_factory=dict)  # scored -> policy
  producers: dict[int, str] = dataclasses.field(default_factory=dict)
  trained: set[int] = dataclasses.field(default_factory=set)
  applied: bool = False

  @property
  def scored(self) -> set[int]:
    return set(self.versions)

  def in_flight(self, role: str) -> list[int]:
    """Fragments `role` claimed that are not scored (at the trainer) yet."""
    return [f for f, c in self.claims.items() if c.role == role and f not in self.versions]


class Schedule:
  """The schedule of steps [start, total_steps) of a run cut into `plan.num` fragments.

  final_policy: the trainer publishes policy `total_steps` after the last step (a final
  eval), and the rollout receives it."""

  def __init__(
      self,
      plan: frag_lib.FragmentPlan,
      *,
      start: int,
      total_steps: int,
      tag: bool = False,
      tcss_fraction: float = 0.0,
      final_policy: bool = False,
      trainer_speed: float = 1.0,
      rollout_speed: float = 1.0,
      costs: bts_lib.Costs | None = None,
  ):
    self.plan, self.start, self.total = plan, start, total_steps
    self.tag = tag
    self.max_stale = frag_lib.stale_count(plan.num, tcss_fraction)
    self.final_policy = final_policy
    self.trainer_speed, self.rollout_speed = trainer_speed, rollout_speed
    self.costs = costs if costs is not None else bts_lib.Costs()
    self._steps: dict[int, StepState] = {}
    self.published_at: dict[int, float] = {}  # policy version -> time its publish ended
    self.trainer_step = start  # the batch the trainer accumulates
    self.rollout_step = start  # the batch the rollout works on
    self.rollout_version: int | None = None  # the policy the rollout holds
    self._last_arrival: dict[int, tuple[int, float]] = {}  # step -> (version, t_end) of the
    #                                             rollout's latest fragment of it (for costs)

  def step(self, step: int) -> StepState:
    return self._steps.setdefault(step, StepState())

  # ---------------------------------------------------------------------------- events

  def claimed(self, step: int, index: int, role: str, t: float) -> None:
    """`role` holds the claim on fragment `index` of `step` (from the arbiter, at time t)."""
    self.step(step).claims.setdefault(index, Claim(role, t))

  def note_claims(self, step: int, claims: dict[int, tuple[str, float]]) -> None:
    """The arbiter's claims of `step` ({index: (role, t)}), e.g. the other role's."""
    for f, (role, t) in claims.items():
      self.claimed(step, f, role, t)

  def fragment_arrived(
      self,
      step: int,
      index: int,
      version: int,
      producer: str,
      *,
      sample_s: float = 0.0,
      t_start: float = 0.0,
      t_end: float = 0.0,
      arrived: float = 0.0,
      eval_s: float = 0.0,
  ) -> None:
    """Fragment `index` of `step`, sampled with policy `version` by `producer`, is scored
    and held by the trainer. A rollout fragment's times profile the rollout's costs for BTS:
    its device span (c_roll), the hand-over (c_deliver: span end -> arrival), the rollout's
    host time between two fragments (c_gap) and its lateness after a publish (c_start)."""
    st = self.step(step)
    if index in st.versions:
      raise ValueError(f'fragment {index} of step {step} arrived twice')
    st.versions[index] = version
    st.producers[index] = producer
    st.claims.setdefault(index, Claim(producer, t_start))
    if producer != ROLLOUT or sample_s <= 0:
      return
    c = self.costs
    c.observe('roll', sample_s)
    c.observe('deliver', max(0.0, arrived - t_end))
    prev = self._last_arrival.get(step)
    if prev is not None and prev[0] == version:
      c.observe('gap', max(0.0, t_start - prev[1]))
    elif prev is None and version == step and step in self.published_at:
      c.observe('start', max(0.0, t_start - eval_s - self.published_at[step]))
    self._last_arrival[step] = (version, t_end)
    for s in [s for s in self._last_arrival if s < self.trainer_step]:
      del self._last_arrival[s]

  def trained(self, step: int, index: int, seconds: float | None = None) -> None:
    """The trainer accumulated fragment `index`'s gradient (in `seconds` of device time)."""
    st = self.step(step)
    if index not in st.versions or index in st.trained:
      raise ValueError(f'fragment {index} of step {step} is not scored or already trained')
    st.trained.add(index)
    if seconds is not None:
      self.costs.observe('train', seconds)

  def sampled_by_trainer(self, device_s: float, wall_s: float) -> None:
    """Profiles a TAG insertion: its device span and the host overhead of switching."""
    self.costs.observe('tag', device_s)
    self.costs.observe('switch', max(0.0, wall_s - device_s))

  def applied(self, step: int) -> None:
    """The optimizer step of `step` is done: the trainer moves on to the next batch."""
    st = self.step(step)
    if len(st.trained) != self.plan.num or st.applied:
      raise ValueError(
          f'step {step} applied with {len(st.trained)}/{self.plan.num} fragments ' 'trained'
          if not st.applied
          else f'step {step} applied twice'
      )
    st.applied = True
    self.trainer_step = step + 1
    for s in [s for s in self._steps if s < step]:  # keep the last one for callers
      del self._steps[s]

  def published(self, version: int, t: float) -> None:
    self.published_at[version] = t
    self.published_at.pop(version - 2, None)

  def policy_received(self, version: int) -> None:
    """The rollout holds policy `version` (and works on batch `version` next)."""
    self.rollout_version = version

  # ---------------------------------------------------------------------------- trainer

  def trainable(self, step: int) -> list[int]:
    st = self.step(step)
    return self.plan.trainable(st.scored, st.trained)

  def needs_claims(self) -> bool:
    """Whether the trainer's next action is a BTS decision, which reads the rollout's claims
    (a caller whose claims live elsewhere syncs them with note_claims first)."""
    s = self.trainer_step
    return (
        self.tag
        and s < self.total
        and self._publish_due() is None
        and not self.trainable(s)
        and len(self.step(s).trained) < self.plan.num
    )

  def _publish_due(self) -> int | None:
    v = self.trainer_step
    if v in self.published_at or v < self.start:
      return None
    if v < self.total or (v == self.total and self.final_policy):
      return v
    return None

  def trainer_action(
      self, now: float
  ) -> SampleFragment | TrainFragment | Apply | Publish | Wait | Done:
    """The trainer's next action at time `now`: publish the policy of the batch it starts,
    train the first trainable fragment, apply once all are trained, else (TAG) sample an
    unclaimed fragment if BTS predicts the batch ends sooner, else wait for a fragment."""
    v = self._publish_due()
    if v is not None:
      return Publish(v)
    step = self.trainer_step
    if step >= self.total:
      return Done()
    st = self.step(step)
    ready = self.trainable(step)
    if ready:
      return TrainFragment(step, ready[0])
    if len(st.trained) == self.plan.num:
      return Apply(step)
    if not self.tag:
      return Wait(TRAINER, 'no trainable fragment')
    dec = self._bts(step, now)
    if dec['action'] == 'insert':
      f = min(f for f in range(self.plan.num) if f not in st.claims)
      return SampleFragment(step, f, TRAINER, step, decision=dec)
    return Wait(TRAINER, dec['reason'], decision=dec)

  def _bts(self, step: int, now: float) -> dict:
    """BTS's decision record for an insertion into `step` now (runtime/bts.py)."""
    st = self.step(step)
    mine = st.in_flight(ROLLOUT)
    if mine:  # the rollout's device is busy until about its claim + one fragment
      rollout_free_at = max(st.claims[f].t for f in mine) + (self.costs.roll or 0)
    else:  # idle, or (at a step's start) still fetching the policy
      rollout_free_at = self.published_at.get(step, now) + self.costs.start
    dec = bts_lib.decide(
        self.costs,
        now=now,
        rollout_free_at=rollout_free_at,
        in_flight=min(1, len(mine)),
        unclaimed=self.plan.num - len(st.claims),
        backlog=0,
        trainer_speed=self.trainer_speed,
        rollout_speed=self.rollout_speed,
    )
    dec.update(step=step + 1, t=now)
    return dec

  # ---------------------------------------------------------------------------- rollout

  def stale_window(self) -> bool:
    """Whether the rollout may start next-batch fragments with its previous policy now (if
    that policy's successor is not published yet): the caller then says whether it is."""
    s = self.rollout_step
    return (
        self.max_stale > 0
        and s < self.total
        and self.rollout_version == s - 1
        and any(f not in self.step(s).claims for f in range(self.max_stale))
    )

  def rollout_action(
      self, next_policy_ready: bool = False
  ) -> SampleFragment | ReceivePolicy | EndRolloutStep | Done:
    """The rollout's next action: receive the policy of its batch, then sample its unclaimed
    fragments in order, then end the batch. Between batches (TCSS), while the next policy is
    not published (next_policy_ready), it samples up to max_stale fragments of the next batch
    with the policy it holds. After the last batch it receives the final policy if any."""
    s = self.rollout_step
    if s >= self.total:
      if self.final_policy and self.rollout_version != self.total:
        return ReceivePolicy(self.total)
      return Done()
    st = self.step(s)
    if self.rollout_version != s:
      if self.stale_window() and not next_policy_ready:
        f = min(f for f in range(self.max_stale) if f not in st.claims)
        return SampleFragment(s, f, ROLLOUT, self.rollout_version)
      return ReceivePolicy(s)
    unclaimed = [f for f in range(self.plan.num) if f not in st.claims]
    if unclaimed:
      return SampleFragment(s, unclaimed[0], ROLLOUT, s)
    return EndRolloutStep(s)

  def rollout_step_ended(self, step: int) -> None:
    """The rollout closed batch `step` (after EndRolloutStep): it moves on to the next."""
    if step != self.rollout_step:
      raise ValueError(f'the rollout is at step {self.rollout_step}, not {step}')
    self.rollout_step = step + 1
