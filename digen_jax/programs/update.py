"""The update programs: the gradient of a fragment (accumulated over a logical batch) and the
optimizer step, or both fused into one program for a batch trained as a single fragment.

One loss per objective (`grpo_loss`; forward_process.lf_loss for the likelihood-free ones, picked
by `loss_of`) and one optimizer step (`optimizer_step`) serve both forms. The loss of
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
from digen_jax.programs import forward_process
from digen_jax.programs import tsp as tsp_lib
from digen_jax.rl import objective as objective_lib
from digen_jax.rl import old_policy
from digen_jax.rl import timesteps as timesteps_lib

# Metrics that are sums over the batch's pairs with denominator 1 (divided by the total pair
# weight at apply), and GRPO's weighted means and maxima.
_TOTAL_KEYS = ('loss', 'policy_loss')
_GRPO_MEAN_KEYS = ('approx_kl', 'clip_frac', 'ratio_mean', 'kl')
_GRPO_MAX_KEYS = ('ratio_max_dev', 'rollout_ratio_max_dev')


def metric_keys(exp) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """(totals, weighted means, maxima): the metric scalars of the run's objective as the fragment
  accumulator keeps them (make_zero_acc), beside the total pair weight 'weight_sum'."""
  if exp is None or exp.rl.algorithm == 'grpo':
    return _TOTAL_KEYS, _GRPO_MEAN_KEYS, _GRPO_MAX_KEYS
  return (*forward_process.metric_names(exp), ())


def acc_sum_keys(exp) -> tuple[str, ...]:
  """Every scalar of the accumulator's 'sums' (exp None: GRPO's)."""
  return sum(metric_keys(exp), ()) + ('weight_sum',)


# GRPO's accumulator scalars (what make_zero_acc keeps for a GRPO run).
ACC_SUM_KEYS = acc_sum_keys(None)


def loss_of(exp, velocity_fn, frozen, batch, ref_params, old_params, indices, **options):
  """loss(params) -> (loss, metrics) of the run's objective (config.rl.algorithm) on `batch`;
  indices: GRPO's trained steps, or the likelihood-free objectives' level slots."""
  if exp.rl.algorithm == 'grpo':
    return grpo_loss(exp, velocity_fn, frozen, batch, ref_params, indices, **options)
  options.pop('behaviour', None)
  return forward_process.lf_loss(
      exp, velocity_fn, frozen, batch, ref_params, old_params, indices, **options
  )


def old_policy_of_used(exp) -> bool:
  """Whether the run's updates read an old policy copy (old_policy_of is not None)."""
  return exp.rl.keeps_old_policy


def old_policy_of(exp, opt_state):
  """The old policy's params an update reads (None: the current params serve, with no second
  forward): the likelihood-free objectives' EMA copy in the optimizer state."""
  return old_policy.old_params(opt_state) if old_policy_of_used(exp) else None


