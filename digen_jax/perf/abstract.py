"""A run's parts without weights, and abstract (ShapeDtypeStruct) arguments for its programs.

Shared by benchmarks/memory.py and digen_jax/perf/costs.py: both lower the real rollout and update
programs (digen_jax/programs.py) ahead of time on fake devices, so nothing here reads a weight or
allocates one. The Run comes from experiment.build(config, abstract=True): every weight a
ShapeDtypeStruct and no text encoder, prompts or reward (the compiled programs do not take
them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import programs
from digen_jax.experiment import abstract_weights
from digen_jax.experiment import build as experiment
from digen_jax.parallel import mesh as mesh_lib


def abstract_run(config, vae: str = 'auto'):
  """(Run, description of its VAE): experiment.build(config, abstract=True, vae=vae), the VAE's
  configuration chosen as abstract_weights.vae_config describes."""
  run = experiment.build(config, abstract=True, vae=vae)
  return run, abstract_weights.vae_config(config, vae)[1]


# ---------------------------------------------------------------------------------------------
# Abstract arguments.


def laid_out(tree, shardings, dtype=None):
  """ShapeDtypeStructs of `tree` on `shardings` (a tree, or one sharding for every leaf),
  floating leaves cast to `dtype` when given."""
  if isinstance(shardings, jax.sharding.Sharding):
    one = shardings
    shardings = jax.tree.map(lambda _: one, tree)

  def sds(x, s):
    d = dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    return jax.ShapeDtypeStruct(x.shape, d, sharding=s)

  return jax.tree.map(sds, tree, shardings)


def whole_bytes(tree) -> int:
  """The bytes of a tree of arrays or ShapeDtypeStructs, unsharded."""
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def per_device_bytes(tree) -> int:
  """The bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * x.dtype.itemsize  # (typed PRNG keys too)
  return total


def abstract_cond(exp, batch: int, mesh):
  """The conditioning dict (Run.cond_abstract), batch-sharded on `mesh`."""
  return exp.cond_abstract(batch, lambda nd: mesh_lib.batch_sharding(mesh, nd))


def frozen_tree(exp, mesh, *, base: str | None, decode: bool):
  """The frozen weights as Weights.frozen loads them (model.frozen_dtype), abstract, on `mesh`:
  the LoRA base 'fsdp' / 'replicated' (None: absent), the VAE replicated when `decode`."""
  w = exp.weights
  rep = mesh_lib.replicated(mesh)
  out = {'base': None, 'vae': None}
  if w.lora is not None and base is not None:
    sh = mesh_lib.fsdp_shardings(w.base_abstract, mesh) if base == 'fsdp' else rep
    out['base'] = laid_out(w.base_abstract, sh, w.frozen_dtype)
  if decode and w.vae is not None:
    out['vae'] = laid_out(w.vae.abstract, rep, w.frozen_dtype)
  return out


# ---------------------------------------------------------------------------------------------
# Every program of a run, on abstract arguments.


def _scalar(mesh, dtype):
  return jax.ShapeDtypeStruct((), dtype, sharding=mesh_lib.replicated(mesh))


def _key(mesh):
  return _scalar(mesh, jax.random.key(0).dtype)


def rollout_param_dtype(exp):
  """The rollout copy's dtype as the runtime publishes it (LoRA: float32 adapters)."""
  if exp.weights.lora is None and exp.publish.param_dtype == 'bfloat16':
    return jnp.bfloat16
  return jnp.float32


def _metric_sums(exp, mesh):
  """The gradient accumulator's metric sums, as programs.make_zero_acc makes them."""
  return {k: _scalar(mesh, jnp.float32) for k in programs.acc_sum_keys(exp)}


def run_programs(
    exp, mesh, batch: int, *, rollout_layout: str = 'replicated', only=None, samples=None
):
  """{name: (program, abstract args)} for every program programs.py builds for a run of `exp`,
  laid out on `mesh` as the runtime lays them out, `batch` samples a call (`only`: those
  names; `samples`: a fragment's real samples, its first rows, the rest weight-0 padding the
  fragment gradients do not compute: None, every row). Each program has .lower(*args) and
  .trace(*args); nothing is read or allocated.

    rollout          the sampling scan + decode of the rollout role (its copy `rollout_layout`,
                     'replicated' or 'fsdp', in the published dtype)
    fragment_rollout the same with a batch offset (GAP / TAG fragments)
    tag_rollout      the rollout on the trainer's own FSDP float32 params (TAG)
    eval_rollout     the rollout with every step Euler (eval)
    update           the full-batch GRPO update (M = 1)
    grad, grad_tsp   one fragment's gradient (GAP; TSP's timestep-sharded form)
    apply, zero_acc, select   the optimizer step, a zero accumulator, the trained steps
  """
  built = _RunPrograms(exp, mesh, batch, rollout_layout, samples)
  return {name: getattr(built, name)() for name in (only or PROGRAM_NAMES)}


