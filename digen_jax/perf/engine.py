"""Discrete-event simulation of a run: the real schedule (runtime/schedule.py) on a virtual clock.

The same `Schedule` the runtime drives with real programs is driven here by modelled costs:
each role (trainer, rollout) takes its turns through runtime/roles.py, the handlers the
runtime's roles run, with this module as their executor (`_TrainerSide`, `_RolloutSide`): it
charges each program's seconds (`StepCosts`) on the role's devices and calls the handler's
completion when the program ends on the virtual clock, so events (a fragment reaching the
trainer, a publish ending, a policy pulled) go back into the Schedules in the runtime's order.
A role that waits blocks as the runtime's does: the trainer until the next fragment reaches
it, the rollout until the policy it receives is published. Claims are arbitrated first come,
first served, as the runtime's links do. BTS (TAG) decides from the costs it profiles online
from the simulated spans, as in a real run. `Simulation.log` is what the handlers took.

Devices and host cores. Each role's programs run on its devices; `Layout.shared` says whether
the two roles' programs compete for the same compute (one process with both meshes on one
host's cores, or colocated): then concurrent programs share it. Without a core count every
program fills the pool alone (k programs in flight each progress at 1/k of their speed); with
`Layout.cores` = C and the cores each program keeps busy alone (`StepCosts.cores`, d_j <= C),
they all run at full speed while sum(d) <= C, else at C / sum(d) of it: small programs that use
one core of two overlap for free, a program that fills the host halves its neighbour's speed.
With `colocated` the roles are the same devices. Hand-overs (a fragment's delivery, a policy pull) and host bookkeeping are latencies
that occupy no device.

M = 1 is colocated or naive disaggregation: the schedule then samples the whole batch as one
fragment, trains it, applies and publishes, as the runtime's loop does for every M (a single
fragment without TSP runs the fused update program: charged as one 'grad' of the whole batch,
`StepCosts.apply` then 0). A step's wall time runs from one optimizer step's end to the next,
the runtime's definition in every mode.

Output: per-step rows (wall from one optimizer step's end to the next, samples/s, utilization
as trace.utilization computes it from the spans), the spans themselves (trace.Span, virtual
seconds: trace.write_timeline draws them like a real run's) and the BTS decisions.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from typing import Callable

from digen_jax.runtime import bts as bts_lib
from digen_jax.runtime import roles
from digen_jax.experiment import fragments as frag_lib
from digen_jax.runtime import schedule as sched_lib
from digen_jax.runtime import trace as trace_lib

ROLLOUT, TRAINER = sched_lib.ROLLOUT, sched_lib.TRAINER


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Seconds of one run's programs and hand-overs, each as it runs alone on its role's devices.

  rollout      rollout devices: sample + score one fragment
  grad         trainer devices: one fragment's gradient (M = 1: the whole update)
  apply        trainer devices: the optimizer step (M = 1: 0, inside `grad`)
  tag_rollout  trainer devices: sample + score one fragment (TAG); None: no TAG program
  publish      trainer devices: send the weights (colocated: the layout switch)
  pull         rollout: from a publish's end until the rollout holds the policy (no compute)
  deliver      from a rollout fragment's end until the trainer holds it (scoring, hand-over)
  gap          rollout host time after each fragment before it starts the next
  trainer_host trainer host time per step after the publish (metrics, the checkpoint save's
               blocking part, encode)
  checkpoint   trainer host CPU per step of the asynchronous checkpoint save (serialization,
               compression, digest): a background job on the trainer's devices that slows what
               runs beside it there and is hidden while the trainer waits
  """

  rollout: float
  grad: float
  apply: float = 0.0
  tag_rollout: float | None = None
  publish: float = 0.0
  pull: float = 0.0
  deliver: float = 0.0
  gap: float = 0.0
  trainer_host: float = 0.0
  checkpoint: float = 0.0
  # program ('rollout', 'grad', 'update', 'apply', 'tag_rollout', 'publish') -> cores it keeps
  # busy alone on a shared pool (Layout.cores); a program not named fills the pool.
  cores: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for name, c in self.cores.items():
      if not (c > 0 and c < float('inf')):
        raise ValueError(f'StepCosts.cores[{name!r}]={c!r}: cores must be finite and > 0')
    for f in dataclasses.fields(self):
      if f.name == 'cores':
        continue
      v = getattr(self, f.name)
      if v is not None and not (v >= 0 and v < float('inf')):
        raise ValueError(f'StepCosts.{f.name}={v!r}: seconds must be finite and >= 0')
    if self.rollout <= 0 or self.grad <= 0:
      raise ValueError(f'StepCosts: rollout={self.rollout} and grad={self.grad} must be > 0')


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the roles run: device counts, whether they compete for one pool of compute
  (`shared`), whether they are the same devices (`colocated`, implies shared)."""

  trainer_devices: int = 1
  rollout_devices: int = 1
  shared: bool = False
  colocated: bool = False
  cores: float = 0.0  # a shared pool's cores (0: each program alone fills it)

  def __post_init__(self):
    if self.cores < 0:
      raise ValueError(f'Layout.cores={self.cores} must be >= 0')
    if self.trainer_devices < 1 or self.rollout_devices < 1:
      raise ValueError(
          f'Layout: device counts must be >= 1, got trainer={self.trainer_devices} '
          f'rollout={self.rollout_devices}'
      )
    if self.colocated and self.trainer_devices != self.rollout_devices:
      raise ValueError(
          'Layout: a colocated layout has one device set (trainer_devices == ' 'rollout_devices)'
      )

  def devices(self, role: str) -> tuple[int, ...]:
    """Device ids of `role` (colocated: the same ones for both)."""
    if self.colocated or role == TRAINER:
      return tuple(range(self.trainer_devices))
    return tuple(range(self.trainer_devices, self.trainer_devices + self.rollout_devices))

  @property
  def num_devices(self) -> int:
    return self.trainer_devices if self.colocated else self.trainer_devices + self.rollout_devices

  def pool(self, role: str) -> str:
    return 'shared' if self.shared or self.colocated else role


@dataclasses.dataclass(frozen=True)
class Modes:
  """The execution modes of a run (config.schedule's fields that change the order of work)."""

  fragments: int = 1
  unit: str = 'group'
  tsp: bool = False
  tag: bool = False
  tcss_fraction: float = 0.0

  @property
  def fused(self) -> bool:
    """Whether the trainer runs a batch as one fused update program (runtime/trainer.py)."""
    return self.fragments == 1 and not self.tsp


@dataclasses.dataclass
class _Job:
  role: str
  program: str
  remaining: float  # seconds of work left at speed 1
  pool: str
  t0: float
  done: Callable[[float, float], None]  # (t_end, duration)
  step: int = -1
  fragment: int = -1
  version: int = -1
  background: bool = False  # host work beside the role's programs: no span, the role not busy


class Simulation:
  """One run of `steps` optimizer steps of a batch of `groups` x `group_size` samples."""

  def __init__(
      self,
      costs: StepCosts,
      layout: Layout,
      schedule: Modes,
      *,
      groups: int,
      group_size: int,
      steps: int,
      start: int = 0,
      final_policy: bool = False,
      policy_ready: Callable[[int], bool] | None = None,
  ):
    """Steps [start, steps) (start: a resumed run's first). final_policy: the trainer
    publishes policy `steps` after the last step and the rollout receives it (a run's final
    eval), as runtime/loop.py does. policy_ready(step): the rollout's answer, at a TCSS stale
    window, to whether policy `step` is published (default: whether it is on the virtual
    clock; a replay passes a run's own answers)."""
    if steps < 1:
      raise ValueError(f'steps={steps} must be >= 1')
    if not 0 <= start < steps:
      raise ValueError(f'start={start} must be in [0, steps={steps})')
    if schedule.tag and costs.tag_rollout is None:
      raise ValueError('schedule.tag needs StepCosts.tag_rollout (the trainer-side sampling)')
    self.costs, self.layout, self.schedule = costs, layout, schedule
    self.plan = frag_lib.FragmentPlan(groups, group_size, schedule.fragments, schedule.unit)
    self.start, self.steps, self.final_policy = start, steps, final_policy
    self.policy_ready = policy_ready
    # Each role drives its own Schedule, as in a run whose roles live in two processes.
    self.trainer_sm = sched_lib.Schedule(
        self.plan,
        start=start,
        total_steps=steps,
        tag=schedule.tag,
        final_policy=final_policy,
        costs=bts_lib.Costs(),
    )
    self.rollout_sm = sched_lib.Schedule(
        self.plan,
        start=start,
        total_steps=steps,
        tcss_fraction=schedule.tcss_fraction,
        final_policy=final_policy,
    )
    self.now = 0.0
    self.jobs: list[_Job] = []
    self.timers: list[tuple[float, int, Callable[[], None]]] = []
    self._seq = 0
    self.claims: dict[tuple[int, int], tuple[str, float]] = {}  # the arbiter (the link)
    self.published: dict[int, float] = {}
    self.spans: list[trace_lib.Span] = []
    self.decisions: list[dict] = []
    self.apply_end: dict[int, float] = {}
    self.publish_start: dict[int, float] = {}
    self.busy = {TRAINER: False, ROLLOUT: False}  # a program or a latency in progress
    self.done = {TRAINER: False, ROLLOUT: False}
    # A role blocked until an event: (whether it came, what the role does then).
    self.blocked: dict[str, tuple[Callable[[], bool], Callable[[], None]] | None] = {
        TRAINER: None,
        ROLLOUT: None,
    }
    self.arrived = 0  # fragments the trainer received (one wakes a trainer that waits)
    self.log: list[tuple[float, str, object]] = []  # (t, role, what runtime/roles.py took)
    self.sides = {TRAINER: _TrainerSide(self), ROLLOUT: _RolloutSide(self)}

  # ------------------------------------------------------------------------ the clock

  def _after(self, seconds: float, fn: Callable[[], None]) -> None:
    self._seq += 1
    heapq.heappush(self.timers, (self.now + seconds, self._seq, fn))

  def _run(self, role: str, program: str, seconds: float, done, **where) -> None:
    self.busy[role] = True
    self.jobs.append(_Job(role, program, seconds, self.layout.pool(role), self.now, done, **where))

  def _background(self, role: str, program: str, seconds: float) -> None:
    """Host work of `role` that runs beside its programs (it shares their pool) without
    holding the role: an asynchronous checkpoint save."""
    if seconds > 0:
      self.jobs.append(
          _Job(
              role,
              program,
              seconds,
              self.layout.pool(role),
              self.now,
              lambda t, d: None,
              background=True,
          )
      )

  def _rates(self) -> dict[int, float]:
    """Each job's speed (1 = as profiled alone) given what shares its pool now."""
    cap = self.layout.cores
    demand: dict[str, float] = {}
    for j in self.jobs:
      demand[j.pool] = demand.get(j.pool, 0.0) + self._demand(j)
    return {
        id(j): (min(1.0, cap / demand[j.pool]) if cap else 1.0 / demand[j.pool]) for j in self.jobs
    }

  def _demand(self, job: _Job) -> float:
    """Cores `job` keeps busy alone (without a core count: 1, a whole pool)."""
    cap = self.layout.cores
    if job.background:  # one host thread
      return min(1.0, cap) if cap else 1.0
    return min(self.costs.cores.get(job.program, cap), cap) if cap else 1.0

  def _advance(self) -> bool:
    """Moves the clock to the next event and handles it. False when nothing is pending."""
    rates = self._rates()
    t_job, job = min(
        ((self.now + j.remaining / rates[id(j)], j) for j in self.jobs),
        default=(float('inf'), None),
        key=lambda x: x[0],
    )
    t_timer = self.timers[0][0] if self.timers else float('inf')
    t = min(t_job, t_timer)
    if t == float('inf'):
      return False
    for j in self.jobs:
      j.remaining -= (t - self.now) * rates[id(j)]
    self.now = t
    if job is not None and t_job <= t_timer:
      self.jobs.remove(job)
      if job.background:  # host work: no span, and the role was never held
        return True
      self.spans.append(
          trace_lib.Span(
              self.layout.devices(job.role),
              job.role,
              job.program,
              job.t0,
              t,
              job.step,
              job.fragment,
              job.version,
          )
      )
      self.busy[job.role] = False
      job.done(t, t - job.t0)
    else:
      _, _, fn = heapq.heappop(self.timers)
      fn()
    return True

  def run(self) -> 'Result':
    self._poll()
    while not all(self.done.values()):
      if not self._advance():
        raise RuntimeError(
            f'the simulation is stuck at t={self.now:.3f}: trainer at step '
            f'{self.trainer_sm.trainer_step}, rollout at step '
            f'{self.rollout_sm.rollout_step}'
        )
      self._poll()
    return Result(self)

  def _poll(self) -> None:
    """Lets every idle role take its next action through runtime/roles.py (repeatedly: an
    action may free the other), and wakes a blocked role whose event came."""
    progress = True
    while progress:
      progress = False
      for role in (TRAINER, ROLLOUT):
        if self.done[role]:
          continue
        if self.blocked[role] is not None:
          progress |= self._wake(role)
        elif not self.busy[role]:
          turn = roles.trainer_turn if role == TRAINER else roles.rollout_turn
          sm = self.trainer_sm if role == TRAINER else self.rollout_sm
          self.done[role] = not turn(sm, self.sides[role])
          progress = True

  def _block(self, role: str, came: Callable[[], bool], then: Callable[[], None]) -> None:
    """`role` waits (no device) until `came()`, then runs `then`."""
    self.busy[role] = True
    self.blocked[role] = (came, then)
    self._wake(role)

  def _wake(self, role: str) -> bool:
    came, then = self.blocked[role]
    if not came():
      return False
    self.blocked[role] = None
    self.busy[role] = False
    then()
    return True

  def _hold(self, role: str, seconds: float, then: Callable[[], None] | None = None) -> None:
    """`role` is busy on its host (no device) for `seconds`, then runs `then`."""
    self.busy[role] = True

    def end():
      self.busy[role] = False
      if then is not None:
        then()

    self._after(seconds, end)

  # ------------------------------------------------------------------------ the arbiter

  def _claim(self, step: int, f: int, role: str) -> bool:
    if (step, f) in self.claims:
      return False
    self.claims[(step, f)] = (role, self.now)
    return True

  def _bookkeeping(self) -> None:
    """The trainer's host work that ends a step: metrics, encodes and the checkpoint save's
    blocking part hold it; the save's asynchronous rest runs beside its next programs."""
    self._hold(TRAINER, self.costs.trainer_host)
    self._background(TRAINER, 'checkpoint', self.costs.checkpoint)


class _TrainerSide:
  """The trainer's executor for runtime/roles.py (runtime/loop.py's TrainerLoop on devices):
  each program takes its modelled seconds on the virtual clock, then its completion runs."""

  def __init__(self, sim: Simulation):
    self.sim, self.c = sim, sim.costs

  def now(self) -> float:
    return self.sim.now

  def took(self, action) -> None:
    self.sim.log.append((self.sim.now, TRAINER, action))

  def claims(self, step: int) -> dict[int, tuple[str, float]]:
    return {f: who for (s, f), who in self.sim.claims.items() if s == step}

  def claim(self, step: int, f: int, role: str) -> bool:
    return self.sim._claim(step, f, role)

  def publish(self, v: int, done) -> None:
    self.sim.publish_start[v] = self.sim.now
    self.sim._run(TRAINER, 'publish', self.c.publish, lambda t, d: done(t), step=v, version=v)

  def after_publish(self, v: int) -> None:
    self.sim.published[v] = self.sim.now
    if v > 0:  # the previous step's bookkeeping, after the publish (runtime/loop.py)
      self.sim._bookkeeping()

  def train(self, step: int, f: int, done) -> None:
    program = 'update' if self.sim.schedule.fused else 'grad'
    self.sim._run(
        TRAINER, program, self.c.grad, lambda t, d: done(d), step=step, fragment=f, version=step
    )

  def apply(self, step: int, done) -> None:
    if self.c.apply > 0:
      self.sim._run(
          TRAINER, 'apply', self.c.apply, lambda t, d: done(), step=step, version=step + 1
      )
    else:
      done()

  def after_apply(self, step: int) -> None:
    sim = self.sim
    sim.apply_end[step] = sim.now
    if step + 1 >= sim.steps and not sim.final_policy:  # the last step: no publish follows
      sim._bookkeeping()

  def tag_sample(self, step: int, f: int, done) -> None:
    self.sim._run(
        TRAINER,
        'tag_rollout',
        self.c.tag_rollout,
        lambda t, d: done(d, d),
        step=step,
        fragment=f,
        version=step,
    )

  def decided(self, dec: dict) -> None:
    self.sim.decisions.append(dec)

  def wait_fragment(self) -> None:
    """Until the next fragment reaches the trainer, as runtime/loop.py's take() blocks."""
    sim, n = self.sim, self.sim.arrived
    sim._block(TRAINER, lambda: sim.arrived > n, lambda: None)


class _RolloutSide:
  """The rollout's executor for runtime/roles.py (runtime/rollout.py's RolloutRole)."""

  def __init__(self, sim: Simulation):
    self.sim, self.c = sim, sim.costs

  def now(self) -> float:
    return self.sim.now

  def took(self, action) -> None:
    self.sim.log.append((self.sim.now, ROLLOUT, action))

  def policy_ready(self, step: int) -> bool:
    if self.sim.policy_ready is not None:
      return self.sim.policy_ready(step)
    return step in self.sim.published

  def claim(self, step: int, f: int, role: str) -> bool:
    return self.sim._claim(step, f, role)

  def flush(self) -> None:
    pass  # a fragment is delivered once sampled (its scores are in `deliver`)

  def pull_policy(self, v: int, done) -> None:
    """Waits for the publish of `v`, then for its pull."""
    sim = self.sim

    def pull():
      sim._hold(ROLLOUT, max(0.0, sim.published[v] + self.c.pull - sim.now), done)

    sim._block(ROLLOUT, lambda: v in sim.published, pull)

  def after_receive(self, v: int) -> None:
    pass

  def sample(self, s: int, f: int, v: int) -> None:
    sim, t_start = self.sim, self.sim.now

    def sampled(t_end, d):
      def arrive():
        sim.trainer_sm.fragment_arrived(
            s, f, v, ROLLOUT, sample_s=d, t_start=t_start, t_end=t_end, arrived=sim.now
        )
        sim.arrived += 1

      sim._after(self.c.deliver, arrive)
      sim._hold(ROLLOUT, self.c.gap)

    sim._run(ROLLOUT, 'rollout', self.c.rollout, sampled, step=s, fragment=f, version=v)

  def end_rollout_step(self, step: int) -> None:
    pass


class Result:
  """Per-step figures of a finished Simulation, computed like a real run's metrics."""

  def __init__(self, sim: Simulation):
    self.spans, self.decisions = sim.spans, sim.decisions
    self.batch = sim.plan.batch
    self.num_devices = sim.layout.num_devices
    ends = [sim.apply_end[s] for s in range(sim.start, sim.steps)]
    starts = [0.0] + ends[:-1]  # contiguous: one optimizer step's end to the next
    self.rows = []
    for s, (t0, t1) in enumerate(zip(starts, ends), sim.start):
      wall = t1 - t0
      self.rows.append(
          {
              'step': s + 1,
              'wall_s': wall,
              'samples_per_s': self.batch / wall,
              'utilization': trace_lib.utilization(self.spans, t0, t1, self.num_devices),
              't0': t0,
              't1': t1,
          }
      )
    self.makespan = sim.now

  def summary(self) -> dict:
    """The ladder's figures: median samples/s and mean utilization over the steps after the
    first (the first one fills the pipeline, and compiles in a real run)."""
    rows = self.rows[1:] or self.rows
    return {
        'samples_per_s': statistics.median(r['samples_per_s'] for r in rows),
        'utilization': statistics.fmean(r['utilization'] for r in rows),
        'wall_s': statistics.median(r['wall_s'] for r in rows),
        'steps': len(self.rows),
        'bts_inserts': sum(d.get('action') == 'insert' for d in self.decisions),
    }


def simulate(
    costs: StepCosts,
    layout: Layout,
    schedule: Modes,
    *,
    groups: int,
    group_size: int,
    steps: int,
    final_policy: bool = False,
) -> Result:
  return Simulation(
      costs,
      layout,
      schedule,
      groups=groups,
      group_size=group_size,
      steps=steps,
      final_policy=final_policy,
  ).run()