def select_indices(exp, key, step) -> jax.Array:
  """int32 [K]: GRPO's trained steps for (key, step), or every level slot 0 .. K-1."""
  if exp.rl.algorithm == 'grpo':
    return timesteps_lib.select_timesteps(exp.selection, len(exp.sigmas) - 1, key, step)
  return jnp.arange(common.trained_levels(exp), dtype=jnp.int32)


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

  def update(params, opt_state, traj, cond, uncond, adv, valid, key, step, ref_params, frozen):
    indices = select_indices(exp, key, step)
    loss_fn = loss_of(
        exp,
        velocity_fn,
        frozen,
        _real_rows(exp, (traj, cond, uncond, adv, valid), mesh, samples),
        ref_params,
        old_policy_of(exp, opt_state),  # the step's old policy, before its epochs move params
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
  """select(key, step) -> int32 [K] trained step indices or level slots (replicated)."""
  rep = mesh_lib.replicated(mesh)
  return common.memoized(
      'select',
      exp,
      (mesh,),
      lambda: jax.jit(
          lambda key, step: select_indices(exp, key, step),
          in_shardings=(rep, rep),
          out_shardings=rep,
      ),
  )


def make_zero_acc(param_shardings, mesh, exp=None):
  """zero_acc(params) -> {'grads': zeros like params (same shardings), 'sums': zero scalars of
  the run's objective (acc_sum_keys; exp None: GRPO's)}."""
  rep = mesh_lib.replicated(mesh)
  keys = acc_sum_keys(exp)

  def zero(params):
    sums = {k: jnp.zeros((), jnp.float32) for k in keys}
    return {'grads': jax.tree.map(jnp.zeros_like, params), 'sums': sums}

  sums_sh = {k: rep for k in keys}
  return jax.jit(
      zero,
      in_shardings=(param_shardings,),
      out_shardings={'grads': param_shardings, 'sums': sums_sh},
  )


def _accumulate(exp, acc, loss, metrics, grads, adv):
  """acc + one fragment's gradient and metric sums. The totals (loss, policy_loss, ...) are
  already sums (denominator 1); the means are weighted means. A non-finite advantage poisons the loss sum,
  so `apply` skips the whole logical batch."""
  totals, means, maxima = metric_keys(exp)
  w = metrics['weight_sum']
  sums = dict(acc['sums'])
  sums['loss'] = sums['loss'] + loss + jnp.where(common.all_finite(adv), 0.0, jnp.nan)
  for k in totals[1:]:
    sums[k] = sums[k] + metrics[k]
  for k in means:
    sums[k] = sums[k] + metrics[k] * w
  sums['weight_sum'] = sums['weight_sum'] + w
  for k in maxima:
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
  """grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params, old_params) -> acc +
  this fragment's gradient of sum(w * l) and its metric sums (acc donated). traj: a Trajectory
  (GRPO) or CleanSamples (the likelihood-free objectives); old_params: old_policy_of(exp,
  opt_state) (None for GRPO or when the current params serve).

  tsp: the K selected steps x the fragment's samples as one vmap laid out on the (t, b) view of
  `mesh` (programs/tsp.py); else config.rl.step_loop over K (step_loop_for), the batch axis
  sharded. samples: the fragment's real samples, its first rows (the rest are weight-0 padding,
  experiment/fragments.py; default: every row): only ceil(samples / u) * u rows are computed
  (u: common.row_unit; TSP: ceil(samples / b) * b).
  `frozen` as in make_update."""
  if frozen is None:
    frozen = exp.weights.frozen(mesh, fsdp=True, decode=False)
  velocity_fn = common.velocity_fn_of(exp, mesh)

  def grad(params, acc, traj, cond, uncond, adv, valid, indices, ref_params, old_params, frozen):
    batch = (traj, cond, uncond, adv, valid)
    if tsp:
      lay = tsp_lib.layout(exp, mesh, adv.shape[0] if samples is None else samples)
      indices, batch, options = tsp_lib.prepare(mesh, lay, indices, batch)
    else:
      batch = _real_rows(exp, batch, mesh, samples)
      options = dict(step_loop=common.step_loop_for(exp.rl.step_loop, mesh))
    loss_fn = loss_of(
        exp,
        velocity_fn,
        frozen,
        batch,
        ref_params,
        old_params,
        indices,
        denominator=1.0,
        **options,
    )
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return _accumulate(exp, acc, loss, metrics, grads, adv)

  rep = mesh_lib.replicated(mesh)
  acc_sh = {'grads': param_shardings, 'sums': {k: rep for k in acc_sum_keys(exp)}}
  frozen_sh = common.frozen_shardings(frozen)
  in_sh = (
      param_shardings,
      acc_sh,
      *_batch_shardings(exp, mesh, traj_shardings),
      rep,
      common.ref_shardings(exp, param_shardings),
      param_shardings if old_policy_of_used(exp) else None,
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
  totals, means, maxima = metric_keys(exp)

  def apply(params, opt_state, acc):
    s = acc['sums']
    den = s['weight_sum']
    inv = 1.0 / jnp.where(den > 0, den, 1.0)
    grads = jax.tree.map(lambda g: g * inv, acc['grads'])
    loss = s['loss'] * inv
    params, opt_state, grad_norm, nonfinite = optimizer_step(
        exp.optimizer, params, opt_state, grads, loss
    )
    metrics = {k: s[k] * inv for k in totals + means}
    metrics.update({k: s[k] for k in maxima})
    metrics.update(weight_sum=den, grad_norm=grad_norm, nonfinite=nonfinite)
    return params, opt_state, metrics

  acc_sh = {'grads': param_shardings, 'sums': {k: rep for k in acc_sum_keys(exp)}}
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
