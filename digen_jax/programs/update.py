"""The update programs: the GRPO gradient of a fragment (accumulated over a logical batch) and
the optimizer step, or both fused into one program for a batch trained as a single fragment.

One loss (`grpo_loss`) and one optimizer step (`optimizer_step`) serve both forms. The loss of
the logical batch is sum(w * l) / D with D = sum(w) over the whole batch; D is known only when
every group is scored, so fragments accumulate the unnormalised gradient of sum(w * l)
(denominator 1) and `make_apply` divides by D: the same update as the fused program's, to
float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from digen_jax.parallel import mesh as mesh_lib
from digen_jax.parallel import sequence as sequence_lib
from digen_jax.programs import common
from digen_jax.programs import tsp as tsp_lib
from digen_jax.rl import objective as objective_lib
from digen_jax.rl import timesteps as timesteps_lib

_SUM_KEYS = ('loss', 'policy_loss', 'approx_kl', 'clip_frac', 'ratio_mean', 'kl')
_MAX_KEYS = ('ratio_max_dev', 'rollout_ratio_max_dev')
# The accumulator's metric scalars (make_zero_acc): summed, maxed, and the total pair weight.
ACC_SUM_KEYS = _SUM_KEYS + _MAX_KEYS + ('weight_sum',)


def grpo_loss(exp, velocity_fn, frozen, batch, ref_params, indices, **options):
  """loss(params) -> (loss, metrics): the GRPO objective of `batch` (traj, cond, uncond, adv,
  valid) over the trained step `indices` with the config's clip range, KL, CFG and behaviour
  log-probs; `options` are grpo_objective's execution options (step_loop, denominator,
  step_weights, step_constraint). The one loss of every update program."""
  r = exp.rl
  guidance, norm_rescale = common.guidance_of(exp)
  traj, cond, uncond, adv, valid = batch

  def loss(params):
    return objective_lib.grpo_objective(
        velocity_fn,
        exp.weights.effective(params, frozen),
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
        behaviour=common.behaviour_of(exp),
        **options,
    )

  return loss


def optimizer_step(optimizer, params, opt_state, grads, loss, finite_inputs=True):
  """(params, opt_state, grad_norm, nonfinite): one optimizer step, or the state unchanged
  (nonfinite = 1.0) when the gradient, the loss, `finite_inputs` (a bool scalar) or the new
  params/state are not all finite: NaN/inf never enters the weights or the moments."""
  grad_norm = optax.tree.norm(grads)
  updates, new_o = optimizer.update(grads, opt_state, params)
  new_p = optax.apply_updates(params, updates)
  finite = (
      jnp.isfinite(grad_norm)
      & jnp.isfinite(loss)
      & finite_inputs
      & common.all_finite(new_p)
      & common.all_finite(new_o)
  )
  new_p, new_o = common.keep_if(finite, (new_p, new_o), (params, opt_state))
  return new_p, new_o, grad_norm, (~finite).astype(jnp.float32)


def tsp_steps(exp, mesh, samples: int | None = None) -> tuple[int, int]:
  """(K, K_pad): trained timesteps per trajectory, and K padded for TSP's (t, b) layout of the
  trainer `mesh` (tsp.layout, the one place that computes it; `samples`: the fragment size,
  default exp.plan.size)."""
  lay = tsp_lib.layout(exp, mesh, samples)
  return lay.K, lay.K_pad


def _batch_shardings(exp, mesh, traj_shardings):
  """in_shardings of (traj, cond, uncond, adv, valid) on `mesh`."""
  cond = common.cond_shardings(mesh, exp.cond_abstract(1))
  data = mesh_lib.batch_sharding(mesh, 1)
  return (traj_shardings, cond, cond, data, data)


def _real_rows(exp, batch, mesh, samples):
  """`batch` cut to the rows a program on `mesh` computes (common.computed_rows, a multiple of
  common.row_unit), batch-sharded (with config.parallel.sequence, over the groups of devices
  that share a sample): the weight-0 rows another mesh's layout needed are dropped before any
  forward."""
  rows = common.computed_rows(batch[3].shape[0], samples, common.row_unit(exp, mesh))
  view = common.token_mesh_of(exp, mesh)
  if view is None:
    sharding_of = lambda ndim, axis: mesh_lib.batch_sharding(mesh, ndim, axis)
  else:
    sharding_of = lambda ndim, axis: sequence_lib.samples_sharding(view, ndim, axis)
  return common.take_rows(batch, rows, sharding_of)


def make_update(
    exp,
    mesh,
    param_shardings,
    opt_shardings,
    traj_shardings=None,
    *,
    frozen=None,
    samples: int | None = None,
):
  """update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params)
       -> (params, opt_state, metrics): a batch trained as one fragment, gradient and
  optimizer step in one program, rl.inner_epochs PPO epochs over it (skipped, state unchanged,
  metrics['nonfinite'] = 1, when anything is not finite: optimizer_step).
  ref_params: the frozen reference (FSDP-sharded like params) when rl.kl_beta > 0, else None.
  traj_shardings: the layout the trajectory arrives in (None: whatever it has). `frozen`: the
  frozen weights on `mesh` (default: loaded FSDP-sharded, without the decoder). samples: the
  batch's real samples, its first rows (the rest weight-0 padding; None: every row): only
  ceil(samples / u) * u rows are computed (u: common.row_unit, n devices or n /
  config.parallel.sequence). Donates params and optimizer state."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=True, decode=False)
  velocity_fn = common.velocity_fn_of(exp, mesh)
  r = exp.rl
  T = len(exp.sigmas) - 1

  def update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params, frozen):
    indices = timesteps_lib.select_timesteps(exp.selection, T, key, step)
    loss_fn = grpo_loss(
        exp,
        velocity_fn,
        frozen,
        _real_rows(exp, (traj, cond, uncond, adv, valid), mesh, samples),
        ref_params,
        indices,
        step_loop=common.step_loop_for(r.step_loop, mesh),
    )

    def epoch(carry, _):
      p, o = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
      p, o, grad_norm, nonfinite = optimizer_step(
          exp.optimizer, p, o, grads, loss, common.all_finite(adv)
      )
      return (p, o), dict(metrics, loss=loss, grad_norm=grad_norm, nonfinite=nonfinite)

    (params, opt_state), per_epoch = jax.lax.scan(
        epoch, (params, opt_state), None, length=r.inner_epochs
    )
    # Report the first epoch's statistics (ratio == 1 there, on-policy) and the last loss.
    metrics = jax.tree.map(lambda m: m[0], per_epoch)
    metrics['nonfinite'] = per_epoch['nonfinite'].max()
    return params, opt_state, metrics

  rep = mesh_lib.replicated(mesh)
  frozen_sh = common.frozen_shardings(frozen)
  in_sh = (
      param_shardings,
      opt_shardings,
      *_batch_shardings(exp, mesh, traj_shardings),
      rep,
      rep,
      common.ref_shardings(exp, param_shardings),
      frozen_sh,
  )

  def make():
    return jax.jit(
        update,
        in_shardings=in_sh,
        out_shardings=(param_shardings, opt_shardings, rep),
        donate_argnums=(0, 1),
    )

  layouts = (param_shardings, opt_shardings, traj_shardings, frozen_sh)
  parts = (mesh, *map(common.layout_key, layouts), samples)
  return common.Bound(common.memoized('update', exp, parts, make), frozen)


