"""The rollout role of the pipelined schedule (runtime/pipeline.py): sample and score
fragments, driven by the rollout's side of runtime/schedule.py.

`FragmentSampler` runs the rollout program on one fragment: on the rollout mesh with the
published copy, or (TAG) on the trainer mesh with the trainer's own params. `rollout_loop` is
the rollout role: per step it receives the policy, draws the prompts (the data position has
one owner), evaluates if due, then claims and samples the fragments the schedule names; with
TCSS it starts up to floor(phi*M) fragments of the next batch with the policy it holds while
the next one is not published.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.process import interrupt
from digen_jax import programs
from digen_jax.runtime import distributed
from digen_jax.runtime import fragments as frag_lib
from digen_jax.runtime import links
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import publish
from digen_jax.runtime import schedule as sched_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import transfer
from digen_jax.runtime import workers

Fragment = links.Fragment


class FragmentSampler:
  """Samples and scores fragments on `mesh` with params laid out as `param_shardings`: the
  rollout's copy on the rollout mesh, or the trainer's FSDP params on the trainer mesh (TAG)."""

  def __init__(
      self,
      exp,
      mesh,
      param_shardings,
      plan: frag_lib.FragmentPlan,
      role: str,
      tracer: trace_lib.Tracer,
      guard_level: str,
      param_dtype=None,
      *,
      frozen_fsdp: bool = True,
  ):
    self.exp, self.mesh, self.plan, self.role, self.tracer = exp, mesh, plan, role, tracer
    self.guard_level = guard_level
    self.traj_shardings = programs.trajectory_shardings(mesh)
    rep = mesh_lib.replicated(mesh)
    self._rep = rep
    # Compiled ahead of time: a first TAG insertion must not pay (and BTS must not profile)
    # the compilation, and the timeline then shows run time only.
    n = plan.size
    sds = jax.ShapeDtypeStruct
    data = lambda nd: mesh_lib.batch_sharding(mesh, nd)
    cond = exp.cond_abstract(n, data)
    scalar = lambda dt: sds((), dt, sharding=rep)
    # Frozen weights on this mesh (TAG: the trainer's own FSDP copy, shared through the cache).
    frozen = exp.weights.frozen(mesh, fsdp=frozen_fsdp, decode=True)
    self._program = (
        programs.make_rollout(
            exp, mesh, param_shardings, self.traj_shardings, with_offset=True, frozen=frozen
        )
        .lower(
            transfer.abstract(exp.params, param_shardings, param_dtype),
            cond,
            cond,
            scalar(jax.random.key(0).dtype),
            scalar(jnp.int32),
            scalar(jnp.int32),
        )
        .compile()
    )
    self._base_key = jax.device_put(jax.random.key(exp.config.seed), rep)
    self._uncond = workers.uncond(exp, plan.size, mesh)
    self._devices = list(mesh.devices.flat)

  def sample(self, params, version: int, batch_prompts: list[str], step: int, f: int) -> Fragment:
    """Fragment f of step `step`'s batch (batch_prompts: one per sample) with `params`."""
    prompts = self.plan.prompts(f, batch_prompts)
    cond = workers.encode(self.exp, prompts, self.mesh)
    program = 'rollout' if self.role == 'rollout' else 'tag_rollout'
    with workers.guard(self.guard_level):
      step_arr = jax.device_put(np.int32(step), self._rep)
      offset = jax.device_put(np.int32(f * self.plan.size), self._rep)
      t0 = time.time()
      with self.tracer.span(
          self._devices, self.role, program, step=step, fragment=f, version=version
      ):
        k_rollout, _ = workers.step_keys(self._base_key, step_arr)
        uncond = self._uncond if self._uncond is not None else cond
        traj, images = self._program(params, cond, uncond, k_rollout, step_arr, offset)
        images = jax.device_get(images)
      t1 = time.time()
    rewards = np.asarray(self.exp.reward_fn(images, prompts), np.float32)
    return Fragment(
        step,
        f,
        version,
        traj,
        rewards,
        self.role,
        t1 - t0,
        time.time() - t1,
        images,
        t_start=t0,
        t_end=t1,
    )


def abstract_fragment(exp, plan, shardings) -> Any:
  """ShapeDtypeStructs of one fragment's Trajectory on `shardings` (what the trainer process
  receives): the batch abstract with the sample axis cut to plan.size."""
  ab = workers.abstract_batch(exp)['traj']
  cut = lambda x, ax: jax.ShapeDtypeStruct(x.shape[:ax] + (plan.size,) + x.shape[ax + 1 :], x.dtype)
  ab = (
      ab._replace(latents=cut(ab.latents, 1), log_probs=cut(ab.log_probs, 1), stds=cut(ab.stds, 1))
      if hasattr(ab, '_replace')
      else dataclasses.replace(
          ab, latents=cut(ab.latents, 1), log_probs=cut(ab.log_probs, 1), stds=cut(ab.stds, 1)
      )
  )
  return workers.with_shardings(ab, shardings)


