"""The per-step work of the two roles, shared by every schedule (colocated, disagg, ...).

`RolloutWorker`: prompts + a published policy -> trajectories, images, rewards and advantages on
the rollout mesh. `TrainerWorker`: the trainer state (FSDP float32 params and optimizer state,
orbax checkpoints) and one GRPO update per batch on the trainer mesh. Schedules decide where
each runs and how weights and batches travel between them; the math is the same everywhere:
both roles derive their keys from (config.seed, step), and every sample's noise key folds in its
index, so a sample does not depend on how the batch is cut or where it runs.

The device work of each step runs under jax.transfer_guard(config.runtime.transfer_guard)
('disallow' by default): an implicit host<->device copy in the hot path is an error, not a
silent slowdown. Host work (text encoding, reward scoring, metrics) stays outside the guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.experiment import evaluation
from digen_jax.outputs import eval_report
from digen_jax import programs
from digen_jax.models import family as family_lib
from digen_jax.models import lora as lora_lib
from digen_jax.rl import advantages as adv_lib
from digen_jax.parallel import mesh as mesh_lib


@jax.jit
def step_keys(base_key, step):
  """(k_rollout, k_update) of `step`: the same in every role, mode and process."""
  k = jax.random.split(jax.random.fold_in(base_key, step))
  return k[0], k[1]


def encode(exp, prompts: list[str], mesh):
  """Text conditioning for `prompts`, batch-sharded on `mesh` (host encoder, explicit copy)."""
  cond = exp.conditioning(prompts)
  return jax.device_put(cond, programs.cond_shardings(mesh, cond))


def uncond(exp, batch: int, mesh):
  """CFG's unconditional branch (config.sampler.negative_prompt) for `batch` samples on `mesh`,
  or None without CFG."""
  c = exp.config
  if c.sampler.guidance_scale <= 1.0:
    return None
  return encode(exp, [c.sampler.negative_prompt] * batch, mesh)


def trainer_batch_shardings(mesh) -> dict:
  """Where the update program takes a batch: {'traj', 'adv' [B], 'valid' [B]} batch-sharded."""
  return {
      'traj': programs.trajectory_shardings(mesh),
      'adv': mesh_lib.batch_sharding(mesh, 1),
      'valid': mesh_lib.batch_sharding(mesh, 1),
  }


def rollout_batch_shardings(mesh) -> dict:
  """Where the rollout leaves a batch: advantages replicated (every device computes all groups,
  so their values do not depend on the mesh)."""
  rep = mesh_lib.replicated(mesh)
  return {'traj': programs.trajectory_shardings(mesh), 'adv': rep, 'valid': rep}


def _span(tracer, mesh, role: str, program: str, step: int, version: int):
  """tracer.span over `mesh`'s devices, or nothing without a tracer."""
  if tracer is None:
    return contextlib.nullcontext()
  return tracer.span(list(mesh.devices.flat), role, program, step=step, version=version)


def guard(level: str):
  """jax.transfer_guard(level) for the device work of a step (config.runtime.transfer_guard)."""
  return jax.transfer_guard(level)


@dataclasses.dataclass
class RolloutOutput:
  """One step's rollout. batch: {'traj', 'adv', 'valid'} on the rollout mesh."""

  batch: Any
  step: int
  policy_version: int
  prompts: list[str]  # one per group
  batch_prompts: list[str]  # one per sample, group-contiguous
  rewards: np.ndarray  # [B] float32
  valid_frac: float
  images: np.ndarray  # [B, H, W, 3] in [-1, 1]
  rollout_s: float  # sampling + decode (device busy)
  reward_s: float  # host reward scoring