def make_select(exp, mesh):
  """select(key, step) -> int32 [K] trained step indices (replicated)."""
  T = len(exp.sigmas) - 1
  rep = mesh_lib.replicated(mesh)
  return common.memoized(
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


def _accumulate(acc, loss, metrics, grads, adv):
  """acc + one fragment's gradient and metric sums. policy_loss / loss are already sums
  (denominator 1); the others are weighted means. A non-finite advantage poisons the loss sum,
  so `apply` skips the whole logical batch."""
  w = metrics['weight_sum']
  sums = dict(acc['sums'])
  sums['loss'] = sums['loss'] + loss + jnp.where(common.all_finite(adv), 0.0, jnp.nan)
  sums['policy_loss'] = sums['policy_loss'] + metrics['policy_loss']
  for k in ('approx_kl', 'clip_frac', 'ratio_mean', 'kl'):
    sums[k] = sums[k] + metrics[k] * w
  sums['weight_sum'] = sums['weight_sum'] + w
  for k in _MAX_KEYS:
    sums[k] = jnp.maximum(sums[k], metrics[k])
  return {'grads': jax.tree.map(jnp.add, acc['grads'], grads), 'sums': sums}


def make_fragment_grad(
    exp,
    mesh,
    param_shardings,
    traj_shardings=None,
    *,
    tsp: bool = False,
    frozen=None,
    samples: int | None = None,
):
  """grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params) -> acc + this
  fragment's gradient of sum(w * l) and its metric sums (acc donated).

  tsp: the K selected steps x the fragment's samples as one vmap laid out on the (t, b) view of
  `mesh` (programs/tsp.py); else config.rl.step_loop over K (step_loop_for), the batch axis
  sharded. samples: the fragment's real samples, its first rows (the rest are weight-0 padding,
  experiment/fragments.py; default: every row): only ceil(samples / u) * u rows are computed
  (u: common.row_unit; TSP: ceil(samples / b) * b).
  `frozen` as in make_update."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=True, decode=False)
  velocity_fn = common.velocity_fn_of(exp, mesh)

  def grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params, frozen):
    batch = (traj, cond, uncond, adv, valid)
    if tsp:
      lay = tsp_lib.layout(exp, mesh, adv.shape[0] if samples is None else samples)
      indices, batch, options = tsp_lib.prepare(mesh, lay, indices, batch)
    else:
      batch = _real_rows(exp, batch, mesh, samples)
      options = dict(step_loop=common.step_loop_for(exp.rl.step_loop, mesh))
    loss_fn = grpo_loss(
        exp,
        velocity_fn,
        frozen,
        batch,
        ref_params,
        indices,
        denominator=1.0,
        **options,
    )
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return _accumulate(acc, loss, metrics, grads, adv)

  rep = mesh_lib.replicated(mesh)
  acc_sh = {'grads': param_shardings, 'sums': {k: rep for k in ACC_SUM_KEYS}}
  frozen_sh = common.frozen_shardings(frozen)
  in_sh = (
      param_shardings,
      acc_sh,
      *_batch_shardings(exp, mesh, traj_shardings),
      rep,
      common.ref_shardings(exp, param_shardings),
      frozen_sh,
  )

  def make():
    return jax.jit(grad, in_shardings=in_sh, out_shardings=acc_sh, donate_argnums=(1,))

  parts = (
      mesh,
      common.layout_key(param_shardings),
      common.layout_key(traj_shardings),
      tsp,
      samples,
      common.layout_key(frozen_sh),
  )
  return common.Bound(common.memoized('fragment_grad', exp, parts, make), frozen)


def make_apply(exp, mesh, param_shardings, opt_shardings):
  """apply(params, opt_state, acc) -> (params, opt_state, metrics): one optimizer step with the
  accumulated gradient divided by the batch's total pair weight (optimizer_step: skipped when
  anything, the loss a non-finite advantage poisons included, is not finite). Donates params
  and optimizer state."""
  rep = mesh_lib.replicated(mesh)

  def apply(params, opt_state, acc):
    s = acc['sums']
    den = s['weight_sum']
    inv = 1.0 / jnp.where(den > 0, den, 1.0)
    grads = jax.tree.map(lambda g: g * inv, acc['grads'])
    loss = s['loss'] * inv
    params, opt_state, grad_norm, nonfinite = optimizer_step(
        exp.optimizer, params, opt_state, grads, loss
    )
    metrics = {k: s[k] * inv for k in _SUM_KEYS}
    metrics.update({k: s[k] for k in _MAX_KEYS})
    metrics.update(weight_sum=den, grad_norm=grad_norm, nonfinite=nonfinite)
    return params, opt_state, metrics

  acc_sh = {'grads': param_shardings, 'sums': {k: rep for k in ACC_SUM_KEYS}}
  return common.memoized(
      'apply',
      exp,
      (mesh, common.layout_key(param_shardings), common.layout_key(opt_shardings)),
      lambda: jax.jit(
          apply,
          in_shardings=(param_shardings, opt_shardings, acc_sh),
          out_shardings=(param_shardings, opt_shardings, rep),
          donate_argnums=(0, 1),
      ),
  )
