"""Orbax checkpoints of the whole training state: a run restarted on the same workdir resumes.

Saved per step: params, optimizer state, the base RNG key (as raw uint32 data), and a JSON record
(step, data position, policy version). Restores onto the shardings of a template state, so a
resumed run continues on the same mesh layout without a host copy of the full model.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with a Composite of standard + JSON items."""

  def __init__(self, directory: str, *, max_to_keep: int = 2, save_every: int = 1):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             save_interval_steps=max(1, save_every),
                                             create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *, force: bool = False):
    """state: pytree of jax arrays (params, opt_state, rng); meta: JSON-serialisable dict."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, step: int, template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores onto the shapes/dtypes/shardings of `template` (a pytree of jax arrays)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored['state'], restored['meta']

  def wait(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()


class ProcessCheckpointer(Checkpointer):
  """A Checkpointer for a multi-process job in which only this process saves.

  orbax 0.12 refuses to save arrays that live on one process's devices when the job has
  several processes, so state goes through host memory (numpy) and is saved by this process
  alone (active_processes); NumpyHandler writes from process 0 only, hence the trainer is
  process 0. Restores come back as numpy and are placed on the template's shardings. Same
  on-disk format as Checkpointer: single-process tools (digen_jax.eval) read these checkpoints.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2, save_every: int = 1):
    pid = jax.process_index()
    if pid != 0:
      raise ValueError(f'ProcessCheckpointer runs in process 0 (this is process {pid}): make the '
                       'trainer process 0 (config.cluster.trainer.processes=(0,))')
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)   # orbax cannot create it with active_processes
    mp = ocp.options.MultiprocessingOptions(primary_host=pid, active_processes={pid})
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             save_interval_steps=max(1, save_every),
                                             create=False, multiprocessing_options=mp),
        item_handlers={'state': ocp.StandardCheckpointHandler(multiprocessing_options=mp),
                       'meta': ocp.JsonCheckpointHandler(multiprocessing_options=mp)})

  def save(self, step, state, meta, *, force=False):
    if self._manager.should_save(step) or force:
      super().save(step, jax.device_get(state), meta, force=force)

  def restore(self, step, template):
    host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), template)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(host), meta=ocp.args.JsonRestore()))
    state = jax.tree.map(lambda x, t: jax.device_put(np.asarray(x, t.dtype), t.sharding),
                         restored['state'], template)
    return state, restored['meta']


def key_to_data(key: jax.Array) -> jax.Array:
  """Typed PRNG key -> uint32 array (what orbax can store)."""
  return jax.random.key_data(key)


def data_to_key(data) -> jax.Array:
  return jax.random.wrap_key_data(np.asarray(data, dtype=np.uint32) if not isinstance(data, jax.Array)
                                  else data)
