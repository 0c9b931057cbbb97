"""Colocated synchronous GRPO: one mesh; sample the whole batch, score it, update, repeat.

The baseline every later mode is compared to. Per step: prompts -> (cached) text embeddings ->
rollout program (one jitted lax.scan, data-parallel) -> decode + reward on the host ->
advantages -> update program (FSDP params/optimizer state, donated) -> metrics + checkpoint.
"""
from __future__ import annotations

import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import checkpoint as ckpt_lib
from digen_jax import evaluation
from digen_jax import metrics as metrics_lib
from digen_jax import programs
from digen_jax import visualize
from digen_jax.rl import advantages as adv_lib
from digen_jax.runtime import mesh as mesh_lib


def _encode(exp, prompts, mesh):
  emb, mask = exp.text_encoder.encode(prompts)
  return {'text': jax.device_put(np.asarray(emb, np.float32), mesh_lib.batch_sharding(mesh, 3)),
          'text_mask': jax.device_put(np.asarray(mask, np.int32), mesh_lib.batch_sharding(mesh, 2))}


def train(exp, workdir: str, devices=None) -> dict:
  """Runs config.total_steps optimizer steps (resuming from <workdir>/checkpoints). Returns the
  final {'params', 'opt_state', 'step'} so tests can compare runs."""
  config = exp.config
  devices = devices if devices is not None else jax.local_devices()
  mesh = mesh_lib.make_mesh(devices)
  n_dev = len(devices)

  param_shardings = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = jax.device_put(exp.params, param_shardings)
  opt_shapes = jax.eval_shape(exp.optimizer.init, params)
  opt_shardings = mesh_lib.fsdp_shardings(opt_shapes, mesh)
  opt_state = jax.jit(exp.optimizer.init, out_shardings=opt_shardings)(params)
  ref_params = (jax.tree.map(jnp.copy, params) if config.rl.kl_beta > 0 else None)
  base_key = jax.random.key(config.seed)

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                       max_to_keep=config.keep_checkpoints,
                                       save_every=config.checkpoint_every)
  start = checkpointer.latest_step() or 0
  if start:
    state, meta = checkpointer.restore(start, {
        'params': params, 'opt_state': opt_state, 'rng': ckpt_lib.key_to_data(base_key)})
    params, opt_state = state['params'], state['opt_state']
    base_key = ckpt_lib.data_to_key(state['rng'])
    exp.prompts.restore(meta['data_position'])
    logging.info('resumed from %s at step %d (data position %d)', checkpointer.directory, start,
                 meta['data_position'])

  rollout = programs.make_rollout(exp, mesh)
  update = programs.make_update(exp, mesh, param_shardings, opt_shardings)
  rep = mesh_lib.replicated(mesh)
  decode = jax.jit(exp.decode)
  uncond = None
  if config.sampler.guidance_scale > 1.0:
    uncond = _encode(exp, [''] * exp.batch_size, mesh)

  writer = metrics_lib.MetricsWriter(workdir)
  progress = metrics_lib.Progress(start, config.total_steps)
  evaluator = None
  if config.eval.every > 0:
    evaluator = evaluation.Evaluator(exp, mesh, evaluation.eval_prompts(exp, workdir))

  def run_eval(step):
    result = evaluator(params, seed=config.eval.seed)
    writer.write({'step': step, **result['metrics']})
    grid = evaluation.write_report(result, os.path.join(workdir, 'eval'), step)
    logging.info('eval at step %d: %s (%s)', step, result['metrics'], grid)

  if evaluator is not None and start == 0:
    run_eval(0)                                                  # the base model's score
  G = config.rl.group_size
  for step in range(start, config.total_steps):
    t0 = time.perf_counter()
    prompts = exp.prompts.next_batch()
    batch_prompts = [p for p in prompts for _ in range(G)]      # group-contiguous
    cond = _encode(exp, batch_prompts, mesh)
    step_key = jax.random.fold_in(base_key, step)
    k_rollout, k_update = jax.random.split(step_key)
    k_rollout, k_update = jax.device_put((k_rollout, k_update), rep)
    step_arr = jax.device_put(jnp.int32(step), rep)

    t_roll = time.perf_counter()
    rollout_params = jax.device_put(params, rep)                 # the rollout copy
    traj = rollout(rollout_params, cond, uncond if uncond is not None else cond, k_rollout, step_arr)
    images = np.asarray(decode(traj.latents[-1]))
    t_roll = time.perf_counter() - t_roll

    rewards = np.asarray(exp.reward_fn(images, batch_prompts), np.float32)
    adv, valid = adv_lib.grpo_advantages(
        jnp.asarray(rewards), G, std_mode=config.rl.adv_std, eps=config.rl.adv_eps,
        clip=config.rl.adv_clip)

    t_upd = time.perf_counter()
    params, opt_state, m = update(params, opt_state, traj, cond,
                                  uncond if uncond is not None else cond, adv, valid, k_update,
                                  step_arr, ref_params)
    m = jax.device_get(m)
    t_upd = time.perf_counter() - t_upd
    wall = time.perf_counter() - t0

    if m['nonfinite'] > 0:
      logging.error('step %d: non-finite loss/gradient; the update was skipped (weights unchanged)',
                    step + 1)
    row = {
        'step': step + 1, 'policy_version': step, 'reward_mean': float(rewards.mean()),
        'reward_std': float(rewards.std()), 'samples': exp.batch_size,
        'samples_per_s': exp.batch_size / wall, 'wall_s': wall,
        'rollout_s': t_roll, 'update_s': t_upd,
        # Devices are busy during the two programs and idle while the host scores images.
        'utilization': min(1.0, (t_roll + t_upd) / wall),
        'valid_frac': float(np.asarray(valid).mean()),
        **{k: float(v) for k, v in m.items()},
    }
    writer.write(row)
    if config.sample_grid_every and (step + 1) % config.sample_grid_every == 0:
      captions = [f'{p} | r={r:.3f}' for p, r in zip(batch_prompts, rewards)]
      grid = visualize.save_grid(os.path.join(workdir, 'samples', f'step_{step + 1:06d}.png'),
                                 images, captions, cols=G)
      writer.write_image('samples', grid, step + 1)
    if (step + 1) % config.log_every == 0 or step + 1 == config.total_steps:
      progress.log(step + 1, row)
    if evaluator is not None and ((step + 1) % config.eval.every == 0
                                  or step + 1 == config.total_steps):
      run_eval(step + 1)
    checkpointer.save(step + 1, {'params': params, 'opt_state': opt_state,
                                 'rng': ckpt_lib.key_to_data(base_key)},
                      {'step': step + 1, 'data_position': exp.prompts.position,
                       'policy_version': step + 1},
                      force=step + 1 == config.total_steps)
  checkpointer.close()
  writer.close()
  return {'params': params, 'opt_state': opt_state, 'step': config.total_steps}
