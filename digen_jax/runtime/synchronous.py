"""The full-batch synchronous schedule in one process: colocated and naive disaggregated.

Per step: publish the trainer's weights to the rollout layout (version = optimizer steps so
far) -> rollout the whole batch (sampling scan, decode, host reward, advantages) -> move the
batch to the trainer's layout -> one update -> metrics row + checkpoint. Colocated runs give
both roles one mesh (the publish is then a replicate on the same devices); naive disaggregated
runs give each role its own mesh (DESIGN.md §3), with the same programs and the same math.
Two-process disaggregated runs use the same workers over a transfer.Channel (runtime/disagg.py).
"""
from __future__ import annotations

import os
import time

from absl import logging
import jax

from digen_jax import checkpoint as ckpt_lib
from digen_jax import metrics as metrics_lib
from digen_jax import visualize
from digen_jax.runtime import publish
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import workers


def write_samples(writer, workdir: str, out, step: int, group_size: int):
  """samples/step_<step>.png: the rollout grid, one row per prompt group."""
  captions = [f'{p} | r={r:.3f}' for p, r in zip(out.batch_prompts, out.rewards)]
  grid = visualize.save_grid(os.path.join(workdir, 'samples', f'step_{step:06d}.png'),
                             out.images, captions, cols=group_size)
  if writer is not None:
    writer.write_image('samples', grid, step)


def train(exp, workdir: str, cluster) -> dict:
  """Runs config.total_steps optimizer steps on `cluster` (runtime.cluster.Cluster, both roles in
  this process), resuming from <workdir>/checkpoints. Returns the final
  {'params', 'opt_state', 'step'} so tests can compare runs."""
  config = exp.config
  level = config.runtime.transfer_guard
  trainer = workers.TrainerWorker(
      exp, cluster.trainer.mesh,
      ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'),
                            max_to_keep=config.keep_checkpoints,
                            save_every=config.checkpoint_every),
      level)
  start = trainer.start
  if start:
    exp.prompts.restore(trainer.data_position)
  rollout = workers.RolloutWorker(exp, cluster.rollout.mesh,
                                  publish.rollout_param_shardings(cluster, exp.params), level,
                                  frozen_fsdp=publish.rollout_frozen_fsdp(cluster))
  dtype = publish.rollout_param_dtype(cluster)
  publish_mb = publish.publish_megabytes(exp.params, dtype)
  writer = metrics_lib.MetricsWriter(workdir)
  progress = metrics_lib.Progress(start, config.total_steps)
  evals = workers.EvalRunner(exp, cluster.rollout.mesh, workdir,
                             frozen_fsdp=publish.rollout_frozen_fsdp(cluster))
  tracer = trace_lib.Tracer(config.schedule.trace)
  all_devices = list(cluster.trainer.devices) + [
      d for d in cluster.rollout.devices if d not in cluster.trainer.devices]

  def publish_now(version: int):
    t = time.perf_counter()
    with workers.guard(level), tracer.span(all_devices, 'trainer', 'publish', step=version,
                                           version=version):
      policy = publish.publish_local(trainer.params, version, rollout.param_shardings, dtype)
      jax.block_until_ready(policy.params)
    return policy, time.perf_counter() - t

  G = config.rl.group_size
  for step in range(start, config.total_steps):
    t0 = time.perf_counter()
    t_start = time.time()
    policy, publish_s = publish_now(step)
    if evals.due(step, start):
      t_eval = time.perf_counter()
      writer.write(evals(policy))
      t0 += time.perf_counter() - t_eval                 # the step's wall time excludes eval
      t_start += time.perf_counter() - t_eval
    out = rollout.generate(policy, exp.prompts.next_batch(), step, tracer)
    del policy  # the update below may donate buffers the rollout copy shares (colocated)
    t_move = time.perf_counter()
    with workers.guard(level):
      batch = jax.block_until_ready(publish.move_batch_local(out.batch, trainer.batch_shardings))
    t_move = time.perf_counter() - t_move
    m, update_s = trainer.train_step(batch, out.batch_prompts, step, tracer)
    wall = time.perf_counter() - t0
    t_end = time.time()
    if m['nonfinite'] > 0:
      logging.error('step %d: non-finite loss/gradient; the update was skipped (weights '
                    'unchanged)', step + 1)
    row = workers.step_row(
        step=step + 1, policy_version=out.policy_version, rewards=out.rewards,
        valid_frac=out.valid_frac, metrics=m, wall_s=wall, rollout_s=out.rollout_s,
        reward_s=out.reward_s, update_s=update_s, publish_s=publish_s, publish_mb=publish_mb,
        batch_move_s=t_move, cluster=cluster,
        utilization=tracer.utilization(t_start, t_end, cluster.num_devices))
    writer.write(row)
    if config.sample_grid_every and (step + 1) % config.sample_grid_every == 0:
      write_samples(writer, workdir, out, step + 1, G)
    if (step + 1) % config.log_every == 0 or step + 1 == config.total_steps:
      progress.log(step + 1, row)
    trainer.save(step + 1, exp.prompts.position, force=step + 1 == config.total_steps)
  if evals.enabled and start < config.total_steps:
    writer.write(evals(publish_now(config.total_steps)[0]))     # the final policy
  tracer.write(workdir, title=f'{config.runtime.mode} (synchronous)')
  trainer.close()
  writer.close()
  return {'params': trainer.params, 'opt_state': trainer.opt_state, 'step': config.total_steps}
