"""The trainer role's per-fragment programs of the pipelined schedule (runtime/pipeline.py).

Advantages of a fragment once its prompt groups are scored, its gradient accumulated
(programs.make_fragment_grad; TSP shards the timestep axis over the trainer mesh: a program
choice the schedule sees only as a cost), and one optimizer step per logical batch
(programs.make_apply). The update equals the full-batch one to float rounding: every sample's
noise key folds in its batch position, the loss denominator is the whole batch's pair weight,
applied once at the end.
"""

from __future__ import annotations

import functools
from typing import Any

from absl import logging
import jax
import numpy as np

from digen_jax import programs
from digen_jax.rl import advantages as adv_lib
from digen_jax.runtime import fragments as frag_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import workers


class FragmentTrainer:
  """The trainer role's per-fragment programs on top of a workers.TrainerWorker."""

  def __init__(self, exp, trainer: workers.TrainerWorker, plan: frag_lib.FragmentPlan, tsp: bool):
    self.exp, self.t, self.plan = exp, trainer, plan
    mesh = trainer.mesh
    self.mesh = mesh
    self.traj_shardings = programs.trajectory_shardings(mesh)
    self._zero = programs.make_zero_acc(trainer.param_shardings, mesh)
    self._grad = programs.make_fragment_grad(
        exp, mesh, trainer.param_shardings, self.traj_shardings, tsp=tsp, frozen=trainer.frozen
    )
    self._apply = programs.make_apply(exp, mesh, trainer.param_shardings, trainer.opt_shardings)
    self._select = programs.make_select(exp, mesh)
    self._rep = mesh_lib.replicated(mesh)
    self._uncond = workers.uncond(exp, plan.size, mesh)
    c = exp.config.rl
    self._adv_fn = functools.partial(
        adv_lib.grpo_advantages,
        group_size=c.group_size,
        std_mode=c.adv_std,
        eps=c.adv_eps,
        clip=c.adv_clip,
    )
    self._advs: dict[tuple[int, int], Any] = {}
    self.devices = list(mesh.devices.flat)
    K, K_pad = programs.tsp_steps(exp, mesh)
    if tsp:
      logging.info(
          'TSP: %d timesteps per fragment (padded to %d) sharded over %d trainer ' 'devices',
          K,
          K_pad,
          mesh.devices.size,
      )

  def _adv_program(self, n_groups: int, lo: int):
    key = (n_groups, lo)
    if key not in self._advs:
      size, data = self.plan.size, mesh_lib.batch_sharding(self.mesh, 1)

      def adv(rewards):
        a, v = self._adv_fn(rewards)
        return a[lo : lo + size], v[lo : lo + size]

      self._advs[key] = jax.jit(adv, in_shardings=self._rep, out_shardings=(data, data))
    return self._advs[key]

  def advantages(self, f: int, rewards: np.ndarray):
    """(adv [size], valid [size]) of fragment f from the batch's rewards [B] (host; only the
    groups of f need to be filled in)."""
    groups = self.plan.groups_of(f)
    G = self.plan.group_size
    r = rewards[groups.start * G : groups.stop * G]
    lo = f * self.plan.size - groups.start * G
    return self._adv_program(len(groups), lo)(jax.device_put(r, self._rep))

  def begin(self, step: int):
    self._step = step
    step_arr = jax.device_put(np.int32(step), self._rep)
    _, k_update = workers.step_keys(self.t._base_key, step_arr)
    return self._select(k_update, step_arr), self._zero(self.t.params)

  def encode(self, prompts: list[str]):
    """Text conditioning of a fragment on the trainer mesh (host encoder: outside the spans)."""
    return workers.encode(self.exp, prompts, self.mesh)

  def grad(self, acc, indices, traj, cond, adv, valid):
    uncond = self._uncond if self._uncond is not None else cond
    return self._grad(
        self.t.params, acc, traj, cond, uncond, adv, valid, indices, self.t.ref_params
    )

  def apply(self, acc) -> dict:
    self.t.params, self.t.opt_state, m = self._apply(self.t.params, self.t.opt_state, acc)
    self.t.params_step = self._step + 1
    return m