def rollout_loop(
    exp,
    workdir: str,
    link: links.Link,
    tracer: trace_lib.Tracer,
    start: int,
    sampler: FragmentSampler,
    evals,
) -> None:
  """The rollout role from step `start` to the end (and the final eval), the order of its
  actions given by runtime/schedule.py."""
  config = exp.config
  plan = frag_lib.plan_of(config)
  total = config.total_steps
  sm = sched_lib.Schedule(
      plan,
      start=start,
      total_steps=total,
      tcss_fraction=config.schedule.tcss_fraction,
      final_policy=evals.enabled and start < total,
  )
  drawn = set()
  grid: dict[int, list[Fragment]] = {}  # this role's fragments per step, for samples/
  every = config.sample_grid_every
  policy, eval_info, eval_s = None, None, 0.0

  def draw(step):
    # The prompts do not depend on the policy: they are drawn before it is received (and
    # before stale fragments of the step), so neither role waits for them after a publish.
    if step not in drawn:
      prompts = exp.prompts.next_batch()
      batch_prompts = [p for p in prompts for _ in range(plan.group_size)]
      link.put(
          f'prompts/{step}', {'batch_prompts': batch_prompts, 'data_position': exp.prompts.position}
      )
      drawn.add(step)
    return link.get(f'prompts/{step}')['batch_prompts']

  while True:
    interrupt.check('in the rollout')  # in-flight fragments are regenerated after a resume
    ready = sm.stale_window() and link.policy_ready(sm.rollout_step)
    action = sm.rollout_action(next_policy_ready=ready)
    if isinstance(action, sched_lib.Done):
      break
    if isinstance(action, sched_lib.ReceivePolicy):
      v = action.version
      if v == total:  # the final policy: its eval only
        policy, _ = link.wait_policy(v)
        sm.policy_received(v)
        link.put('final_evals', [evals(policy)])
        continue
      draw(v)
      policy, pull_s = link.wait_policy(v)
      link.release_before(v)
      sm.policy_received(v)
      eval_rows, t_eval = [], time.perf_counter()
      if evals.due(v, start):
        eval_rows.append(evals(policy))
      eval_s = time.perf_counter() - t_eval
      eval_info = {'rows': eval_rows, 'eval_s': eval_s, 'pull_s': pull_s}
    elif isinstance(action, sched_lib.SampleFragment):
      step, f = action.step, action.index
      if not link.claim(step, f, sched_lib.ROLLOUT):  # the trainer took it (TAG)
        sm.claimed(step, f, sched_lib.TRAINER, time.time())
        continue
      sm.claimed(step, f, sched_lib.ROLLOUT, time.time())
      frag = sampler.sample(policy.params, policy.version, draw(step), step, f)
      if step == policy.version:  # the step's eval counts before its first fragment
        frag.eval_s, eval_s = eval_s, 0.0
      link.send_fragment(frag, tracer.take_new())
      if every and (step + 1) % every == 0:
        grid.setdefault(step, []).append(dataclasses.replace(frag, traj=None))
      logging.info(
          'rollout: step %d fragment %d/%d (policy v%d) sampled in %.3fs',
          step + 1,
          f + 1,
          plan.num,
          policy.version,
          frag.sample_s,
      )
    elif isinstance(action, sched_lib.EndRolloutStep):
      step = action.step
      link.put(f'evals/{step}', eval_info)  # the trainer reads it after its last fragment
      if grid.get(step):
        _write_grid(
            workdir, step + 1, sorted(grid.pop(step), key=lambda x: x.index), draw(step), plan
        )
      sm.rollout_step_ended(step)
    else:
      raise AssertionError(f'the rollout cannot {action}')
  link.finish_rollout()


def _write_grid(workdir: str, step: int, frags: list[Fragment], batch_prompts, plan):
  """samples/step_<step>.png of the fragments this role sampled (TAG ones are not here)."""
  from digen_jax.outputs import visualize  # pylint: disable=g-import-not-at-top

  images = np.concatenate([f.images for f in frags])
  captions = [
      f'{p} | r={r:.3f} | frag {f.index} v{f.version}'
      for f in frags
      for p, r in zip(plan.prompts(f.index, batch_prompts), f.rewards)
  ]
  visualize.save_grid(
      os.path.join(workdir, 'samples', f'step_{step:06d}.png'),
      images,
      captions,
      cols=plan.group_size,
  )


def rollout_role(
    exp, workdir: str, cluster, tracer: trace_lib.Tracer, level: str
) -> tuple[FragmentSampler, workers.EvalRunner]:
  """The rollout's FragmentSampler and EvalRunner on the rollout mesh."""
  frozen_fsdp = publish.rollout_frozen_fsdp(cluster)
  sampler = FragmentSampler(
      exp,
      cluster.rollout.mesh,
      publish.rollout_param_shardings(cluster, exp.params),
      frag_lib.plan_of(exp.config),
      'rollout',
      tracer,
      level,
      publish.rollout_param_dtype(cluster),
      frozen_fsdp=frozen_fsdp,
  )
  evals = workers.EvalRunner(exp, cluster.rollout.mesh, workdir, frozen_fsdp=frozen_fsdp)
  return sampler, evals


def rollout_process(exp, workdir: str, cluster, tracer: trace_lib.Tracer, level: str) -> dict:
  """The rollout process of a two-process run: starts where the trainer's checkpoint does."""
  config = exp.config
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
      wait_for_pull=config.schedule.wait_for_pull,
      shared_claims=config.schedule.tag,
  )
  sampler, evals = rollout_role(exp, workdir, cluster, tracer, level)
  rollout_loop(exp, workdir, link, tracer, start, sampler, evals)
  return {'step': config.total_steps}
