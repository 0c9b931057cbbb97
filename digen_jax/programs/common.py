"""What every program shares: the model's velocity function, argument layouts, one memo of
jitted programs per (run, mesh, layouts), programs with their frozen weights bound, the
finiteness guards, and the captured-constant check."""

from __future__ import annotations

import collections

from flax import nnx
import jax
import jax.extend.core  # noqa: F401 (jax.extend.core.ClosedJaxpr / Jaxpr below)
import jax.numpy as jnp

from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.models import family as family_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.parallel import sequence as sequence_lib
from digen_jax.rl import timesteps as timesteps_lib


def make_velocity_fn(
    graphdef, img_shape, compute_dtype, family=None, guidance: float = 0.0, token_mesh=None
):
  """velocity_fn(params, latents [B,N,C], sigma [B], cond) -> v [B,N,C] float32: the family's
  forward (models/family.py; default the MMDiT's) on a conditioning dict
  (Run.conditioning). guidance: FLUX.1-dev's distilled guidance input. With a bf16 compute
  dtype the float32 master params are cast inside the jitted program, so gradients flow back to
  float32. token_mesh: a (samples, tokens) view of the program's mesh (parallel/sequence.py)
  over which each sample's tokens are split (models/attention/sequence_parallel.py); None: no split.
  """
  forward = (family or family_lib.get('qwenimage')).forward

  def velocity_fn(params, latents, sigma, cond):
    if compute_dtype != jnp.float32:
      params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    cond = dict(cond, text=cond['text'].astype(compute_dtype))
    latents = latents.astype(compute_dtype)
    v = forward(model, latents, sigma, cond, img_shape, guidance, token_mesh=token_mesh)
    return v.astype(jnp.float32)

  return velocity_fn


def velocity_fn_of(exp, mesh=None):
  """make_velocity_fn for a Run's model, family and sampler settings, each sample's
  tokens split over config.parallel.sequence devices of `mesh` (None: no split)."""
  return make_velocity_fn(
      exp.graphdef,
      exp.img_shape,
      exp.compute_dtype,
      exp.family,
      float(exp.sampler.distilled_guidance),
      token_mesh=token_mesh_of(exp, mesh),
  )


def token_mesh_of(exp, mesh):
  """The (samples, tokens) view of `mesh` for config.parallel.sequence, or None (no split, or
  no mesh)."""
  if mesh is None:
    return None
  return sequence_lib.token_mesh(mesh, int(exp.parallel.sequence))


def row_unit(exp, mesh) -> int:
  """The rows a program on `mesh` computes are a multiple of this: one per group of devices
  that holds whole samples (n, or n / config.parallel.sequence with the tokens split)."""
  view = token_mesh_of(exp, mesh)
  return mesh.devices.size if view is None else view.shape[sequence_lib.SAMPLES]


def likelihood_free(exp) -> bool:
  """Whether the run's objective trains on clean samples (config.rl.algorithm 'nft' | 'awm'):
  its rollout hands over CleanSamples, not a Trajectory."""
  return exp is not None and exp.rl.algorithm != 'grpo'


def trained_levels(exp) -> int:
  """K: the trained steps per trajectory (GRPO) or the forward-process noise levels per sample
  (config.rl.train_noise_levels, the likelihood-free objectives)."""
  if likelihood_free(exp):
    return int(exp.rl.train_noise_levels)
  return timesteps_lib.num_selected(exp.selection, len(exp.sigmas) - 1)


