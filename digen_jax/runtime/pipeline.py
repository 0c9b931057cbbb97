"""DigenRL's pipelined schedule (DESIGN.md §3): GAP, TSP, TAG with BTS, TCSS.

The logical batch of a step is cut into M fragments (runtime/fragments.py). The rollout claims
fragments one at a time, samples and scores each with the published policy and streams it to
the trainer (runtime/rollout.py). The trainer computes advantages as soon as a fragment's
prompt groups are complete and accumulates its gradient (runtime/fragment_trainer.py; TSP
shards the timestep axis over the trainer mesh); after the last fragment it makes exactly one
optimizer step and one weight publish.

Which fragment next, whether the trainer samples one itself, which fragments may be stale: the
state machine of runtime/schedule.py decides; this module runs its actions with the real
programs and feeds it the measured times.

TAG: when the trainer has no trainable fragment, BTS (runtime/bts.py) predicts whether the
step ends sooner if the trainer samples an unclaimed fragment itself (the rollout program
compiled for the trainer mesh, with the trainer's current weights, which are the published
ones: no optimizer step happens inside a batch); claims are atomic (runtime/links.py), so a
fragment is sampled once. The helper only adds scored fragments; it never touches the
accumulated gradient or the optimizer state.

TCSS (opt-in, schedule.tcss_fraction = phi > 0): after its share of a batch, while the next
policy is not published yet, the rollout may start up to floor(phi * M) fragments of the next
batch with the current (soon previous) policy; they carry that version (staleness 1), their
behaviour log-probs are the ones the ratio uses, and metrics show the staleness mix.

Roles run concurrently: in one process the rollout is a thread (a LocalLink between the
meshes); across two processes (launch/local.py) a ChannelLink. Every device's busy spans go to
a trace.Tracer (trace.json, timeline.png, per-step utilization).
"""

from __future__ import annotations

import json
import threading
import time

from absl import logging
import jax
import numpy as np

from digen_jax.process import interrupt
from digen_jax.runtime import distributed
from digen_jax.runtime import fragment_trainer
from digen_jax.runtime import fragments as frag_lib
from digen_jax.runtime import links
from digen_jax.runtime import publish
from digen_jax.runtime import rollout as rollout_lib
from digen_jax.runtime import schedule as sched_lib
from digen_jax.runtime import steps as steps_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import workers

plan_of = frag_lib.plan_of


def enabled(config) -> bool:
  """Whether config.schedule asks for the pipelined schedule (else the synchronous loops)."""
  s = config.schedule
  return s.fragments > 1 or s.tag or s.tsp or s.tcss_fraction > 0


def train(exp, workdir: str, cluster) -> dict:
  """Runs the pipelined schedule for this process's role(s). Returns {'params', 'opt_state',
  'step', 'decisions'} where this process trains, else {'step'}."""
  config = exp.config
  level = config.runtime.transfer_guard
  plan = plan_of(config)
  tracer = trace_lib.Tracer(config.schedule.trace)
  if cluster.multi_process:
    me = distributed.process_info().process_id
    role = cluster.role_of(me)
    if role == 'rollout':
      return rollout_lib.rollout_process(exp, workdir, cluster, tracer, level)
    if role != 'trainer':
      raise ValueError(f'config.cluster gives process {me} no role')
  run = steps_lib.TrainerRun(exp, workdir, cluster, tracer)
  trainer, start = run.trainer, run.start
  ft = fragment_trainer.FragmentTrainer(exp, trainer, plan, config.schedule.tsp)
  tag_sampler = (
      rollout_lib.FragmentSampler(
          exp, cluster.trainer.mesh, trainer.param_shardings, plan, 'trainer', tracer, level
      )
      if config.schedule.tag
      else None
  )
  rollout_thread = None
  if cluster.multi_process:
    distributed.kv_set(
        f'{links.KV}/start', json.dumps({'step': start, 'data_position': trainer.data_position})
    )
    link = links.ChannelLink(
        cluster,
        'trainer',
        weights=exp.weights,
        dtype=run.rollout_dtype,
        frag_abstract=rollout_lib.abstract_fragment(exp, plan, ft.traj_shardings),
    )
  else:
    if start:
      exp.prompts.restore(trainer.data_position)
    link = links.LocalLink(
        cluster,
        ft.traj_shardings,
        publish.rollout_param_shardings(cluster, exp.params),
        run.rollout_dtype,
    )
    sampler, evals = rollout_lib.rollout_role(exp, workdir, cluster, tracer, level)

    def run_rollout():
      try:
        rollout_lib.rollout_loop(exp, workdir, link, tracer, start, sampler, evals)
      except (links.PeerFailed, interrupt.Interrupted):
        pass  # the trainer stops the run (and says why)
      except BaseException as e:  # pylint: disable=broad-except
        logging.exception('rollout thread failed')
        link.fail(e)

    rollout_thread = threading.Thread(target=run_rollout, name='rollout', daemon=True)
    rollout_thread.start()
  try:
    with run.stops_cleanly():
      out = _trainer_loop(run, ft, tag_sampler, link, plan)
  except BaseException as e:
    link.fail(e)
    if rollout_thread is not None and isinstance(e, interrupt.Interrupted):
      rollout_thread.join(timeout=30)  # it stops between fragments; the watchdog bounds this
    raise
  link.close()
  if rollout_thread is not None:
    rollout_thread.join()
    if link.error is not None:
      raise RuntimeError('the rollout thread failed') from link.error
  return out


