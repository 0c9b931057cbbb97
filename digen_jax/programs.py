"""The two jitted programs of every execution mode: rollout (the whole sampling scan) and the
GRPO update. Each is compiled for a mesh with explicit in/out shardings; the update donates the
params and optimizer state it replaces."""

from __future__ import annotations

import collections
import json

from flax import nnx
import jax
import jax.extend.core  # noqa: F401 (jax.extend.core.ClosedJaxpr / Jaxpr below)
import jax.numpy as jnp
import numpy as np
import optax

from digen_jax.diffusion import sampler as sampler_lib
from digen_jax.models import family as family_lib
from digen_jax.rl import objective as objective_lib
from digen_jax.rl import timesteps as timesteps_lib
from digen_jax.runtime import mesh as mesh_lib


def make_velocity_fn(graphdef, img_shape, compute_dtype, family=None, guidance: float = 0.0):
  """velocity_fn(params, latents [B,N,C], sigma [B], cond) -> v [B,N,C] float32: the family's
  forward (models/family.py; default the MMDiT's) on a conditioning dict
  (Experiment.conditioning). guidance: FLUX.1-dev's distilled guidance input. With a bf16 compute
  dtype the float32 master params are cast inside the jitted program, so gradients flow back to
  float32."""
  forward = (family or family_lib.get('qwenimage')).forward

  def velocity_fn(params, latents, sigma, cond):
    if compute_dtype != jnp.float32:
      params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    cond = dict(cond, text=cond['text'].astype(compute_dtype))
    v = forward(model, latents.astype(compute_dtype), sigma, cond, img_shape, guidance)
    return v.astype(jnp.float32)

  return velocity_fn


def velocity_fn_of(exp):
  """make_velocity_fn for an Experiment's model, family and sampler settings."""
  return make_velocity_fn(
      exp.graphdef,
      exp.img_shape,
      exp.compute_dtype,
      exp.family,
      float(exp.config.sampler.distilled_guidance),
  )


def trajectory_shardings(mesh) -> sampler_lib.Trajectory:
  """Trajectory layout on `mesh`: batch-sharded per-sample fields, replicated schedule."""
  rep = mesh_lib.replicated(mesh)
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


def guidance_of(exp):
  """(guidance_scale or None, norm_rescale) as the sampler and objective take them."""
  s = exp.config.sampler
  return (s.guidance_scale, s.norm_rescale) if s.guidance_scale > 1.0 else (None, False)


# ---------------------------------------------------------------------------------------------
# One program per (config, mesh, layouts) in a process. Each make_* below closes over the
# Experiment, so every experiment.build used to trace, lower and (from the compilation cache)
# load its programs again. A program is a pure function of the config's program fields, the
# mesh and the argument layouts, so a second build of the same config (a resumed run in the
# same process, a sweep's in-process repeat, a test's straight and interrupted runs) gets the
# jitted program the first made, with its traces and executables.

# Fields that locate inputs and never reach a program (the prompt files' folder).
_NOT_IN_PROGRAMS = ('data.data_dir',)
_MEMO_SIZE = 16  # programs kept; each holds its Experiment (and so its initial params)
_memo: collections.OrderedDict = collections.OrderedDict()


def program_key(config) -> str:
  """The config as the programs see it: JSON, without the fields no program reads."""
  d = config.to_dict()
  for dotted in _NOT_IN_PROGRAMS:
    *path, last = dotted.split('.')
    node = d
    for k in path:
      node = node.get(k, {})
    node.pop(last, None)
  return json.dumps(d, sort_keys=True, default=repr)