def trajectory_shardings(mesh, exp=None):
  """Layout on `mesh` of what the rollout hands the trainer: GRPO's Trajectory (batch-sharded
  per-sample fields, replicated schedule), or for a likelihood-free `exp` its CleanSamples
  (batch-sharded). exp None: a GRPO run's."""
  rep = mesh_lib.replicated(mesh)
  if likelihood_free(exp):
    return sampler_lib.CleanSamples(
        latents=mesh_lib.batch_sharding(mesh, 3),  # [B, N, C]
        keys=mesh_lib.batch_sharding(mesh, 2),  # [B, 2]
    )
  return sampler_lib.Trajectory(
      latents=mesh_lib.batch_sharding(mesh, 4, 1),  # [T+1, B, N, C]
      log_probs=mesh_lib.batch_sharding(mesh, 2, 1),  # [T, B]
      sigmas=rep,  # [T+1]
      sde_steps=rep,  # [T]
      stds=mesh_lib.batch_sharding(mesh, 2, 1),  # [T, B]
  )


def cond_shardings(mesh, cond):
  """Batch shardings on `mesh` for a conditioning dict (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda x: mesh_lib.batch_sharding(mesh, x.ndim), cond)


def computed_rows(rows: int, samples: int | None, n: int) -> int:
  """Rows of a `rows`-row fragment a program on n devices computes: its first `samples` (the
  real ones; None: all) rounded up to a multiple of n, at most `rows`. The rows past them are
  weight-0 padding that only another mesh's layout needed (experiment/fragments.py)."""
  if samples is None:
    return rows
  return min(rows, -(-samples // n) * n)


def take_rows(batch, rows: int, sharding_of=None):
  """(traj, cond, uncond, adv, valid) cut to its first `rows` rows (traj's per-sample fields on
  their BATCH_AXES, the rest on axis 0); sharding_of(ndim, axis), when given, lays each cut
  array out (a sharding constraint). Unchanged when it has `rows` rows."""
  traj, cond, uncond, adv, valid = batch
  if adv.shape[0] == rows:
    return batch

  def cut(a, axis):
    a = jax.lax.slice_in_dim(a, 0, rows, axis=axis)
    if sharding_of is None:
      return a
    return jax.lax.with_sharding_constraint(a, sharding_of(a.ndim, axis))

  traj = traj.replace(**{f: cut(getattr(traj, f), ax) for f, ax in traj.BATCH_AXES.items()})
  rest = jax.tree.map(lambda a: cut(a, 0), (cond, uncond, adv, valid))
  return (traj, *rest)


def guidance_of(exp):
  """(guidance_scale or None, norm_rescale) as the sampler and objective take them."""
  s = exp.sampler
  return (s.guidance_scale, s.norm_rescale) if s.guidance_scale > 1.0 else (None, False)


# ---------------------------------------------------------------------------------------------
# One program per (run, mesh, layouts) in a process. Each make_* below closes over the
# Run, so every experiment.build used to trace, lower and (from the compilation cache)
# load its programs again. A program is a pure function of the run's program fields (its
# program_key: the config without the fields no program reads), the mesh and the argument
# layouts, so a second build of the same config (a resumed run in the
# same process, a sweep's in-process repeat, a test's straight and interrupted runs) gets the
# jitted program the first made, with its traces and executables.

_MEMO_SIZE = 16  # programs kept; each holds its Run (and so its initial params)
_memo: collections.OrderedDict = collections.OrderedDict()


def layout_key(tree):
  """A hashable form of a tree of shardings (None entries kept in the structure)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(leaves)


def memoized(kind: str, exp, parts: tuple, make):
  """make() once per (kind, exp.program_key, parts); the last _MEMO_SIZE kept."""
  key = (kind, exp.program_key, parts)
  if key in _memo:
    _memo.move_to_end(key)
    return _memo[key]
  program = _memo[key] = make()
  while len(_memo) > _MEMO_SIZE:
    _memo.popitem(last=False)
  return program


def clear_memo() -> None:
  """Forget every memoized program (e.g. to measure a cold build)."""
  _memo.clear()


class Bound:
  """A jitted program with its last argument, the frozen weights on its mesh
  (weights.Weights.frozen), bound: call and lower it with the other arguments only."""

  def __init__(self, program, frozen):
    self.program, self.frozen = program, frozen

  def __call__(self, *args):
    return self.program(*args, self.frozen)

  def lower(self, *args):
    lowered = self.program.lower(*args, self.frozen)
    return _BoundLowered(lowered, self.frozen)

  def trace(self, *args):
    """jax's Traced of the program on these arguments (jit(...).trace)."""
    return self.program.trace(*args, self.frozen)


class _BoundLowered:

  def __init__(self, lowered, frozen):
    self.lowered, self.frozen = lowered, frozen

  def compile(self):
    return Bound(self.lowered.compile(), self.frozen)


def captured_arrays(closed_jaxpr) -> list[str]:
  """The device arrays (jax.Array) a traced program holds as constants, its sub-programs (scan
  and cond bodies, nested jits) included: ['f32[7] (in scan)', ...]; [] when there are none.

  A jax.Array closed over by a traced function becomes a constant of the compiled program;
  lowering copies it to the host, which a GPU's transfer guard ('disallow', our default)
  refuses ("Disallowed device-to-host transfer"). The CPU holds arrays on the host, so nothing
  fails there: this check is how the CPU suite sees it. numpy constants are fine (already on
  the host). closed_jaxpr: e.g. jax.jit(f).trace(*args).jaxpr."""
  found = []
  # jax 0.10 wraps a Jaxpr and its consts in a ClosedJaxpr; from 0.11 a Jaxpr holds both.
  kinds = (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)

  def visit(jaxpr, where):
    consts = getattr(jaxpr, 'consts', ())
    found.extend(f'{c.dtype}{list(c.shape)} ({where})' for c in consts if isinstance(c, jax.Array))
    for eqn in jaxpr.eqns:
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
          if isinstance(sub, kinds):
            visit(sub, f'in {eqn.primitive.name}')

  visit(closed_jaxpr, 'top level')
  return found


def frozen_shardings(frozen):
  """in_shardings of a frozen tree: where its arrays already are (None entries stay None)."""
  return jax.tree.map(lambda x: x.sharding, frozen)


def behaviour_of(exp) -> str:
  """grpo_objective's `behaviour` for config.rl.behaviour_logprobs ('trainer' -> 'self')."""
  return 'self' if exp.rl.behaviour_logprobs == 'trainer' else 'stored'


def step_loop_for(step_loop: str, mesh) -> str:
  """config.rl.step_loop resolved for the trainer `mesh`: 'auto' is 'scan' on one device (the
  steps one after another, B-sized forwards: least memory, fastest on a CPU with model.remat)
  and 'vmap' on several (one K·B batch: each FSDP weight gathered once for all K steps, and no
  collectives inside a loop, which XLA's CPU runtime can deadlock on: two ready collectives
  can take both pool threads of one device while the other device's threads wait)."""
  if step_loop == 'auto':
    return 'scan' if mesh.devices.size == 1 else 'vmap'
  return step_loop


def all_finite(tree) -> jax.Array:
  """Whether every float in `tree` is finite (a bool scalar). Checked on the new params and
  moments too: a finite gradient times an extreme learning rate can still overflow them."""
  leaves = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def keep_if(finite: jax.Array, new, old):
  """`new` if `finite` (a bool scalar) else `old`. One conditional, not a select per leaf: XLA
  fuses a select's scalar predicate into it, so every leaf's select recomputed the whole
  and-chain of the finiteness checks (one term per checked leaf): leaves^2 operations, which
  made the optimizer step the slowest program to compile (the Qwen-Image toy's apply: 19,020
  `and`s, 6.8 s at -O0)."""
  return jax.lax.cond(finite, lambda: new, lambda: old)


def ref_shardings(exp, param_shardings):
  """Where the KL reference params live: none without KL, or with LoRA (the reference is the
  frozen base with adapters off), else like the trainable params."""
  return param_shardings if exp.rl.kl_beta > 0 and exp.weights.lora is None else None
