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

import jax

from digen_jax.process import interrupt
from digen_jax.outputs import visualize
from digen_jax.runtime import publish
from digen_jax.runtime import steps as steps_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import workers


def write_samples(writer, workdir: str, out, step: int, group_size: int):
  """samples/step_<step>.png: the rollout grid, one row per prompt group."""
  captions = [f'{p} | r={r:.3f}' for p, r in zip(out.batch_prompts, out.rewards)]
  grid = visualize.save_grid(
      os.path.join(workdir, 'samples', f'step_{step:06d}.png'),
      out.images,
      captions,
      cols=group_size,
  )
  if writer is not None:
    writer.write_image('samples', grid, step)


def train(exp, workdir: str, cluster) -> dict:
  """Runs config.total_steps optimizer steps on `cluster` (runtime.cluster.Cluster, both roles in
  this process), resuming from <workdir>/checkpoints. Returns the final
  {'params', 'opt_state', 'step'} so tests can compare runs."""
  config = exp.config
  tracer = trace_lib.Tracer(config.schedule.trace)
  run = steps_lib.TrainerRun(exp, workdir, cluster, tracer)
  trainer, level = run.trainer, run.level
  start = run.start
  if start:
    exp.prompts.restore(trainer.data_position)
  rollout = workers.RolloutWorker(
      exp,
      cluster.rollout.mesh,
      publish.rollout_param_shardings(cluster, exp.params),
      level,
      frozen_fsdp=publish.rollout_frozen_fsdp(cluster),
  )
  evals = workers.EvalRunner(
      exp, cluster.rollout.mesh, workdir, frozen_fsdp=publish.rollout_frozen_fsdp(cluster)
  )
  all_devices = list(cluster.trainer.devices) + [
      d for d in cluster.rollout.devices if d not in cluster.trainer.devices
  ]

  def send(params, version):
    policy = publish.publish_local(params, version, rollout.param_shardings, run.rollout_dtype)
    jax.block_until_ready(policy.params)
    return policy

  G = config.rl.group_size
  with run.stops_cleanly():
    for step in range(start, config.total_steps):
      t0 = time.perf_counter()
      t_start = time.time()
      policy, publish_s = run.publish(send, step, all_devices)
      if evals.due(step, start):
        t_eval = time.perf_counter()
        run.write_rows([evals(policy)])
        t0 += time.perf_counter() - t_eval  # the step's wall time excludes eval
        t_start += time.perf_counter() - t_eval
      out = rollout.generate(policy, exp.prompts.next_batch(), step, tracer)
      interrupt.check(f'after sampling step {step + 1}')
      del policy  # the update below may donate buffers the rollout copy shares (colocated)
      t_move = time.perf_counter()
      with workers.guard(level):
        batch = jax.block_until_ready(publish.move_batch_local(out.batch, trainer.batch_shardings))
      t_move = time.perf_counter() - t_move
      m, update_s = trainer.train_step(batch, out.batch_prompts, step, tracer)
      wall = time.perf_counter() - t0
      t_end = time.time()
      if config.sample_grid_every and (step + 1) % config.sample_grid_every == 0:
        write_samples(run.writer, workdir, out, step + 1, G)
      run.end_step(
          step,
          data_position=exp.prompts.position,
          prompts=out.batch_prompts,
          policy_version=out.policy_version,
          rewards=out.rewards,
          valid_frac=out.valid_frac,
          metrics=m,
          wall_s=wall,
          rollout_s=out.rollout_s,
          reward_s=out.reward_s,
          update_s=update_s,
          publish_s=publish_s,
          batch_move_s=t_move,
          utilization=tracer.utilization(t_start, t_end, cluster.num_devices),
      )
  if run.final_eval:
    run.write_rows([evals(run.publish(send, config.total_steps, all_devices)[0])])
  return run.finish(f'{config.runtime.mode} (synchronous)')