def _layout(tree):
  """A hashable form of a tree of shardings (None entries kept in the structure)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(leaves)


def _memoized(kind: str, exp, parts: tuple, make):
  """make() once per (kind, program_key(exp.config), parts); the last _MEMO_SIZE kept."""
  key = (kind, program_key(exp.config), parts)
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


def make_rollout(
    exp,
    mesh,
    param_shardings=None,
    traj_shardings=None,
    *,
    with_offset=False,
    frozen=None,
    deterministic=False,
):
  """rollout(params, cond, uncond, key, step[, offset]) -> (Trajectory, images [B, H, W, 3]),
  data-parallel over `mesh`: the sampling scan, then the decode (VAE or identity) in the same
  program, so latents never leave the devices before the reward sees pixels.

  deterministic: every step Euler (the ODE sampler eval uses); the program returns the images
  only.

  with_offset: the program takes a 6th argument, offset (int32 scalar): the batch position of
  its first sample, so a fragment of the logical batch draws exactly the noise the whole-batch
  program gives those samples (GAP, TAG).

  Params arrive as the rollout copy: replicated unless `param_shardings` says otherwise (e.g. an
  FSDP layout on the rollout mesh); cond/uncond are batch-sharded. `traj_shardings` (a
  Trajectory of shardings) pins the output layout; None lets XLA choose. `frozen`: the frozen
  weights on `mesh` (default: loaded replicated, with the decoder)."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=False, decode=True)
  velocity_fn = velocity_fn_of(exp)
  # numpy, not a device array: staged into the program as a literal. A jax.Array closed over
  # here would be a captured constant, which a GPU's transfer guard refuses to lower.
  sigmas = np.asarray(exp.sigmas, np.float32)
  T = len(exp.sigmas) - 1
  guidance, norm_rescale = guidance_of(exp)

  def rollout(params, cond, uncond, key, step, offset, frozen):
    if deterministic:
      sde_steps = jnp.zeros((T,), bool)
    else:
      sde_steps = timesteps_lib.sde_step_mask(exp.selection, T, step)
    b = cond['text'].shape[0]
    # One noise key per sample: a sample's trajectory does not depend on how the batch is cut.
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b) + offset)
    traj = sampler_lib.sample(
        velocity_fn,
        exp.weights.effective(params, frozen),
        cond,
        sigmas,
        keys,
        latent_shape=(b, *exp.latent_shape),
        sde_cfg=exp.sde_cfg,
        sde_steps=sde_steps,
        guidance_scale=guidance,
        uncond=uncond if guidance is not None else None,
        norm_rescale=norm_rescale,
    )
    images = exp.weights.decode(frozen, traj.latents[-1])
    return images if deterministic else (traj, images)

  rep = mesh_lib.replicated(mesh)
  cond_sharding = cond_shardings(mesh, exp.cond_abstract(1))
  in_sh = (
      rep if param_shardings is None else param_shardings,
      cond_sharding,
      cond_sharding,
      rep,
      rep,
  )
  image_sh = mesh_lib.batch_sharding(mesh, 4)
  out_sh = image_sh if deterministic else (traj_shardings, image_sh)
  frozen_sh = frozen_shardings(frozen)

  def make():
    if with_offset:
      return jax.jit(rollout, in_shardings=in_sh + (rep, frozen_sh), out_shardings=out_sh)
    return jax.jit(
        lambda p, c, u, k, s, fr: rollout(p, c, u, k, s, 0, fr),
        in_shardings=in_sh + (frozen_sh,),
        out_shardings=out_sh,
    )

  parts = (
      mesh,
      _layout(param_shardings),
      _layout(traj_shardings),
      with_offset,
      deterministic,
      _layout(frozen_sh),
  )
  return Bound(_memoized('rollout', exp, parts, make), frozen)


def behaviour_of(exp) -> str:
  """grpo_objective's `behaviour` for config.rl.behaviour_logprobs ('trainer' -> 'self')."""
  return 'self' if exp.config.rl.behaviour_logprobs == 'trainer' else 'stored'


def step_loop_for(step_loop: str, mesh) -> str:
  """config.rl.step_loop resolved for the trainer `mesh`: 'auto' is 'scan' on one device (the
  steps one after another, B-sized forwards: least memory, fastest on a CPU with model.remat)
  and 'vmap' on several (one K·B batch: each FSDP weight gathered once for all K steps, and no
  collectives inside a loop, which XLA's CPU runtime can deadlock on: two ready collectives
  can take both pool threads of one device while the other device's threads wait)."""
  if step_loop == 'auto':
    return 'scan' if mesh.devices.size == 1 else 'vmap'
  return step_loop


