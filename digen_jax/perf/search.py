"""Every mode of a run on a cluster, predicted by the simulator (perf/engine.py), and the search
for the best rollout/trainer split.

Modes are the ladder's rungs (perf/predict.py): colocated, naive disaggregation, +GAP, +TSP,
+TAG/BTS, +TCSS, each adding to the one before; and GAP+TAG(+TCSS) without TSP (EXTRA_MODES).
A candidate is (split, M): which devices of each kind train and which roll out, and the GAP
fragment count (whole prompt groups per fragment). Its StepCosts come from the run's
cost model (perf/runmodel.py) on each role's accelerators:

  rollout      the fastest fitting way to sample a fragment (M = 1: the batch) on the rollout
  grad         ... to take its gradient on the trainer (FSDP collectives added); M = 1: the
               batch by gradient accumulation, plus the apply (the engine's convention)
  apply        the optimizer step on the trainer's shards
  tag_rollout  a fragment sampled on the trainer's mesh with its FSDP params (TAG)
  publish      disagg: the weights to the rollout (timing.publish_seconds); colocated: the
               layout switch (timing.switch_seconds)
  deliver      a fragment's trajectories to the trainer over the NICs

The search: every split of the cluster's parts (each part's count on a grid, both roles >= 1
device) and every M gets `step_bound`, a lower bound on the seconds of every simulated step
(each role's own work per step; with TAG the best division of the fragments between the roles).
Candidates are simulated in bound order until the next bound is no faster than the best
simulated step: the best of a mode is the best of all its candidates (branch and bound), so more
candidates can never make it worse. At least `simulate_top` are simulated (for the report);
every simulated candidate is reported (`tried`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from digen_jax.experiment import fragments as frag_lib
from digen_jax.parallel import tsp_grid
from digen_jax.runtime import trace as trace_lib
from digen_jax.perf import engine
from digen_jax.perf import hardware
from digen_jax.perf import predict
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm

MODES = tuple(predict.MODE_KEYS[r] for r in predict.RUNGS)  # the ladder's JSON keys
RUNG_OF = {v: k for k, v in predict.MODE_KEYS.items()}
# Not ladder rungs: TAG (and TCSS) without TSP, for configs where TSP's padding costs more than
# it saves (the planner reports them beside the ladder's cumulative rungs).
EXTRA_MODES = ('gap_tag', 'gap_tag_tcss')


def schedule_of(mode: str, fragments: int, tcss_fraction: float) -> engine.Modes:
  if mode in EXTRA_MODES:
    return engine.Modes(
        fragments=fragments,
        unit='group',
        tsp=False,
        tag=True,
        tcss_fraction=tcss_fraction if mode.endswith('tcss') else 0.0,
    )
  return predict.rung_schedule(RUNG_OF[mode], fragments, 'group', tcss_fraction)


TCSS_DEFAULT = 0.5  # the ladder's phi when the config has none


def step_bound(costs: engine.StepCosts, schedule: engine.Modes) -> float:
  """A lower bound on the seconds of any simulated step after the first: the work each role
  must do between two publishes. Fused (one fragment): rollout, hand-over, update and publish
  one after another. Pipelined: the trainer's M gradients, apply and publish; the rollout's
  fragments that must start after the previous publish (all but TCSS's stale ones); with TAG,
  x of those sampled on the trainer instead, x at the continuous optimum (BTS can only do
  worse)."""
  if schedule.fused:
    return costs.rollout + costs.deliver + costs.grad + costs.apply + costs.publish
  m = schedule.fragments
  trainer = m * costs.grad + costs.apply + costs.publish
  fresh = m - frag_lib.stale_count(m, schedule.tcss_fraction)
  rollout = fresh * costs.rollout
  if not schedule.tag or costs.tag_rollout is None or rollout <= trainer:
    return max(rollout, trainer)
  x = min(fresh, (rollout - trainer) / (costs.rollout + costs.tag_rollout))
  return max((fresh - x) * costs.rollout, trainer + x * costs.tag_rollout)


class PlanError(ValueError):
  """Input the planner cannot plan (one line: what is wrong and what would fix it)."""


@dataclasses.dataclass(frozen=True)
class Split:
  trainer: roles.Group
  rollout: roles.Group

  @property
  def label(self) -> str:
    return f'trainer {self.trainer.label} | rollout {self.rollout.label}'


def part_counts(count: int, grid: int = 16) -> list[int]:
  """Trainer counts to try from a part of `count` devices: all of them up to `grid`, else a
  grid of `grid` steps plus the powers of two."""
  if count <= grid:
    return list(range(count + 1))
  out = {0, count} | {round(count * j / grid) for j in range(1, grid)}
  out |= {2**k for k in range(int(math.log2(count)) + 1)}
  out |= {count - 2**k for k in range(int(math.log2(count)) + 1)}
  return sorted(c for c in out if 0 <= c <= count)


def splits(parts: tuple[hardware.ClusterPart, ...], grid: int = 16) -> list[Split]:
  """Every trainer/rollout division of the parts (each role >= 1 device)."""
  out = []
  for counts in itertools.product(*(part_counts(p.count, grid) for p in parts)):
    t = tuple(hardware.ClusterPart(c, p.accelerator) for c, p in zip(counts, parts) if c)
    r = tuple(
        hardware.ClusterPart(p.count - c, p.accelerator)
        for c, p in zip(counts, parts)
        if p.count - c
    )
    if t and r:
      out.append(Split(roles.Group(t), roles.Group(r)))
  return out


@dataclasses.dataclass(eq=False)
class Candidate:
  mode: str
  split: Split | None  # None: colocated
  fragments: int
  costs: engine.StepCosts
  layout: engine.Layout
  schedule: engine.Modes
  bound_s: float  # the ranking bound: seconds per step
  choices: dict  # the options taken per work item
  result: dict | None = None  # the simulation's summary

  @property
  def samples_per_s(self) -> float:
    return self.result['samples_per_s'] if self.result else 0.0


def weighted_utilization(res: engine.Result, layout: engine.Layout) -> float:
  """Utilization of `layout` from a simulation with one device per role (trainer device 0,
  rollout device 1; colocated: device 0), as Result.summary() averages it: over the steps
  after the first."""
  rows = res.rows[1:] or res.rows
  n_t = layout.trainer_devices
  n_r = 0 if layout.colocated else layout.rollout_devices
  total = []
  for r in rows:
    busy = trace_lib.busy_seconds(res.spans, r['t0'], r['t1'])
    wall = r['t1'] - r['t0']
    total.append(
        min(1.0, (n_t * busy.get(0, 0.0) + n_r * busy.get(1, 0.0)) / ((n_t + n_r) * wall))
        if wall > 0
        else 0.0
    )
  return sum(total) / len(total)


def role_busy(res: engine.Result) -> dict[str, float]:
  """Per role: the fraction of the steps after the first in which it runs a program (its
  devices run in lockstep, so its spans' union is every device's busy time)."""
  rows = res.rows[1:] or res.rows
  out = {}
  for role in (engine.TRAINER, engine.ROLLOUT):
    spans = [dataclasses.replace(s, devices=(0,)) for s in res.spans if s.role == role]
    fr = [
        trace_lib.busy_seconds(spans, r['t0'], r['t1']).get(0, 0.0) / (r['t1'] - r['t0'])
        for r in rows
        if r['t1'] > r['t0']
    ]
    out[role] = sum(fr) / len(fr) if fr else 0.0
  return out


class Planner:
  """The modes of one RunModel on one cluster."""

  def __init__(
      self,
      run: rm.RunModel,
      parts: tuple[hardware.ClusterPart, ...],
      knobs: rm.Knobs | None = None,
      *,
      steps: int = 6,
      simulate_top: int = 6,
      grid: int = 16,
      tcss_fraction: float | None = None,
      fixed: Split | None = None,
  ):
    self.run, self.parts, self.knobs = run, parts, knobs or rm.Knobs()
    self.fixed = fixed
    self.steps, self.simulate_top, self.grid = steps, simulate_top, grid
    self.tcss = tcss_fraction or run.tcss_fraction or TCSS_DEFAULT
    self._memo: dict = {}
    self.all = roles.Group(parts)

  # ------------------------------------------------------------------------ work items

  def _memo_get(self, key, fn):
    if key not in self._memo:
      self._memo[key] = fn()
    return self._memo[key]

  def rollout(self, group: roles.Group, b: int) -> roles.Option | None:
    return self._memo_get(
        ('r', group, b), lambda: rm.best(rm.rollout_options(self.run, group, b, self.knobs))
    )

  def grad(
      self, group: roles.Group, b: int, tsp: bool, *, per_step: bool = True
  ) -> roles.Option | None:
    """The fastest fitting fragment gradient; with LoRA and `per_step` (fragments, not the
    fused update, which gathers once per step already) also with the base gathered once per
    step (config.schedule.frozen_once_per_step; that one gather, detail['step_gather_s'], is
    charged to the step's apply by disagg)."""

    def options():
      out = rm.grad_options(self.run, group, b, self.knobs, tsp=tsp)
      if per_step and self.run.frozen_base_bytes:
        out += rm.grad_options(self.run, group, b, self.knobs, tsp=tsp, frozen_once=True)
      return out

    return self._memo_get(('g', group, b, tsp, per_step), lambda: rm.best(options()))

  def tag(self, group: roles.Group, b: int) -> roles.Option | None:
    return self._memo_get(
        ('t', group, b),
        lambda: rm.best(
            rm.rollout_options(
                self.run,
                group,
                b,
                self.knobs,
                on_trainer=True,
                persistent=self.run.trainer_persistent(group.n),
            )
        ),
    )

  # ------------------------------------------------------------------------ candidates

  def colocated(self) -> Candidate | None:
    run, g, k = self.run, self.all, self.knobs
    grad = self.grad(g, run.batch, False, per_step=False)
    if grad is None:
      return None
    opts = [o for o in rm.colocated_rollout_options(run, g, run.batch, k) if o.fits]
    if not opts:
      return None
    switch = {
        id(o): rm.switch_seconds(run, g, o.detail['layout'], o.detail['offload'], k) for o in opts
    }
    roll = min(opts, key=lambda o: o.seconds + switch[id(o)])
    apply = rm.apply_seconds(run, g, k)
    costs = engine.StepCosts(
        rollout=roll.seconds + run.reward_seconds(run.batch, g),
        grad=grad.seconds + apply,
        publish=switch[id(roll)],
    )
    bound = step_bound(costs, engine.Modes())
    return Candidate(
        'colocated',
        None,
        1,
        costs,
        engine.Layout(g.n, g.n, colocated=True),
        engine.Modes(),
        bound,
        {'rollout': roll, 'grad': grad, 'apply_s': apply},
    )

  def disagg(self, mode: str, split: Split, m: int) -> Candidate | None:
    run, k = self.run, self.knobs
    schedule = schedule_of(mode, m, self.tcss)
    b = run.batch // m
    roll = self.rollout(split.rollout, b)
    grad = self.grad(split.trainer, b, schedule.tsp, per_step=not schedule.fused)
    if roll is None or grad is None:
      return None
    # The base gathered once per step (frozen_once_per_step) is the step's, charged to the apply.
    apply = rm.apply_seconds(run, split.trainer, k) + grad.detail['step_gather_s']
    tag = self.tag(split.trainer, b) if schedule.tag else None
    if schedule.tag and tag is None:  # TAG's sampling does not fit beside the trainer state
      schedule = dataclasses.replace(schedule, tag=False)
    publish = rm.publish_seconds(run, split.trainer, split.rollout, roll.detail['layout'], k)
    deliver = rm.deliver_seconds(run, b, split.trainer, split.rollout, k)
    # A fragment is scored where it was sampled (the rollout's devices; TAG: the trainer's), or
    # by the reward workers on their own devices while the rollout samples on.
    rollout, deliver = run.scored_fragment(roll.seconds, b, split.rollout, deliver)
    if schedule.fused:  # one fragment, gradient and optimizer step in one program
      costs = engine.StepCosts(
          rollout=rollout, grad=grad.seconds + apply, publish=publish, deliver=deliver
      )
    else:
      costs = engine.StepCosts(
          rollout=rollout,
          grad=grad.seconds,
          apply=apply,
          tag_rollout=tag.seconds + run.reward_on_role(b, split.trainer) if tag else None,
          publish=publish,
          deliver=deliver,
      )
    bound = step_bound(costs, schedule)
    return Candidate(
        mode,
        split,
        m,
        costs,
        engine.Layout(split.trainer.n, split.rollout.n),
        schedule,
        bound,
        {'rollout': roll, 'grad': grad, 'tag': tag, 'apply_s': apply},
    )

  def simulate(self, c: Candidate, *, real_layout: bool = False) -> Candidate:
    """Runs the engine. Samples/s does not depend on the device counts (they are in the
    costs), so the search simulates one device per role and weights its utilization by the
    roles' device counts; `real_layout` simulates every device (for a trace)."""
    layout = c.layout if real_layout else engine.Layout(colocated=c.layout.colocated)
    res = engine.simulate(
        c.costs,
        layout,
        c.schedule,
        groups=self.run.prompts,
        group_size=self.run.group_size,
        steps=self.steps,
    )
    c.result = dict(
        res.summary(),
        makespan_s=res.makespan,
        **{f'{k}_busy': v for k, v in role_busy(res).items()},
    )
    if not real_layout:
      c.result['utilization'] = weighted_utilization(res, c.layout)
    c.result['_sim'] = res
    return c

  # ------------------------------------------------------------------------ the search

  def search(self) -> dict:
    """{'modes': {key: best Candidate or None}, 'tried': {key: [Candidate]}}."""
    modes, tried = {}, {}
    col = self.colocated()
    if col is not None:
      self.simulate(col)
    modes['colocated'], tried['colocated'] = col, [col] if col else []
    all_splits = [self.fixed] if self.fixed else splits(self.parts, self.grid)
    for mode in MODES[1:] + EXTRA_MODES:
      ms = [1] if mode == 'disagg' else ([m for m in self.run.fragment_counts() if m > 1] or [1])
      cands = [c for s in all_splits for m in ms if (c := self.disagg(mode, s, m)) is not None]
      tried[mode] = self.branch_and_bound(cands)
      modes[mode] = max(tried[mode], key=lambda c: c.samples_per_s) if cands else None
    return {'modes': modes, 'tried': tried}

  def branch_and_bound(self, cands: list[Candidate]) -> list[Candidate]:
    """Simulates `cands` in bound order until no remaining one can beat the best simulated
    step (its bound is no shorter), and at least `simulate_top` of them; returns those
    simulated."""
    done, best_wall = [], math.inf  # the best simulated seconds per step (batch / samples/s)
    for c in sorted(cands, key=lambda c: c.bound_s):
      if c.bound_s >= best_wall and len(done) >= self.simulate_top:
        break
      self.simulate(c)
      done.append(c)
      best_wall = min(best_wall, self.run.batch / c.samples_per_s)
    return done

  def notes(self, modes: dict) -> list[str]:
    """What the figures show that a reader should know (from the best candidates)."""
    out = []
    gap, tsp = modes.get('gap'), modes.get('gap_tsp')
    if gap and tsp and tsp.samples_per_s < gap.samples_per_s:
      n, b = tsp.split.trainer.n, self.run.batch // tsp.fragments
      lay = tsp_grid.choose(self.run.K, n, b)
      out.append(
          f'TSP is slower here ({tsp.samples_per_s / gap.samples_per_s:.2f}x GAP): its grid '
          f'puts K={self.run.K} steps ({lay.K_pad} padded) x {b} samples on {lay.t} x {lay.b} '
          f"devices, {lay.work} sample-steps each, against the plain fragment gradient's "
          f'{math.ceil(b / n) * self.run.K} without the grid'
      )
    tag = modes.get('gap_tsp_tag')
    if tag and tag.result and tag.result['bts_inserts'] == 0:
      out.append(
          'BTS inserted no trainer-side rollout (TAG): the trainer is busy for the whole '
          'step, so sampling on it would lengthen the makespan'
      )
    padded = sorted(
        {
            k
            for k, c in modes.items()
            if c is not None
            and any(
                o is not None and o.detail.get('padded')
                for o in c.choices.values()
                if isinstance(o, roles.Option)
            )
        }
    )
    if padded:
      out.append(
          f'{", ".join(padded)}: a batch does not divide its role\'s devices; the runtime '
          'pads it with weight-0 rows to a multiple of them (experiment/fragments.py), costed '
          'so'
      )
    return out