class RolloutWorker:
  """The rollout role on `mesh`: one compiled sampling program for params laid out as
  `param_shardings` (the published rollout copy)."""

  def __init__(
      self, exp, mesh, param_shardings, guard_level: str = 'allow', *, frozen_fsdp: bool = False
  ):
    self.exp, self.mesh, self.param_shardings = exp, mesh, param_shardings
    self.guard_level = guard_level
    c = exp.config
    self.batch_shardings = rollout_batch_shardings(mesh)
    traj_sh = self.batch_shardings['traj']
    # Frozen weights (LoRA base, VAE) on this mesh, laid out by publish.rollout_frozen_fsdp
    # (colocated: the trainer's own FSDP copy, not a second one).
    self.frozen = exp.weights.frozen(mesh, fsdp=frozen_fsdp, decode=True)
    self._rollout = programs.make_rollout(exp, mesh, param_shardings, traj_sh, frozen=self.frozen)
    self._rep = mesh_lib.replicated(mesh)
    self._advantages = jax.jit(
        functools.partial(
            adv_lib.grpo_advantages,
            group_size=c.rl.group_size,
            std_mode=c.rl.adv_std,
            eps=c.rl.adv_eps,
            clip=c.rl.adv_clip,
        ),
        in_shardings=self._rep,
        out_shardings=(self._rep, self._rep),
    )
    self._uncond = uncond(exp, exp.batch_size, mesh)
    self._base_key = jax.device_put(jax.random.key(c.seed), self._rep)

  def generate(self, policy, prompts: list[str], step: int, tracer=None) -> RolloutOutput:
    """Samples one group per prompt with `policy` (a publish.Policy on this mesh), decodes,
    scores on the host and computes the GRPO advantages. `tracer` (runtime.trace.Tracer)
    records the sampling + decode as a busy span of the rollout devices."""
    G = self.exp.config.rl.group_size
    batch_prompts = [p for p in prompts for _ in range(G)]  # group-contiguous
    t0 = time.perf_counter()
    cond = encode(self.exp, batch_prompts, self.mesh)
    with (
        guard(self.guard_level),
        _span(tracer, self.mesh, 'rollout', 'rollout', step, policy.version),
    ):
      step_arr = jax.device_put(np.int32(step), self._rep)
      k_rollout, _ = step_keys(self._base_key, step_arr)
      uncond = self._uncond if self._uncond is not None else cond
      traj, images = self._rollout(policy.params, cond, uncond, k_rollout, step_arr)
      images = jax.device_get(images)
    t1 = time.perf_counter()
    rewards = np.asarray(self.exp.reward_fn(images, batch_prompts), np.float32)
    t2 = time.perf_counter()
    with guard(self.guard_level):
      adv, valid = self._advantages(jax.device_put(rewards, self._rep))
      valid_frac = float(np.mean(jax.device_get(valid)))
    return RolloutOutput(
        batch={'traj': traj, 'adv': adv, 'valid': valid},
        step=step,
        policy_version=policy.version,
        prompts=list(prompts),
        batch_prompts=batch_prompts,
        rewards=rewards,
        valid_frac=valid_frac,
        images=images,
        rollout_s=t1 - t0,
        reward_s=t2 - t1,
    )


def abstract_batch(exp) -> dict:
  """Shapes and dtypes of one rollout batch {'traj', 'adv', 'valid'}: the rollout program
  traced (not compiled) on one local device. Lay it out with `with_shardings`."""
  mesh = mesh_lib.make_mesh(jax.local_devices()[:1])
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  b = exp.batch_size
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), exp.params)
  cond = exp.cond_abstract(b)
  frozen = exp.weights.frozen_abstract(decode=True)
  traj, _ = jax.eval_shape(
      programs.make_rollout(exp, mesh, frozen=frozen),
      params,
      cond,
      cond,
      sds((), jax.random.key(0).dtype),
      sds((), jnp.int32),
  )
  return {'traj': traj, 'adv': sds((b,), jnp.float32), 'valid': sds((b,), jnp.bool_)}