class _Batch:
  """The trainer's fragments of one logical batch: scored ones, rewards, advantages."""

  def __init__(self, plan: frag_lib.FragmentPlan):
    self.plan = plan
    self.rewards = np.full((plan.batch,), np.nan, np.float32)
    self.frags: dict[int, links.Fragment] = {}
    self.adv_valid: dict[int, tuple] = {}

  def add(self, frag: links.Fragment) -> None:
    self.frags[frag.index] = frag
    self.rewards[list(self.plan.samples(frag.index))] = frag.rewards


def _trainer_loop(
    run: steps_lib.TrainerRun,
    ft: fragment_trainer.FragmentTrainer,
    tag_sampler,
    link: links.Link,
    plan: frag_lib.FragmentPlan,
) -> dict:
  exp, cluster, tracer, level = run.exp, run.cluster, run.tracer, run.level
  config = exp.config
  tcss = config.schedule.tcss_fraction > 0
  sm = sched_lib.Schedule(
      plan,
      start=run.start,
      total_steps=run.total,
      tag=tag_sampler is not None,
      tcss_fraction=config.schedule.tcss_fraction,
      final_policy=run.final_eval,
      trainer_speed=cluster.trainer.speed,
      rollout_speed=cluster.rollout.speed,
  )
  batches: dict[int, _Batch] = {}  # per step; later steps' fragments may come early

  def publish_next() -> float | None:
    """Runs the schedule's Publish, if it has one now. Returns its seconds (None: none)."""
    action = sm.trainer_action(time.time())
    if not isinstance(action, sched_lib.Publish):
      return None
    _, seconds = run.publish(link.publish, action.version, ft.devices)
    sm.published(action.version, run.published_at[action.version])
    return seconds

  def take() -> float:
    """The next fragment from the rollout (blocking) into its batch. Returns the pull time."""
    with workers.guard(level):
      frag, spans, pull_s = link.receive_fragment()
    tracer.extend(trace_lib.Span.from_json(s) for s in spans if cluster.multi_process)
    batches.setdefault(frag.step, _Batch(plan)).add(frag)
    sm.fragment_arrived(
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
    return pull_s

  # Step windows are contiguous: step n's wall time runs from the start of its policy's
  # publish to the start of the next one, so nothing the trainer does is left out of them.
  t_step = time.time()
  publish_s = publish_next() or 0.0
  for step in range(run.start, run.total):
    batch_prompts = link.get(f'prompts/{step}')['batch_prompts']
    # Text conditioning of every fragment now, while the first fragment is being sampled.
    conds = {f: ft.encode(plan.prompts(f, batch_prompts)) for f in range(plan.num)}
    batch = batches.setdefault(step, _Batch(plan))
    decisions = []
    move_s, grad_s, tag_s = 0.0, 0.0, 0.0
    with workers.guard(level):
      indices, acc = ft.begin(step)
    while True:
      while link.poll():
        move_s += take()
      if sm.needs_claims():
        sm.note_claims(
            step, {f: (c['who'], c['t']) for f, c in link.claims(step, plan.num).items()}
        )
      action = sm.trainer_action(time.time())
      if isinstance(action, sched_lib.Apply):
        break
      if isinstance(action, sched_lib.TrainFragment):
        f = action.index
        t0 = time.perf_counter()
        with workers.guard(level):
          with tracer.span(ft.devices, 'trainer', 'grad', step=step, fragment=f, version=step):
            batch.adv_valid[f] = ft.advantages(f, batch.rewards)
            acc = jax.block_until_ready(
                ft.grad(acc, indices, batch.frags[f].traj, conds[f], *batch.adv_valid[f])
            )
        dt = time.perf_counter() - t0
        grad_s += dt
        sm.trained(step, f, dt)
        continue
      dec = action.decision
      if isinstance(action, sched_lib.SampleFragment):
        f = action.index
        if link.claim(step, f, sched_lib.TRAINER):
          sm.claimed(step, f, sched_lib.TRAINER, time.time())
          dec['fragment'] = f
          t0 = time.perf_counter()
          frag = tag_sampler.sample(run.trainer.params, step, batch_prompts, step, f)
          dt = time.perf_counter() - t0
          tag_s += dt
          batch.add(frag)
          sm.fragment_arrived(step, f, step, sched_lib.TRAINER)
          sm.sampled_by_trainer(frag.sample_s + frag.reward_s, dt)
        else:
          dec.update(action='wait', reason=f'fragment {f} was claimed by the rollout first')
      if dec is not None:
        logging.info(
            'BTS step %d: %s (%s)%s',
            step + 1,
            dec['action'],
            dec['reason'],
            ''
            if 'makespan_wait' not in dec
            else f" predicted {dec['makespan_wait']:.3f}s wait vs "
            f"{dec['makespan_insert']:.3f}s insert",
        )
        tracer.decision(dec)
        decisions.append(dec)
        if dec['action'] == 'insert':
          continue
      move_s += take()

    evals_info = link.get(f'evals/{step}')
    run.write_rows(evals_info['rows'])
    link.weights_delivered()  # the rollout holds its copy: params may be donated
    t0 = time.perf_counter()
    m = _apply(run, ft, step, indices, acc, batch, conds)
    apply_s = time.perf_counter() - t0
    sm.applied(step)
    t_end = time.time()
    wall = t_end - t_step - evals_info['eval_s']
    step_publish_s, step_t0 = publish_s, t_step
    # The next policy goes out before this step's bookkeeping: the rollout starts the next
    # batch while the trainer writes metrics and checkpoints (that time counts to the next step).
    publish_s = publish_next()
    if publish_s is not None and not tcss:
      # The rollout's first fragment waits for this pull, and the trainer has nothing to do
      # before that fragment arrives: let the pull run alone rather than beside the
      # bookkeeping below (on a shared host the two compete; measured 6-8 ms vs 9-15 ms).
      link.weights_delivered()
    t_step = t_end
    frags = [batch.frags[f] for f in range(plan.num)]
    valid_frac = float(
        np.mean([np.mean(jax.device_get(batch.adv_valid[f][1])) for f in range(plan.num)])
    )
    versions = np.repeat([x.version for x in frags], plan.size)
    extra = dict(
        fragments=plan.num,
        tag_fragments=sum(x.producer == 'trainer' for x in frags),
        tag_s=tag_s,
        bts_decisions=len(decisions),
        bts_inserts=sum(d['action'] == 'insert' for d in decisions),
    )
    if tcss:
      lags = step - versions
      extra['staleness_mix'] = {str(k): float(np.mean(lags == k)) for k in range(2)}
    run.end_step(
        step,
        data_position=link.get(f'prompts/{step}')['data_position'],
        extra=extra,
        policy_version=int(versions.min()),
        rewards=batch.rewards,
        valid_frac=valid_frac,
        metrics=m,
        wall_s=wall,
        rollout_s=sum(x.sample_s for x in frags if x.producer == 'rollout'),
        reward_s=sum(x.reward_s for x in frags),
        update_s=grad_s + apply_s,
        publish_s=(step_publish_s or 0.0) + evals_info['pull_s'],
        batch_move_s=move_s,
        utilization=tracer.utilization(step_t0, t_end, cluster.num_devices),
    )
    del batches[step]
  if run.final_eval:  # policy total_steps was published after the last step
    run.write_rows(link.get('final_evals'))
    link.weights_delivered()
  return run.finish(_title(config), decisions=tracer.decisions)


def _apply(run, ft, step: int, indices, acc, batch: _Batch, conds) -> dict:
  """The step's optimizer step (and further PPO epochs over the stored batch). Returns its
  metrics as floats."""
  tracer, plan = run.tracer, ft.plan
  with workers.guard(run.level):
    with tracer.span(ft.devices, 'trainer', 'apply', step=step, version=step + 1):
      m = jax.device_get(ft.apply(acc))
    for _ in range(1, run.exp.config.rl.inner_epochs):
      _, acc = ft.begin(step)
      with tracer.span(ft.devices, 'trainer', 'grad', step=step, version=step + 1):
        for f in range(plan.num):
          acc = ft.grad(acc, indices, batch.frags[f].traj, conds[f], *batch.adv_valid[f])
        jax.block_until_ready(acc)
      with tracer.span(ft.devices, 'trainer', 'apply', step=step, version=step + 1):
        m_e = jax.device_get(ft.apply(acc))
      m['nonfinite'] = max(float(m['nonfinite']), float(m_e['nonfinite']))
  return {k: float(v) for k, v in m.items()}


def _title(config) -> str:
  s = config.schedule
  parts = [config.runtime.mode, f'M={s.fragments} ({s.fragment_unit})']
  parts += [n for n, on in (('TSP', s.tsp), ('TAG/BTS', s.tag)) if on]
  if s.tcss_fraction > 0:
    parts.append(f'TCSS phi={s.tcss_fraction}')
  return ' + '.join(parts)