def make_update(exp, mesh, param_shardings, opt_shardings, traj_shardings=None, *, frozen=None):
  """update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params)
       -> (params, opt_state, metrics); rl.inner_epochs PPO epochs over the batch.
  ref_params: the frozen reference (FSDP-sharded like params) when rl.kl_beta > 0, else None.
  traj_shardings: the layout the trajectory arrives in (None: whatever it has).

  A step whose advantages, loss, gradient or resulting params/optimizer state are not all
  finite is skipped (params and optimizer state unchanged) and reported as
  metrics['nonfinite'] = 1: NaN/inf never enters the weights or the optimizer moments.
  `frozen`: the frozen weights on `mesh` (default: loaded FSDP-sharded, without the decoder);
  params are the trainable tree (the MMDiT, or LoRA adapters merged into the frozen base
  inside)."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=True, decode=False)
  velocity_fn = velocity_fn_of(exp)
  r = exp.config.rl
  T = len(exp.sigmas) - 1
  guidance, norm_rescale = guidance_of(exp)
  optimizer = exp.optimizer

  def update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params, frozen):
    indices = timesteps_lib.select_timesteps(exp.selection, T, key, step)

    def loss_fn(p):
      return objective_lib.grpo_objective(
          velocity_fn,
          exp.weights.effective(p, frozen),
          traj,
          cond,
          adv,
          valid,
          indices,
          sde_cfg=exp.sde_cfg,
          clip_range=r.clip_range,
          kl_beta=r.kl_beta,
          ref_params=exp.weights.reference(ref_params, frozen) if r.kl_beta > 0 else None,
          guidance_scale=guidance,
          uncond=uncond if guidance is not None else None,
          norm_rescale=norm_rescale,
          step_loop=step_loop_for(r.step_loop, mesh),
          behaviour=behaviour_of(exp),
      )

    def epoch(carry, _):
      p, o = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
      grad_norm = optax.tree.norm(grads)
      updates, new_o = optimizer.update(grads, o, p)
      new_p = optax.apply_updates(p, updates)
      finite = (
          jnp.isfinite(grad_norm)
          & jnp.isfinite(loss)
          & all_finite(adv)
          & all_finite(new_p)
          & all_finite(new_o)
      )
      metrics = dict(
          metrics, loss=loss, grad_norm=grad_norm, nonfinite=(~finite).astype(jnp.float32)
      )
      return keep_if(finite, (new_p, new_o), (p, o)), metrics

    (params, opt_state), per_epoch = jax.lax.scan(
        epoch, (params, opt_state), None, length=r.inner_epochs
    )
    # Report the first epoch's statistics (ratio == 1 there, on-policy) and the last loss.
    metrics = jax.tree.map(lambda m: m[0], per_epoch)
    metrics['nonfinite'] = per_epoch['nonfinite'].max()
    return params, opt_state, metrics

  rep = mesh_lib.replicated(mesh)
  data = lambda nd, axis=0: mesh_lib.batch_sharding(mesh, nd, axis)
  cond_sharding = cond_shardings(mesh, exp.cond_abstract(1))
  frozen_sh = frozen_shardings(frozen)

  def make():
    return jax.jit(
        update,
        in_shardings=(
            param_shardings,
            opt_shardings,
            traj_shardings,
            cond_sharding,
            cond_sharding,
            data(1),
            data(1),
            rep,
            rep,
            ref_shardings(exp, param_shardings),
            frozen_sh,
        ),
        out_shardings=(param_shardings, opt_shardings, rep),
        donate_argnums=(0, 1),
    )

  parts = (
      mesh,
      _layout(param_shardings),
      _layout(opt_shardings),
      _layout(traj_shardings),
      _layout(frozen_sh),
  )
  return Bound(_memoized('update', exp, parts, make), frozen)


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
  return param_shardings if exp.config.rl.kl_beta > 0 and exp.weights.lora is None else None


# ---------------------------------------------------------------------------------------------
# Fragment-wise gradient accumulation (GAP): one gradient program per fragment, one apply per
# logical batch. The loss of the logical batch is sum(w * l) / D with D = sum(w) over the whole
# batch; D is known only when every group is scored, so fragments accumulate the unnormalised
# gradient of sum(w * l) (denominator 1) and `apply` divides by D: the same update as
# make_update's, to float32 rounding.

_SUM_KEYS = ('loss', 'policy_loss', 'approx_kl', 'clip_frac', 'ratio_mean', 'kl')
_MAX_KEYS = ('ratio_max_dev', 'rollout_ratio_max_dev')
# The accumulator's metric scalars (make_zero_acc): summed, maxed, and the total pair weight.
ACC_SUM_KEYS = _SUM_KEYS + _MAX_KEYS + ('weight_sum',)


def tsp_steps(exp, mesh) -> tuple[int, int]:
  """(K, K_pad): trained timesteps per trajectory, and K rounded up to a multiple of the mesh
  size (TSP lays the timestep axis over the mesh; the pad steps carry weight 0)."""
  K = timesteps_lib.num_selected(exp.selection, len(exp.sigmas) - 1)
  n = mesh.devices.size
  return K, -(-K // n) * n


def make_select(exp, mesh):
  """select(key, step) -> int32 [K] trained step indices (replicated)."""
  T = len(exp.sigmas) - 1
  rep = mesh_lib.replicated(mesh)
  return _memoized(
      'select',
      exp,
      (mesh,),
      lambda: jax.jit(
          lambda key, step: timesteps_lib.select_timesteps(exp.selection, T, key, step),
          in_shardings=(rep, rep),
          out_shardings=rep,
      ),
  )


def make_zero_acc(param_shardings, mesh):
  """zero_acc(params) -> {'grads': zeros like params (same shardings), 'sums': zero scalars}."""
  rep = mesh_lib.replicated(mesh)

  def zero(params):
    sums = {k: jnp.zeros((), jnp.float32) for k in ACC_SUM_KEYS}
    return {'grads': jax.tree.map(jnp.zeros_like, params), 'sums': sums}

  sums_sh = {k: rep for k in ACC_SUM_KEYS}
  return jax.jit(
      zero,
      in_shardings=(param_shardings,),
      out_shardings={'grads': param_shardings, 'sums': sums_sh},
  )


def make_fragment_grad(
    exp, mesh, param_shardings, traj_shardings=None, *, tsp: bool = False, frozen=None
):
  """grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params) -> acc + this
  fragment's gradient of sum(w * l) and its metric sums (acc donated).

  tsp: the K selected steps run as one vmap whose timestep axis is sharded over `mesh`
  (padded to a multiple of the mesh size with weight-0 steps); else the colocated update's
  loop (config.rl.step_loop over K via step_loop_for, batch axis sharded). `frozen` as in
  make_update."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=True, decode=False)
  velocity_fn = velocity_fn_of(exp)
  r = exp.config.rl
  guidance, norm_rescale = guidance_of(exp)
  K, K_pad = tsp_steps(exp, mesh)
  axes = mesh_lib.data_axes(mesh)

  def on_steps(tree):
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(
            a,
            jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(axes, *([None] * (a.ndim - 1)))
            ),
        ),
        tree,
    )

  def grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params, frozen):
    step_weights, constraint = None, None
    if tsp:
      if K_pad > K:  # repeat the first selected step; weight 0 keeps it out of everything
        indices = jnp.concatenate([indices, jnp.broadcast_to(indices[:1], (K_pad - K,))])
        step_weights = (jnp.arange(K_pad) < K).astype(jnp.float32)
      constraint = on_steps

    def loss_fn(p):
      return objective_lib.grpo_objective(
          velocity_fn,
          exp.weights.effective(p, frozen),
          traj,
          cond,
          adv,
          valid,
          indices,
          sde_cfg=exp.sde_cfg,
          clip_range=r.clip_range,
          kl_beta=r.kl_beta,
          ref_params=exp.weights.reference(ref_params, frozen) if r.kl_beta > 0 else None,
          guidance_scale=guidance,
          uncond=uncond if guidance is not None else None,
          norm_rescale=norm_rescale,
          denominator=1.0,
          step_weights=step_weights,
          step_constraint=constraint,
          step_loop='vmap' if tsp else step_loop_for(r.step_loop, mesh),
          behaviour=behaviour_of(exp),
      )

    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    w = m['weight_sum']
    sums = dict(acc['sums'])
    # policy_loss / loss are already sums (denominator 1); the others are weighted means. A
    # non-finite advantage poisons the loss sum, so `apply` skips the whole logical batch.
    sums['loss'] = sums['loss'] + loss + jnp.where(all_finite(adv), 0.0, jnp.nan)
    sums['policy_loss'] = sums['policy_loss'] + m['policy_loss']
    for k in ('approx_kl', 'clip_frac', 'ratio_mean', 'kl'):
      sums[k] = sums[k] + m[k] * w
    sums['weight_sum'] = sums['weight_sum'] + w
    for k in _MAX_KEYS:
      sums[k] = jnp.maximum(sums[k], m[k])
    return {'grads': jax.tree.map(jnp.add, acc['grads'], g), 'sums': sums}

  rep = mesh_lib.replicated(mesh)
  data = lambda nd: mesh_lib.batch_sharding(mesh, nd)
  cond_sharding = cond_shardings(mesh, exp.cond_abstract(1))
  acc_sh = {
      'grads': param_shardings,
      'sums': {k: rep for k in ACC_SUM_KEYS},
  }
  frozen_sh = frozen_shardings(frozen)

  def make():
    return jax.jit(
        grad,
        in_shardings=(
            param_shardings,
            acc_sh,
            traj_shardings,
            cond_sharding,
            cond_sharding,
            data(1),
            data(1),
            rep,
            ref_shardings(exp, param_shardings),
            frozen_sh,
        ),
        out_shardings=acc_sh,
        donate_argnums=(1,),
    )

  parts = (mesh, _layout(param_shardings), _layout(traj_shardings), tsp, _layout(frozen_sh))
  return Bound(_memoized('fragment_grad', exp, parts, make), frozen)