def with_shardings(abstract, shardings):
  """ShapeDtypeStructs of `abstract` laid out on `shardings` (same tree): what Channel.receive
  takes."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )


class TrainerWorker:
  """The trainer role on `mesh`: FSDP float32 params and optimizer state (restored from
  `checkpointer` when it holds a step), the compiled update program, checkpoint saves."""

  def __init__(self, exp, mesh, checkpointer, guard_level: str = 'allow'):
    self.exp, self.mesh, self.checkpointer = exp, mesh, checkpointer
    self.guard_level = guard_level
    c = exp.config
    self.param_shardings = mesh_lib.fsdp_shardings(exp.params, mesh)
    self.params = exp.weights.init_params(self.param_shardings)
    # The frozen weights this mesh's programs read (the LoRA base; the VAE only for TAG).
    self.frozen = exp.weights.frozen(mesh, fsdp=True, decode=c.schedule.tag)
    opt_shapes = jax.eval_shape(exp.optimizer.init, self.params)
    self.opt_shardings = mesh_lib.fsdp_shardings(opt_shapes, mesh)
    self.opt_state = jax.jit(exp.optimizer.init, out_shardings=self.opt_shardings)(self.params)
    # The KL reference is the initial model, also after a resume (with LoRA: the frozen base,
    # adapters off, with no second copy).
    self.ref_params = (
        jax.tree.map(jnp.copy, self.params)
        if c.rl.kl_beta > 0 and exp.weights.lora is None
        else None
    )
    base_key = jax.random.key(c.seed)
    self.start, self.data_position = 0, 0
    self.skipped_updates = 0  # over the whole run, resumes included (checkpoint meta)
    # The newest readable step (a corrupt newer one is set aside with a warning).
    restored = checkpointer.restore_latest(
        {'params': self.params, 'opt_state': self.opt_state, 'rng': ckpt_lib.key_to_data(base_key)}
    )
    if restored is not None:
      self.start, state, meta = restored
      self.params, self.opt_state = state['params'], state['opt_state']
      base_key = ckpt_lib.data_to_key(state['rng'])
      self.data_position = int(meta['data_position'])
      self.skipped_updates = int(meta.get('skipped_updates', 0))
      logging.info(
          'resumed from %s at step %d (data position %d)',
          checkpointer.directory,
          self.start,
          self.data_position,
      )
    # The step whose end self.params/opt_state are (optimizer steps applied so far).
    self.params_step = self.start
    self._rng_data = ckpt_lib.key_to_data(base_key)
    self._rep = mesh_lib.replicated(mesh)
    self._base_key = jax.device_put(base_key, self._rep)
    self.batch_shardings = trainer_batch_shardings(mesh)
    self._update = programs.make_update(
        exp,
        mesh,
        self.param_shardings,
        self.opt_shardings,
        traj_shardings=self.batch_shardings['traj'],
        frozen=self.frozen,
    )
    self._uncond = uncond(exp, exp.batch_size, mesh)

  def compile_update(self) -> None:
    """Compiles the update program for this mesh's batch layout without a batch (abstract
    inputs), so it can compile while the rollout samples the first batch; train_step then
    reuses the executable."""
    batch = with_shardings(abstract_batch(self.exp), self.batch_shardings)
    cond = self.exp.cond_abstract(self.exp.batch_size)
    cond = with_shardings(cond, programs.cond_shardings(self.mesh, cond))
    self._update.lower(*self._update_args(batch, cond, self.start)).compile()

  def _update_args(self, batch, cond, step: int) -> tuple:
    """The update program's arguments for `batch` and its conditioning at `step` (arrays or,
    to compile, their abstract layouts)."""
    step_arr = jax.device_put(np.int32(step), self._rep)
    _, k_update = step_keys(self._base_key, step_arr)
    uncond = self._uncond if self._uncond is not None else cond
    return (
        self.params,
        self.opt_state,
        batch['traj'],
        cond,
        uncond,
        batch['adv'],
        batch['valid'],
        k_update,
        step_arr,
        self.ref_params,
    )

  def train_step(
      self, batch, batch_prompts: list[str], step: int, tracer=None
  ) -> tuple[dict, float]:
    """One GRPO update on `batch` (on self.batch_shardings). Returns (metrics, seconds)."""
    cond = encode(self.exp, batch_prompts, self.mesh)
    t0 = time.perf_counter()
    with guard(self.guard_level), _span(tracer, self.mesh, 'trainer', 'update', step, step):
      self.params, self.opt_state, m = self._update(*self._update_args(batch, cond, step))
      self.params_step = step + 1
      m = jax.device_get(m)
    return {k: float(v) for k, v in m.items()}, time.perf_counter() - t0

  def save(self, step: int, data_position: int, *, force: bool = False):
    self.checkpointer.save(
        step,
        {'params': self.params, 'opt_state': self.opt_state, 'rng': self._rng_data},
        {
            'step': step,
            'data_position': int(data_position),
            'policy_version': step,
            'skipped_updates': self.skipped_updates,
        },
        force=force,
    )
    if force and self.exp.weights.lora is not None:
      # The run's adapters as diffusers' own LoRA loader reads them (README "Real models").
      folder = os.path.join(os.path.dirname(self.checkpointer.directory), 'lora')
      lora_lib.save_diffusers_lora(
          folder,
          jax.device_get(self.params),
          self.exp.weights.lora,
          family_lib.of(self.exp.config).key_table(self.exp.model_config),
      )

  def close(self):
    self.checkpointer.close()


def step_row(
    *,
    step: int,
    policy_version: int,
    rewards: np.ndarray,
    valid_frac: float,
    metrics: dict,
    wall_s: float,
    rollout_s: float,
    reward_s: float,
    update_s: float,
    publish_s: float,
    publish_mb: float,
    batch_move_s: float,
    cluster,
    utilization: float | None = None,
) -> dict:
  """The metrics.jsonl row of one optimizer step.

  utilization = busy device-seconds / (devices x wall seconds): given from the trace spans
  (runtime/trace.py), else estimated as rollout devices busy while sampling, trainer devices
  while updating (host reward scoring and transfers count as idle)."""
  busy = cluster.rollout.size * rollout_s + cluster.trainer.size * update_s
  if utilization is None:
    utilization = busy / (cluster.num_devices * wall_s)
  batch = int(np.size(rewards))
  rewards = np.asarray(rewards, np.float32)
  finite = rewards[np.isfinite(rewards)]  # a faulty reward's NaN must not hide the others
  return {
      'step': step,
      'policy_version': policy_version,
      'reward_mean': float(np.mean(finite)) if finite.size else float('nan'),
      'reward_std': float(np.std(finite)) if finite.size else float('nan'),
      'nonfinite_rewards': batch - int(finite.size),
      'samples': batch,
      'samples_per_s': batch / wall_s,
      'wall_s': wall_s,
      'rollout_s': rollout_s,
      'reward_s': reward_s,
      'update_s': update_s,
      'publish_s': publish_s,
      'publish_mb': publish_mb,
      'batch_move_s': batch_move_s,
      'utilization': min(1.0, utilization),
      'valid_frac': valid_frac,
      **metrics,
  }


class EvalRunner:
  """Periodic evaluation (config.eval.every) on the rollout mesh with a published policy;
  writes <workdir>/eval/eval_<version>.{json,png} and returns the metrics row."""

  def __init__(self, exp, mesh, workdir: str, *, frozen_fsdp: bool = False):
    self.exp, self.workdir = exp, workdir
    self.every = exp.config.eval.every
    self.evaluator = (
        evaluation.Evaluator(
            exp, mesh, evaluation.eval_prompts(exp, workdir), frozen_fsdp=frozen_fsdp
        )
        if self.every > 0
        else None
    )

  @property
  def enabled(self) -> bool:
    return self.evaluator is not None

  def due(self, version: int, start: int) -> bool:
    """Before the rollout of step `version` (a run also evaluates once more at its end): the
    base model of a fresh run, and every eval.every versions after the resume point (the run
    that stopped there evaluated it)."""
    if not self.enabled:
      return False
    return (version == 0 and start == 0) or (version > start and version % self.every == 0)

  def __call__(self, policy) -> dict:
    result = self.evaluator(policy.params, seed=self.exp.config.eval.seed)
    grid = eval_report.write_report(result, os.path.join(self.workdir, 'eval'), policy.version)
    logging.info('eval at step %d: %s (%s)', policy.version, result['metrics'], grid)
    return {'step': policy.version, **result['metrics']}
