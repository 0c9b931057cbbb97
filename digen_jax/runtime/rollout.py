"""The rollout role: sample and score fragments, evaluate, and its side of the schedule.

`Sampler` runs the rollout program on one fragment: on the rollout mesh with the published
copy, or (TAG) on the trainer mesh with the trainer's own params. `Evals` runs the periodic
eval with the same program, every step Euler. `RolloutRole` is the rollout's loop: per step it
draws the prompts (the data position has one owner), receives the policy, evaluates if due,
then claims and samples the fragments its runtime/schedule.Schedule names: it is the executor of
runtime/roles.py's rollout handlers on the rollout mesh; with TCSS it starts up to floor(phi*M) fragments of the next batch with the policy it
holds while the next one is not published.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import programs
from digen_jax.experiment import evaluation
from digen_jax.outputs import eval_report
from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import visualize
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.process import interrupt
from digen_jax.rewards import scoring as reward_scoring
from digen_jax.experiment import fragments as frag_lib
from digen_jax.runtime import inputs
from digen_jax.runtime import links
from digen_jax.runtime import roles
from digen_jax.runtime import schedule as sched_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import transfer

Fragment = links.Fragment


class Sampler:
  """Samples and scores fragments of `plan` on `mesh` with params laid out as
  `param_shardings`: the rollout's copy on the rollout mesh, or the trainer's FSDP params on
  the trainer mesh (TAG, role 'trainer')."""

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
    inputs.check_rows(plan, mesh, role)
    self.traj_shardings = programs.trajectory_shardings(mesh, exp)
    self._rep = rep = mesh_lib.replicated(mesh)
    # Compiled ahead of time: a first TAG insertion must not pay (and BTS must not profile)
    # the compilation, and the timeline then shows run time only.
    cond = exp.cond_abstract(plan.rows, lambda nd: mesh_lib.batch_sharding(mesh, nd))
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)
    # Frozen weights on this mesh (TAG: the trainer's own FSDP copy, shared through the cache).
    frozen = exp.weights.frozen(mesh, fsdp=frozen_fsdp, decode=True)
    self._program = (
        programs.make_rollout(
            exp,
            mesh,
            param_shardings,
            self.traj_shardings,
            with_offset=True,
            frozen=frozen,
            samples=plan.size,
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
    self._base_key = jax.device_put(jax.random.key(exp.seed), rep)
    self._uncond = inputs.uncond(exp, plan.rows, mesh)
    self.devices = list(mesh.devices.flat)

  def sample(
      self, params, version: int, batch_prompts: list[str], step: int, f: int, *, wait=True
  ) -> Fragment:
    """Fragment f of step `step`'s batch (batch_prompts: one per sample) with `params`, its
    images submitted to the rewards; wait=False returns before they are scored (`complete`
    takes the scores in: the rollout samples the next fragment meanwhile)."""
    prompts = self.plan.prompts(f, batch_prompts)
    cond = inputs.encode(self.exp, self.plan.pad_prompts(prompts), self.mesh)
    program = 'rollout' if self.role == 'rollout' else 'tag_rollout'
    with inputs.guard(self.guard_level):
      step_arr = jax.device_put(np.int32(step), self._rep)
      offset = jax.device_put(np.int32(f * self.plan.size), self._rep)
      t0 = time.time()
      with self.tracer.span(
          self.devices, self.role, program, step=step, fragment=f, version=version
      ):
        k_rollout, _ = inputs.step_keys(self._base_key, step_arr)
        uncond = self._uncond if self._uncond is not None else cond
        traj, images = self._program(params, cond, uncond, k_rollout, step_arr, offset)
        images = jax.device_get(images)[: self.plan.size]  # the padding rows are not scored
      t1 = time.time()
    frag = Fragment(
        step, f, version, traj, None, self.role, t1 - t0, 0.0, images, t_start=t0, t_end=t1
    )
    frag.pending = reward_scoring.submit(self.exp.reward_fn, images, prompts)
    if wait:
      complete(frag)
    return frag


def complete(frag: Fragment) -> Fragment:
  """Takes a fragment's scores in (blocking until they are): rewards (the weighted total, NaN
  where a reward failed), reward_parts, reward_s (submit to the last score) and reward_info."""
  t = time.perf_counter()
  scores = frag.pending.result()
  frag.pending = None
  frag.rewards, frag.reward_parts, frag.reward_s = scores.total, scores.parts, scores.wall_s
  frag.reward_info = {
      'compute_s': scores.compute_s,
      'wait_s': time.perf_counter() - t,
      'retries': scores.retries,
      'failed': scores.failed,
  }
  return frag


class Evals:
  """Periodic evaluation (config.eval.every) on the rollout mesh with a received policy;
  writes <workdir>/eval/eval_<version>.{json,png,npz} and returns the metrics row."""

  def __init__(self, exp, mesh, workdir: str, *, frozen_fsdp: bool = False):
    self.exp, self.workdir = exp, workdir
    self.every = exp.eval.every
    self.evaluator = None
    if self.every > 0:
      prompts = evaluation.eval_prompts(exp, workdir)
      self.evaluator = evaluation.Evaluator(exp, mesh, prompts, frozen_fsdp=frozen_fsdp)

  @property
  def enabled(self) -> bool:
    return self.evaluator is not None

  def due(self, version: int, start: int) -> bool:
    """Before the rollout of step `version` (a run also evaluates once more at its end): the
    base model of a fresh run, every eval.every versions after the resume point, and the
    resume point itself when the run was evaluating and that eval's row is not in metrics.jsonl
    (its row is written with the next step's: a run stopped in between recorded nothing)."""
    if not self.enabled:
      return False
    if version == start and start > 0 and start % self.every == 0:
      # A run that never evaluated (eval turned on at the resume) has no eval rows: its resume
      # point is not re-evaluated.
      evaluated = metrics_lib.evaluated_steps(self.workdir)
      return bool(evaluated) and start not in evaluated
    return (version == 0 and start == 0) or (version > start and version % self.every == 0)

  def __call__(self, policy) -> dict:
    result = self.evaluator(policy.params, seed=self.exp.eval.seed)
    grid = eval_report.write_report(result, os.path.join(self.workdir, 'eval'), policy.version)
    logging.info('eval at step %d: %s (%s)', policy.version, result['metrics'], grid)
    return {'step': policy.version, **result['metrics']}


def abstract_fragment(exp, plan: frag_lib.FragmentPlan, shardings):
  """ShapeDtypeStructs of one fragment's Trajectory (plan.rows rows) on `shardings` (what a
  trainer process receives)."""
  traj = programs.abstract_trajectory(exp, plan.rows)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), traj, shardings
  )