def make_apply(exp, mesh, param_shardings, opt_shardings):
  """apply(params, opt_state, acc) -> (params, opt_state, metrics): one optimizer step with the
  accumulated gradient divided by the batch's total pair weight; skipped (state unchanged,
  metrics['nonfinite'] = 1) when the gradient, loss (which a non-finite advantage poisons, see
  make_fragment_grad) or the new params/state are not finite. Donates params, state."""
  optimizer = exp.optimizer
  rep = mesh_lib.replicated(mesh)

  def apply(params, opt_state, acc):
    s = acc['sums']
    den = s['weight_sum']
    inv = 1.0 / jnp.where(den > 0, den, 1.0)
    grads = jax.tree.map(lambda g: g * inv, acc['grads'])
    loss = s['loss'] * inv
    grad_norm = optax.tree.norm(grads)
    updates, new_o = optimizer.update(grads, opt_state, params)
    new_p = optax.apply_updates(params, updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss) & all_finite(new_p) & all_finite(new_o)
    metrics = {
        'loss': loss,
        'policy_loss': s['policy_loss'] * inv,
        'approx_kl': s['approx_kl'] * inv,
        'clip_frac': s['clip_frac'] * inv,
        'ratio_mean': s['ratio_mean'] * inv,
        'kl': s['kl'] * inv,
        'ratio_max_dev': s['ratio_max_dev'],
        'rollout_ratio_max_dev': s['rollout_ratio_max_dev'],
        'weight_sum': den,
        'grad_norm': grad_norm,
        'nonfinite': (~finite).astype(jnp.float32),
    }
    new_p, new_o = keep_if(finite, (new_p, new_o), (params, opt_state))
    return new_p, new_o, metrics

  acc_sh = {
      'grads': param_shardings,
      'sums': {k: rep for k in ACC_SUM_KEYS},
  }
  return _memoized(
      'apply',
      exp,
      (mesh, _layout(param_shardings), _layout(opt_shardings)),
      lambda: jax.jit(
          apply,
          in_shardings=(param_shardings, opt_shardings, acc_sh),
          out_shardings=(param_shardings, opt_shardings, rep),
          donate_argnums=(0, 1),
      ),
  )