PROGRAM_NAMES = (
    'rollout',
    'fragment_rollout',
    'tag_rollout',
    'eval_rollout',
    'update',
    'grad',
    'grad_tsp',
    'apply',
    'zero_acc',
    'select',
)


class _RunPrograms:
  """run_programs' programs, each a method, over one set of abstract arguments."""

  def __init__(self, exp, mesh, batch: int, rollout_layout: str, samples=None):
    self.exp, self.mesh, self.batch, self.layout = exp, mesh, batch, rollout_layout
    self.samples = samples
    self.rep = mesh_lib.replicated(mesh)
    self.fsdp_sh = mesh_lib.fsdp_shardings(exp.params, mesh)
    self.params = laid_out(exp.params, self.fsdp_sh, jnp.float32)
    self.cond = abstract_cond(exp, batch, mesh)
    self.traj_sh = programs.trajectory_shardings(mesh, exp)
    self.step = _scalar(mesh, jnp.int32)
    opt_shapes = jax.eval_shape(exp.optimizer.init, self.params)
    self.opt_sh = mesh_lib.fsdp_shardings(opt_shapes, mesh)
    self.opt = laid_out(opt_shapes, self.opt_sh)
    self.ref = self.params if programs.ref_shardings(exp, self.fsdp_sh) is not None else None
    self._traj = None  # traced once, for the programs that take a batch

  def _batch(self):
    if self._traj is None:
      self._traj = laid_out(programs.abstract_trajectory(self.exp, self.batch), self.traj_sh)
    data = mesh_lib.batch_sharding(self.mesh, 1)
    sds = lambda dtype: jax.ShapeDtypeStruct((self.batch,), dtype, sharding=data)
    return self._traj, self.cond, self.cond, sds(jnp.float32), sds(jnp.bool_)

  def _rollout(self, layout, *, offset=False, deterministic=False, trainer=False):
    exp, mesh = self.exp, self.mesh
    if trainer:
      param_sh, dtype, base = self.fsdp_sh, jnp.float32, 'fsdp'
    else:
      rep = self.rep
      param_sh = self.fsdp_sh if layout == 'fsdp' else jax.tree.map(lambda _: rep, exp.params)
      dtype, base = rollout_param_dtype(exp), layout
    program = programs.make_rollout(
        exp,
        mesh,
        param_sh,
        None if deterministic else self.traj_sh,
        with_offset=offset,
        frozen=frozen_tree(exp, mesh, base=base, decode=True),
        deterministic=deterministic,
    )
    args = (laid_out(exp.params, param_sh, dtype), self.cond, self.cond, _key(mesh), self.step)
    return program, args + ((self.step,) if offset else ())

  def rollout(self):
    return self._rollout(self.layout)

  def fragment_rollout(self):
    return self._rollout(self.layout, offset=True)

  def tag_rollout(self):
    return self._rollout('fsdp', offset=True, trainer=True)

  def eval_rollout(self):
    return self._rollout('replicated', offset=True, deterministic=True)

  def _frozen(self, decode=False):
    return frozen_tree(self.exp, self.mesh, base='fsdp', decode=decode)

  def update(self):
    program = programs.make_update(
        self.exp, self.mesh, self.fsdp_sh, self.opt_sh, self.traj_sh, frozen=self._frozen()
    )
    return program, (self.params, self.opt, *self._batch(), _key(self.mesh), self.step, self.ref)

  def _grad(self, tsp: bool):
    exp = self.exp
    frozen = self._frozen(bool(exp.schedule.tag))
    program = programs.make_fragment_grad(
        exp, self.mesh, self.fsdp_sh, self.traj_sh, tsp=tsp, frozen=frozen, samples=self.samples
    )
    k = programs.trained_levels(exp)
    indices = jax.ShapeDtypeStruct((k,), jnp.int32, sharding=self.rep)
    acc = {'grads': self.params, 'sums': _metric_sums(exp, self.mesh)}
    old = self.params if programs.old_policy_of_used(exp) else None
    return program, (self.params, acc, *self._batch(), indices, self.ref, old)

  def grad(self):
    return self._grad(False)

  def grad_tsp(self):
    return self._grad(True)

  def apply(self):
    acc = {'grads': self.params, 'sums': _metric_sums(self.exp, self.mesh)}
    program = programs.make_apply(self.exp, self.mesh, self.fsdp_sh, self.opt_sh)
    return program, (self.params, self.opt, acc)

  def zero_acc(self):
    return programs.make_zero_acc(self.fsdp_sh, self.mesh, self.exp), (self.params,)

  def select(self):
    return programs.make_select(self.exp, self.mesh), (_key(self.mesh), self.step)