class RolloutRole:
  """The rollout role of a run from step `start`: `run()` drives its Schedule to the end (and
  the final eval) through `link`."""

  def __init__(
      self, exp, workdir: str, link, sampler: Sampler, evals: Evals, start: int, writer=None
  ):
    """writer: a metrics writer that also takes the sample grids (TensorBoard), or None."""
    self.exp, self.workdir, self.link, self.sampler, self.evals = exp, workdir, link, sampler, evals
    self.writer = writer
    self.plan, self.start, self.total = sampler.plan, start, exp.total_steps
    self.sm = sched_lib.Schedule(
        self.plan,
        start=start,
        total_steps=self.total,
        tcss_fraction=exp.schedule.tcss_fraction,
        final_policy=evals.enabled and start < self.total,
    )
    self.policy, self.eval_info, self.eval_s = None, None, 0.0
    self._drawn: set[int] = set()
    self._grid: dict[int, list[Fragment]] = {}  # this role's fragments per step, for samples/
    self._unsent: list[Fragment] = []  # sampled, their scores not all in yet
    self._pull_s = 0.0
    self.actions: list = []  # what runtime/roles.py took, in order (an action or ClaimLost)

  def run(self) -> None:
    while True:
      interrupt.check('in the rollout')  # in-flight fragments are regenerated after a resume
      if not roles.rollout_turn(self.sm, self):
        break
    self.send_scored(wait=True)
    self.link.finish_rollout()

  # ------------------------------------------------------------------ the executor
  # runtime/roles.py calls these: each runs its part on the devices, then calls `done` at once.

  def now(self) -> float:
    return time.time()

  def took(self, action) -> None:
    self.actions.append(action)

  def policy_ready(self, step: int) -> bool:
    return self.link.policy_ready(step)

  def claim(self, step: int, f: int, role: str) -> bool:
    return self.link.claim(step, f, role)

  def flush(self) -> None:
    self.send_scored(wait=True)  # every fragment is in before the step ends or a policy

  def prompts(self, step: int) -> list[str]:
    """Step `step`'s prompts, one per sample. Drawn before its policy is received (and before
    stale fragments of the step): they do not depend on the policy, so neither role waits for
    them after a publish."""
    if step not in self._drawn:
      prompts = self.exp.prompts.next_batch()
      batch_prompts = [p for p in prompts for _ in range(self.plan.group_size)]
      position = self.exp.prompts.position
      self.link.put(f'prompts/{step}', {'batch_prompts': batch_prompts, 'data_position': position})
      self._drawn.add(step)
    return self.link.get(f'prompts/{step}')['batch_prompts']

  def pull_policy(self, v: int, done) -> None:
    """Waits for policy `v` and takes it (done: once it is held)."""
    if v < self.total:
      self.prompts(v)
    self.policy, self._pull_s = self.link.wait_policy(v)
    if v < self.total:
      self.link.release_before(v)
    done()

  def after_receive(self, v: int) -> None:
    """With policy `v` held: its eval if due (the final policy: its eval only)."""
    if v == self.total:
      self.link.put('final_evals', [self.evals(self.policy)])
      return
    rows, t_eval = [], time.perf_counter()
    if self.evals.due(v, self.start):
      rows.append(self.evals(self.policy))
    self.eval_s = time.perf_counter() - t_eval
    self.eval_info = {'rows': rows, 'eval_s': self.eval_s, 'pull_s': self._pull_s}

  def sample(self, step: int, f: int, version: int) -> None:
    """Samples fragment f of `step` with the held policy (`version`); its scores come in
    while the next one is sampled."""
    policy = self.policy
    frag = self.sampler.sample(
        policy.params, policy.version, self.prompts(step), step, f, wait=False
    )
    if step == policy.version:  # the step's eval counts before its first fragment
      frag.eval_s, self.eval_s = self.eval_s, 0.0
    self._unsent.append(frag)
    self.send_scored(wait=False)

  def send_scored(self, wait: bool) -> None:
    """Sends the sampled fragments in order once scored. Scoring overlaps the next
    fragment's sampling: the newest one waits (unless `wait`) while its scores are not in;
    every earlier one is sent now, blocking on its scores."""
    while self._unsent and (wait or len(self._unsent) > 1 or self._unsent[0].pending.done()):
      self._send(complete(self._unsent.pop(0)))

  def _send(self, frag: Fragment) -> None:
    step, f = frag.step, frag.index
    self.link.send_fragment(frag, self.sampler.tracer.take_new())
    every = self.exp.output.sample_grid_every
    if every and (step + 1) % every == 0:
      self._grid.setdefault(step, []).append(dataclasses.replace(frag, traj=None))
    logging.info(
        'rollout: step %d fragment %d/%d (policy v%d) sampled in %.3fs, scored in %.3fs',
        step + 1,
        f + 1,
        self.plan.num,
        frag.version,
        frag.sample_s,
        frag.reward_s,
    )

  def end_rollout_step(self, step: int) -> None:
    self.link.put(f'evals/{step}', self.eval_info)  # the trainer reads it after its last fragment
    if self._grid.get(step):
      frags = sorted(self._grid.pop(step), key=lambda x: x.index)
      grid = write_grid(self.workdir, step + 1, frags, self.prompts(step), self.plan)
      if self.writer is not None:
        self.writer.write_image('samples', grid, step + 1)


def write_grid(workdir: str, step: int, frags: list[Fragment], batch_prompts, plan):
  """samples/step_<step>.png of the fragments this role sampled (TAG ones are not here), one
  row per prompt group. Returns the grid (uint8 [H, W, 3])."""
  images = np.concatenate([f.images for f in frags])
  captions = [
      f'{p} | r={r:.3f}' + (f' | frag {f.index} v{f.version}' if plan.num > 1 else '')
      for f in frags
      for p, r in zip(plan.prompts(f.index, batch_prompts), f.rewards)
  ]
  return visualize.save_grid(
      os.path.join(workdir, 'samples', f'step_{step:06d}.png'),
      images,
      captions,
      cols=plan.group_size,
  )
