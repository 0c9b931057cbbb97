"""The trainer role's state and programs: FSDP float32 params and optimizer state (restored from
the checkpointer when it holds a step), and per logical batch: the trained step indices, each
fragment's advantages (once its prompt groups are scored) and gradient, one optimizer step.

A batch cut into M > 1 fragments accumulates fragment gradients (programs.make_fragment_grad;
TSP lays the K trained steps x the fragment's samples over a (t, b) view of the trainer mesh,
programs/tsp.py: a program choice the schedule sees only as a cost) and applies once
(programs.make_apply): the same update as a whole-batch one to float rounding (the loss
denominator is the whole batch's pair weight, applied at the end). A batch
trained as one fragment without TSP runs the fused program instead (programs.make_update:
gradient and optimizer step in one program, no accumulator), which is what M = 1 costs.
"""

from __future__ import annotations

import os
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import programs
from digen_jax.models.lora import adapters as lora_lib
from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.rl import advantages as adv_lib
from digen_jax.experiment import fragments as frag_lib
from digen_jax.runtime import inputs


class Trainer:
  """The trainer role on `mesh` for batches cut as `plan`."""

  def __init__(
      self,
      exp,
      mesh,
      checkpointer,
      plan: frag_lib.FragmentPlan,
      *,
      tag: bool,
      tsp: bool | None = None,
  ):
    """tag: the frozen weights include the decoder (the trainer samples too); tsp: the
    fragment gradient's TSP form (default exp.schedule.tsp)."""
    self.exp, self.mesh, self.checkpointer, self.plan = exp, mesh, checkpointer, plan
    inputs.check_rows(plan, mesh, 'trainer')
    self.devices = list(mesh.devices.flat)
    layout = mesh_lib.fsdp_layout(exp.params, mesh)
    logging.info('trainer params: %s', layout.describe())
    self.param_shardings = layout.shardings
    self.params = exp.weights.init_params(self.param_shardings)
    # The frozen weights this mesh's programs read (the LoRA base; the VAE only for TAG).
    self.frozen = exp.weights.frozen(mesh, fsdp=True, decode=tag)
    opt_shapes = jax.eval_shape(exp.optimizer.init, self.params)
    self.opt_shardings = mesh_lib.fsdp_shardings(opt_shapes, mesh)
    self.opt_state = jax.jit(exp.optimizer.init, out_shardings=self.opt_shardings)(self.params)
    # The KL reference is the initial model, also after a resume (with LoRA: the frozen base,
    # adapters off, with no second copy).
    self.ref_params = (
        jax.tree.map(jnp.copy, self.params)
        if exp.rl.kl_beta > 0 and exp.weights.lora is None
        else None
    )
    self._restore(jax.random.key(exp.seed))
    self._rep = mesh_lib.replicated(mesh)
    self.traj_shardings = programs.trajectory_shardings(mesh, exp)
    self._uncond = inputs.uncond(exp, plan.rows, mesh)
    self._build_programs(tsp=bool(exp.schedule.tsp if tsp is None else tsp))
    self._advs: dict[tuple[int, int], Any] = {}
    # A failed reward (NaN) is masked out of its group, or skips the update (config.reward.failed);
    # several rewards combine as config.reward.combine says (rl/advantages.reward_advantages).
    adv_kw = dict(
        group_size=exp.rl.group_size,
        std_mode=exp.rl.adv_std,
        eps=exp.rl.adv_eps,
        clip=exp.rl.adv_clip,
        mask_failed=exp.reward.failed == 'mask',
    )
    self.combine = exp.reward.combine
    reward_w = [w for _, w in exp.reward.weights]
    self._adv_fn = lambda r: (
        adv_lib.grpo_advantages(r, **adv_kw)
        if r.ndim == 1
        else adv_lib.reward_advantages(r, reward_w, combine=self.combine, **adv_kw)
    )

  def _restore(self, base_key) -> None:
    """Resumes from the newest readable checkpoint (a corrupt newer one is set aside)."""
    self.start, self.data_position = 0, 0
    self.skipped_updates = 0  # over the whole run, resumes included (checkpoint meta)
    restored = self.checkpointer.restore_latest(
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
          self.checkpointer.directory,
          self.start,
          self.data_position,
      )
    # The step whose end self.params/opt_state are (optimizer steps applied so far).
    self.params_step = self.start
    self._rng_data = ckpt_lib.key_to_data(base_key)
    self._base_key = jax.device_put(base_key, mesh_lib.replicated(self.mesh))

  def _build_programs(self, tsp: bool) -> None:
    exp, mesh, ps = self.exp, self.mesh, self.param_shardings
    # One fragment without TSP: gradient and optimizer step fused into one program.
    self.fused = self.plan.num == 1 and not tsp
    if self.fused:
      self._update = programs.make_update(
          exp,
          mesh,
          ps,
          self.opt_shardings,
          self.traj_shardings,
          frozen=self.frozen,
          samples=self.plan.size,
      )
      return
    self._zero = programs.make_zero_acc(ps, mesh, exp)
    self._gather_base = None
    frozen = self.frozen
    if exp.schedule.frozen_once_per_step and exp.weights.lora is not None:
      # The fragment gradient reads the LoRA base replicated; begin() gathers it once per
      # optimizer step (one all-gather per step instead of one per fragment, a whole base per
      # device held until apply).
      base_sh = jax.tree.map(lambda _: self._rep, self.frozen['base'])
      self._gather_base = jax.jit(lambda base: base, out_shardings=base_sh)
      abstract = jax.tree.map(
          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
          self.frozen['base'],
          base_sh,
      )
      frozen = dict(self.frozen, base=abstract)
    self._grad = programs.make_fragment_grad(
        exp, mesh, ps, self.traj_shardings, tsp=tsp, frozen=frozen, samples=self.plan.size
    )
    self._apply = programs.make_apply(exp, mesh, ps, self.opt_shardings)
    self._select = programs.make_select(exp, mesh)
    if tsp:
      lay = programs.tsp.layout(exp, mesh, self.plan.size)
      logging.info(
          'TSP: %d timesteps (padded to %d) x %d samples per fragment on %d trainer devices '
          'as %d (steps) x %d (samples): %d sample-steps per device',
          lay.K,
          lay.K_pad,
          lay.samples,
          mesh.devices.size,
          lay.t,
          lay.b,
          lay.work,
      )

  def compile(self, state: dict) -> None:
    """Compiles this trainer's programs for a fragment's abstract layout and `state` (from
    begin; nothing runs): a trainer waiting for its first fragment calls it meanwhile, so that
    fragment's gradient then compiles nothing."""
    exp, mesh, n = self.exp, self.mesh, self.plan.rows
    sds = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    laid = lambda tree, shardings: jax.tree.map(
        lambda x, sh: sds(x.shape, x.dtype, sh), tree, shardings
    )
    data = mesh_lib.batch_sharding(mesh, 1)
    cond = exp.cond_abstract(n, lambda nd: mesh_lib.batch_sharding(mesh, nd))
    batch = (
        laid(programs.abstract_trajectory(exp, n), self.traj_shardings),
        cond,
        self._uncond if self._uncond is not None else cond,
        sds((n,), jnp.float32, data),
        sds((n,), jnp.bool_, data),
    )
    if self.fused:
      args = (self.params, self.opt_state, *batch, state['key'], state['step'], self.ref_params)
      self._update.lower(*args).compile()
      return
    acc = state['acc']
    self._grad.lower(
        self.params, acc, *batch, state['indices'], self.ref_params, self._old_params()
    ).compile()
    self._apply.lower(self.params, self.opt_state, acc).compile()

  # ------------------------------------------------------------------ one logical batch

  def encode(self, prompts: list[str]):
    """Text conditioning of a fragment (its per-sample prompts) on the trainer mesh (host
    encoder), padded to the plan's rows."""
    return inputs.encode(self.exp, self.plan.pad_prompts(prompts), self.mesh)

  def begin(self, step: int):
    """The batch of `step` starts: its update key and step (fused), or its trained step
    indices and a zero gradient accumulator."""
    self._step = step
    step_arr = jax.device_put(np.int32(step), self._rep)
    _, k_update = inputs.step_keys(self._base_key, step_arr)
    if self.fused:
      return {'key': k_update, 'step': step_arr, 'metrics': None}
    state = {'indices': self._select(k_update, step_arr), 'acc': self._zero(self.params)}
    if self._gather_base is not None:  # the base for this optimizer step's fragments
      state['frozen'] = dict(self.frozen, base=self._gather_base(self.frozen['base']))
    return state

  def advantages(self, f: int, rewards: np.ndarray, parts: np.ndarray | None = None):
    """(adv [rows], valid [rows]) of fragment f from the batch's rewards [B] (host; only the
    groups of f need to be filled in), or with config.reward.combine='advantages' from each
    reward's scores parts [K, B]; the padding rows past plan.size get 0 and False."""
    plan = self.plan
    groups = plan.groups_of(f)
    cut = slice(groups.start * plan.group_size, groups.stop * plan.group_size)
    use_parts = self.combine == 'advantages' and parts is not None and len(parts) > 1
    r = parts[:, cut] if use_parts else rewards[cut]
    lo = f * plan.size - groups.start * plan.group_size
    return self._adv_program(len(groups), lo, r.ndim)(jax.device_put(r, self._rep))

  def _adv_program(self, n_groups: int, lo: int, ndim: int = 1):
    key = (n_groups, lo, ndim)
    if key not in self._advs:
      size, data = self.plan.size, mesh_lib.batch_sharding(self.mesh, 1)
      pad = (0, self.plan.rows - size)

      def adv(rewards):
        a, v = self._adv_fn(rewards)
        return jnp.pad(a[lo : lo + size], pad), jnp.pad(v[lo : lo + size], pad)

      self._advs[key] = jax.jit(adv, in_shardings=self._rep, out_shardings=(data, data))
    return self._advs[key]

  def train(self, state: dict, traj, cond, adv, valid) -> dict:
    """One fragment's gradient into `state` (from begin); the fused program also applies."""
    uncond = self._uncond if self._uncond is not None else cond
    if self.fused:
      self.params, self.opt_state, state['metrics'] = self._update(
          self.params,
          self.opt_state,
          traj,
          cond,
          uncond,
          adv,
          valid,
          state['key'],
          state['step'],
          self.ref_params,
      )
      self.params_step = self._step + 1
      return state
    args = (adv, valid, state['indices'], self.ref_params, self._old_params())
    if 'frozen' in state:  # the step's gathered base instead of the bound FSDP one
      grad, args = self._grad.program, args + (state['frozen'],)
    else:
      grad = self._grad
    state['acc'] = grad(self.params, state['acc'], traj, cond, uncond, *args)
    return state

  def _old_params(self):
    """The old policy the fragment gradients read (None: the current params serve)."""
    return programs.old_policy_of(self.exp, self.opt_state)

  @property
  def sampling_params(self):
    """The params the rollout samples with: DiffusionNFT's old policy when the run keeps one
    (it collects data with v_old: rl/old_policy.py), else the params."""
    if self.exp.rl.samples_with_old_policy:
      return programs.old_policy_of(self.exp, self.opt_state)
    return self.params

  def apply(self, state: dict):
    """The batch's optimizer step (already made by the fused program). Returns its metrics
    (device arrays)."""
    if self.fused:
      return state['metrics']
    self.params, self.opt_state, m = self._apply(self.params, self.opt_state, state['acc'])
    state.pop('frozen', None)  # the gathered base lives for one optimizer step
    self.params_step = self._step + 1
    return m

  # ------------------------------------------------------------------ checkpoints

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
          self.exp.family.key_table(self.exp.model_config),
      )

  def close(self):
    self.checkpointer.close()
