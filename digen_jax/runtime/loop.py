"""The one step loop of every mode: colocated, naive disaggregation, GAP, TSP, TAG/BTS, TCSS,
in one process or two (docs/design.md#execution-modes).

Each role asks its runtime/schedule.Schedule for its next action and runs it through
runtime/roles.py, the one set of handlers that orders the action's effects on the Schedule;
the modes are the Schedule's parameters (M = 1 is one fragment: colocated or naive
disaggregation; M > 1 is GAP; `tag`, `tcss_fraction`) plus the trainer's program choice (TSP).
The trainer's executor, which runs the real programs for those handlers, is here
(`TrainerLoop`), the rollout's in runtime/rollout.py (`RolloutRole`). The roles meet through a
runtime/links.Link: in one process the rollout runs in a thread (LocalLink: jax.device_put
between the meshes), across two processes each process runs its role (ChannelLink: the
transfer server). perf/engine.py is the same handlers' executor on a virtual clock.

Per logical batch (step s): the trainer publishes policy s, the rollout samples and scores
the fragments it claims and streams them to the trainer; the trainer computes a fragment's
advantages once its prompt groups are complete and accumulates its gradient (TAG: while it
has none to train, it may sample an unclaimed fragment itself when BTS predicts a shorter
step); after the last one it makes exactly one optimizer step, publishes policy s + 1, then
writes step s's metrics row and checkpoint while the rollout starts the next batch.

Following `schedule.fragments` from the config to the programs, three files:
  experiment/fragments.py  plan_of reads it into a FragmentPlan (its checks run once, when the
                           config is validated; experiment/build.py keeps it as Run.plan)
  runtime/loop.py          hands exp.plan to both roles' Schedules, the Trainer and the Samplers
  runtime/trainer.py       compiles the update for plan.size samples (one fragment: the fused
  (rollout.py)             program), the Sampler its rollout program for plan.size samples
                           (both laid out as plan.rows rows: weight-0 padding to the meshes)
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from absl import logging
import jax
import numpy as np

from digen_jax.outputs import faults
from digen_jax.process import interrupt
from digen_jax.runtime import bookkeeping as book_lib
from digen_jax.runtime import distributed
from digen_jax.experiment import fragments as frag_lib
from digen_jax.runtime import inputs
from digen_jax.runtime import links
from digen_jax.runtime import publish
from digen_jax.runtime import roles
from digen_jax.runtime import rollout as rollout_lib
from digen_jax.runtime import schedule as sched_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import trainer as trainer_lib
from digen_jax.runtime import transfer


def train(exp, workdir: str, cluster) -> dict:
  """Runs exp.total_steps optimizer steps of `exp` on `cluster` (runtime/cluster.py) for
  this process's role(s), resuming from <workdir>/checkpoints. Returns {'params', 'opt_state',
  'step', 'decisions', 'actions'} where this process trains, else {'step'}; actions: {role:
  [what runtime/roles.py took, in order]} of the roles this process ran."""
  tracer = trace_lib.Tracer(exp.schedule.trace)
  if cluster.multi_process:
    me = distributed.process_info().process_id
    if cluster.role_of(me) == 'rollout':
      return _rollout_process(exp, workdir, cluster, tracer)
    if not exp.schedule.tag and hasattr(exp.reward_fn, 'close'):
      exp.reward_fn.close()  # the rollout process scores; this one never does (no TAG)
  checkpointer = book_lib.checkpointer(exp.output, workdir, cluster.multi_process)
  try:
    trainer = trainer_lib.Trainer(
        exp, cluster.trainer.mesh, checkpointer, exp.plan, tag=bool(exp.schedule.tag)
    )
  except BaseException:
    # E.g. a checkpoint that does not fit this run: orbax's threads and event loop shut down
    # now, not torn down mid-flight at interpreter exit (a traceback apiece).
    checkpointer.close()
    raise
  book = book_lib.Bookkeeping(exp, workdir, cluster, tracer, trainer)
  tag_sampler = None
  if exp.schedule.tag:
    tag_sampler = rollout_lib.Sampler(
        exp, cluster.trainer.mesh, trainer.param_shardings, exp.plan, 'trainer', tracer, book.level
    )
  link, rollout_thread, role = _connect(exp, workdir, cluster, tracer, trainer, book)
  try:
    with book.stops_cleanly():
      out = TrainerLoop(book, trainer, tag_sampler, link).run()
  except BaseException as e:
    link.fail(e)
    if rollout_thread is not None:
      # It stops between fragments (the watchdog bounds this after a signal); left running, it
      # would sample on while the interpreter shuts down and fail with a traceback of its own.
      rollout_thread.join(timeout=30)
    if isinstance(e, links.PeerFailed) and isinstance(e.__cause__, faults.RunError):
      raise e.__cause__ from None  # the rollout's fault, one line (main prints it)
    raise
  link.close()
  if rollout_thread is not None:
    rollout_thread.join()
    if link.error is not None:
      raise RuntimeError('the rollout thread failed') from link.error
    out['actions'][sched_lib.ROLLOUT] = role.actions
  return out


def _connect(exp, workdir: str, cluster, tracer, trainer, book):
  """(the trainer's link, the rollout thread or None, its RolloutRole or None): a ChannelLink
  to the rollout process, or a LocalLink and the rollout role started in a thread of this
  process."""
  start = trainer.start
  if cluster.multi_process:
    position = {'step': start, 'data_position': trainer.data_position}
    distributed.kv_set(f'{links.KV}/start', json.dumps(position))
    link = links.ChannelLink(
        cluster,
        'trainer',
        weights=exp.weights,
        dtype=book.rollout_dtype,
        frag_abstract=rollout_lib.abstract_fragment(exp, exp.plan, trainer.traj_shardings),
    )
    return link, None, None
  if start:
    exp.prompts.restore(trainer.data_position)
  rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
  link = links.LocalLink(
      cluster, exp.weights, trainer.traj_shardings, rollout_sh, book.rollout_dtype
  )
  role = _rollout_role(exp, workdir, cluster, tracer, link, start, writer=book.writer)

  def run_rollout():
    try:
      role.run()
    except (links.PeerFailed, interrupt.Interrupted):
      pass  # the trainer stops the run (and says why)
    except faults.RunError as e:  # e.g. a reward worker that keeps dying: its line says all
      link.fail(e)
    except BaseException as e:  # pylint: disable=broad-except
      logging.exception('rollout thread failed')
      link.fail(e)

  thread = threading.Thread(target=run_rollout, name='rollout', daemon=True)
  thread.start()
  return link, thread, role


def _rollout_role(exp, workdir, cluster, tracer, link, start, writer=None):
  """The rollout role on the rollout mesh: its Sampler and Evals around `link`."""
  frozen_fsdp = publish.rollout_frozen_fsdp(cluster)
  sampler = rollout_lib.Sampler(
      exp,
      cluster.rollout.mesh,
      publish.rollout_param_shardings(cluster, exp.params),
      exp.plan,
      'rollout',
      tracer,
      exp.runtime.transfer_guard,
      publish.rollout_param_dtype(cluster),
      frozen_fsdp=frozen_fsdp,
  )
  evals = rollout_lib.Evals(exp, cluster.rollout.mesh, workdir, frozen_fsdp=frozen_fsdp)
  return rollout_lib.RolloutRole(exp, workdir, link, sampler, evals, start, writer=writer)


def _rollout_process(exp, workdir: str, cluster, tracer) -> dict:
  """The rollout process of a two-process run: starts where the trainer's checkpoint does."""
  start_info = json.loads(distributed.kv_get(f'{links.KV}/start', links.PEER_TIMEOUT_S))
  start = int(start_info['step'])
  exp.prompts.restore(int(start_info['data_position']))
  rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
  link = links.ChannelLink(
      cluster,
      'rollout',
      weights=exp.weights,
      weights_abstract=transfer.abstract(
          exp.params, rollout_sh, publish.rollout_param_dtype(cluster)
      ),
      wait_for_pull=exp.schedule.wait_for_pull,
      shared_claims=exp.schedule.tag,
  )
  _rollout_role(exp, workdir, cluster, tracer, link, start).run()
  return {'step': exp.total_steps}


class _Batch:
  """The trainer's view of one logical batch: its fragments, rewards and advantages, the
  trainer's accumulation state, and what the step's metrics row reports."""

  def __init__(self, plan: frag_lib.FragmentPlan, step: int):
    self.plan, self.step = plan, step
    self.rewards = np.full((plan.batch,), np.nan, np.float32)
    self.parts: np.ndarray | None = None  # [K, B] each reward's scores
    self.frags: dict[int, links.Fragment] = {}
    self.adv_valid: dict[int, tuple] = {}
    self.prompts: list[str] | None = None  # one per sample, from the rollout
    self.conds: dict[int, object] = {}
    self.state: dict | None = None  # Trainer.begin's
    self.decisions: list[dict] = []
    self.move_s = self.grad_s = self.tag_s = 0.0

  def add(self, frag: links.Fragment) -> None:
    self.frags[frag.index] = frag
    samples = list(self.plan.samples(frag.index))
    self.rewards[samples] = frag.rewards
    if frag.reward_parts is not None:
      parts = np.asarray(frag.reward_parts, np.float32)
      if self.parts is None:
        self.parts = np.full((len(parts), self.plan.batch), np.nan, np.float32)
      self.parts[:, samples] = parts


@dataclasses.dataclass
class _Applied:
  """A step whose optimizer step is done and whose row is still to be written."""

  batch: _Batch
  metrics: dict
  evals: dict
  t_start: float  # the step window: the previous step's end ...
  t_end: float  # ... to this step's optimizer step's end
  publish_s: float  # the publish that started the step


class TrainerLoop:
  """The trainer role's side of the schedule: the executor of runtime/roles.py's trainer
  handlers on the trainer mesh (each part runs, then its completion is called at once)."""

  def __init__(self, book: book_lib.Bookkeeping, trainer, tag_sampler, link: links.Link):
    self.book, self.trainer, self.tag_sampler, self.link = book, trainer, tag_sampler, link
    exp, cluster = book.exp, book.cluster
    self.plan = exp.plan
    self.sm = sched_lib.Schedule(
        self.plan,
        start=book.start,
        total_steps=book.total,
        tag=tag_sampler is not None,
        tcss_fraction=exp.schedule.tcss_fraction,
        final_policy=book.final_eval,
        trainer_speed=cluster.trainer.speed,
        rollout_speed=cluster.rollout.speed,
    )
    self.batches: dict[int, _Batch] = {}  # per step; later steps' fragments may come early
    self.applied: _Applied | None = None
    # Step windows are contiguous: from one optimizer step's end to the next, so nothing the
    # trainer does (its publish, the previous step's bookkeeping) is left out of them.
    self.t_step, self.publish_s = time.time(), 0.0
    self.actions: list = []  # what runtime/roles.py took, in order (an action or ClaimLost)
    self._evals, self._metrics = None, None  # of the step being applied (apply -> after_apply)

  def run(self) -> dict:
    while True:
      while self.link.poll():
        self.take()
      if not roles.trainer_turn(self.sm, self):
        break
    self.end_step()  # the last step, when no publish followed it
    if self.book.final_eval:  # policy total_steps was published after the last step
      self.book.write_rows(self.link.get('final_evals'))
      self.link.weights_delivered()
    out = self.book.finish(_title(self.book.exp), decisions=self.book.tracer.decisions)
    return {**out, 'actions': {sched_lib.TRAINER: self.actions}}

  def batch(self, step: int) -> _Batch:
    return self.batches.setdefault(step, _Batch(self.plan, step))

  # ------------------------------------------------------------------ the executor
  # runtime/roles.py calls these: each runs its part on the devices, then calls `done` at once.

  def now(self) -> float:
    return time.time()

  def took(self, action) -> None:
    self.actions.append(action)

  def claims(self, step: int) -> dict[int, tuple[str, float]]:
    claims = self.link.claims(step, self.plan.num)
    return {f: (c['who'], c['t']) for f, c in claims.items()}

  def claim(self, step: int, f: int, role: str) -> bool:
    return self.link.claim(step, f, role)

  def publish(self, v: int, done) -> None:
    """Sends policy `v` (done: with the time it was published)."""
    _, self.publish_s = self.book.publish(self.link.publish, v, self.trainer.devices)
    done(self.book.published_at[v])

  def after_publish(self, v: int) -> None:
    """After publishing policy `v`: writes the previous step's row (the rollout starts the
    next batch meanwhile) and prepares the trainer for batch `v`."""
    if self.applied is not None and self.book.exp.schedule.tcss_fraction == 0:
      # The rollout's first fragment waits for this pull, and the trainer has nothing to do
      # before that fragment arrives: let the pull run alone rather than beside the
      # bookkeeping below (on a shared host the two compete).
      self.link.weights_delivered()
    self.end_step()
    if v < self.book.total:
      b = self.batch(v)
      b.prompts = self.link.get(f'prompts/{v}')['batch_prompts']
      # Text conditioning of every fragment now, while the first fragment is being sampled.
      b.conds = {
          f: self.trainer.encode(self.plan.prompts(f, b.prompts)) for f in range(self.plan.num)
      }
      with inputs.guard(self.book.level):
        b.state = self.trainer.begin(v)
      if v == self.book.start:  # compile while the rollout samples the first fragment
        self.trainer.compile(b.state)

  def take(self) -> None:
    """The next fragment from the rollout (blocking) into its batch."""
    with inputs.guard(self.book.level):
      frag, spans, pull_s = self.link.receive_fragment()
    if self.book.cluster.multi_process:
      self.book.tracer.extend(trace_lib.Span.from_json(s) for s in spans)
    b = self.batch(frag.step)
    b.add(frag)
    b.move_s += pull_s
    self.sm.fragment_arrived(
        frag.step,
        frag.index,
        frag.version,
        sched_lib.ROLLOUT,
        sample_s=frag.sample_s,
        t_start=frag.t_start,
        t_end=frag.t_end,
        arrived=frag.arrived,
        eval_s=frag.eval_s,
    )

  def wait_fragment(self) -> None:
    """Nothing to train: wait for the rollout's next fragment."""
    self.take()

  def train(self, step: int, f: int, done) -> None:
    """Accumulates fragment f's gradient (done: with its seconds)."""
    b = self.batch(step)
    if self.trainer.fused:  # its program steps the optimizer: the rollout must hold its copy
      self.link.weights_delivered()
    t0 = time.perf_counter()
    program = 'update' if self.trainer.fused else 'grad'
    with (
        inputs.guard(self.book.level),
        self.book.tracer.span(
            self.trainer.devices, 'trainer', program, step=step, fragment=f, version=step
        ),
    ):
      b.adv_valid[f] = self.trainer.advantages(f, b.rewards, b.parts)
      b.state = self.trainer.train(b.state, b.frags[f].traj, b.conds[f], *b.adv_valid[f])
      jax.block_until_ready(b.state)
    dt = time.perf_counter() - t0
    b.grad_s += dt
    done(dt)

  def tag_sample(self, step: int, f: int, done) -> None:
    """TAG: samples fragment f on the trainer mesh with the trainer's current weights (the
    published ones: no optimizer step happens inside a batch); done: (device, wall) seconds."""
    b = self.batch(step)
    t0 = time.perf_counter()
    frag = self.tag_sampler.sample(self.trainer.sampling_params, step, b.prompts, step, f)
    dt = time.perf_counter() - t0
    b.tag_s += dt
    b.add(frag)
    done(frag.sample_s + frag.reward_s, dt)

  def decided(self, dec: dict) -> None:
    self.record(self.batch(self.sm.trainer_step), dec)

  def record(self, b: _Batch, dec: dict) -> None:
    """A BTS decision: logged, traced and counted in the step's row."""
    predicted = ''
    if 'makespan_wait' in dec:
      predicted = (
          f" predicted {dec['makespan_wait']:.3f}s wait vs {dec['makespan_insert']:.3f}s insert"
      )
    logging.info('BTS step %d: %s (%s)%s', b.step + 1, dec['action'], dec['reason'], predicted)
    self.book.tracer.decision(dec)
    b.decisions.append(dec)

  def apply(self, step: int, done) -> None:
    """The batch's optimizer step (and further PPO epochs over it). Its row is written after
    the next publish (`after_publish`) or at the end."""
    b = self.batch(step)
    # From here the process holds progress a stop must save (the entry point marked its start
    # as holding none: a signal there exits at once).
    interrupt.nothing_to_save(None)
    self._evals = self.link.get(f'evals/{step}')
    self.book.write_rows(self._evals['rows'])
    self.link.weights_delivered()  # the rollout holds its copy: params may be donated
    t0 = time.perf_counter()
    self._metrics = self._optimizer_steps(b)
    b.grad_s += time.perf_counter() - t0
    done()

  def after_apply(self, step: int) -> None:
    t_end = time.time()
    self.applied = _Applied(
        self.batch(step), self._metrics, self._evals, self.t_step, t_end, self.publish_s
    )
    self.t_step = t_end

  def _optimizer_steps(self, b: _Batch) -> dict:
    """rl.inner_epochs optimizer steps on the batch (the first on the gradient accumulated as
    its fragments came); returns the first one's metrics as floats, 'nonfinite' over all."""
    tr, tracer = self.trainer, self.book.tracer
    with inputs.guard(self.book.level):
      with tracer.span(tr.devices, 'trainer', 'apply', step=b.step, version=b.step + 1):
        m = jax.device_get(tr.apply(b.state))
      epochs = 1 if tr.fused else self.book.exp.rl.inner_epochs  # fused: all inside
      for _ in range(1, epochs):
        state = tr.begin(b.step)
        with tracer.span(tr.devices, 'trainer', 'grad', step=b.step, version=b.step + 1):
          for f in range(self.plan.num):
            state = tr.train(state, b.frags[f].traj, b.conds[f], *b.adv_valid[f])
          jax.block_until_ready(state)
        with tracer.span(tr.devices, 'trainer', 'apply', step=b.step, version=b.step + 1):
          m_e = jax.device_get(tr.apply(state))
        m['nonfinite'] = max(float(m['nonfinite']), float(m_e['nonfinite']))
    return {k: float(v) for k, v in m.items()}

  def end_step(self) -> None:
    """The applied step's metrics row, progress and checkpoint (Bookkeeping.end_step)."""
    if self.applied is None:
      return
    a, self.applied = self.applied, None
    b, plan, book = a.batch, self.plan, self.book
    frags = [b.frags[f] for f in range(plan.num)]
    valid_frac = float(  # over the real samples: a fragment's padding rows are never valid
        np.mean([np.mean(jax.device_get(b.adv_valid[f][1])[: plan.size]) for f in range(plan.num)])
    )
    versions = np.repeat([x.version for x in frags], plan.size)
    extra = dict(
        fragments=plan.num,
        tag_fragments=sum(x.producer == 'trainer' for x in frags),
        tag_s=b.tag_s,
        bts_decisions=len(b.decisions),
        bts_inserts=sum(d['action'] == 'insert' for d in b.decisions),
        **reward_metrics(frags, plan.batch),
        **book_lib.reward_part_metrics(_reward_names(book.exp, b.parts), b.parts),
    )
    if book.exp.schedule.tcss_fraction > 0:
      lags = b.step - versions
      extra['staleness_mix'] = {str(k): float(np.mean(lags == k)) for k in range(2)}
    book.end_step(
        b.step,
        data_position=self.link.get(f'prompts/{b.step}')['data_position'],
        extra=extra,
        prompts=b.prompts,
        policy_version=int(versions.min()),
        rewards=b.rewards,
        valid_frac=valid_frac,
        metrics=a.metrics,
        wall_s=a.t_end - a.t_start - a.evals['eval_s'],
        rollout_s=sum(x.sample_s for x in frags if x.producer == 'rollout'),
        reward_s=sum(x.reward_s for x in frags),
        update_s=b.grad_s,
        publish_s=a.publish_s + a.evals['pull_s'],
        batch_move_s=b.move_s,
        utilization=book.tracer.utilization(a.t_start, a.t_end, book.cluster.num_devices),
    )
    del self.batches[b.step]


def _reward_names(exp, parts) -> list[str]:
  """The names of the rows of a batch's reward parts: the run's rewards (config.reward.weights'
  order), or their positions for a plain reward function."""
  names = getattr(exp.reward_fn, 'names', None)
  k = 0 if parts is None else len(parts)
  return list(names) if names is not None and len(names) == k else [str(i) for i in range(k)]


def reward_metrics(frags: list, samples: int) -> dict:
  """A step's scoring figures for its metrics row: reward_failed (samples whose reward failed:
  masked out of their groups, or the update skipped; config.reward.failed), reward_retries,
  reward_s_per_sample (seconds spent scoring, workers' and in-process, per sample: the cost to
  state as config.reward.device_s_per_sample when the workers run on accelerators) and
  reward_wait_s (the rollout blocked on scores: what overlapping them with sampling left)."""
  info = [x.reward_info for x in frags]
  return {
      'reward_failed': int(sum(np.sum(~np.isfinite(np.asarray(x.rewards))) for x in frags)),
      'reward_retries': int(sum(i.get('retries', 0) for i in info)),
      'reward_s_per_sample': sum(i.get('compute_s', 0.0) for i in info) / max(samples, 1),
      'reward_wait_s': sum(i.get('wait_s', 0.0) for i in info),
  }


def _title(exp) -> str:
  s = exp.schedule
  parts = [exp.runtime.mode, f'M={s.fragments} ({s.fragment_unit})']
  parts += [n for n, on in (('TSP', s.tsp), ('TAG/BTS', s.tag)) if on]
  if s.tcss_fraction > 0:
    parts.append(f'TCSS phi={s.tcss_fraction}')
  return ' + '.join(parts)
