"""Naive disaggregated GRPO (DESIGN.md §3): rollout and trainer on separate meshes, full-batch
barrier, one versioned weight publish per optimizer step.

One process (both roles' devices local): runtime/synchronous.py with a mesh per role; weights
and batches move by jax.device_put.

Two processes (launch/local.py --num_processes=2, or launch/slurm.sh): process 0 is the trainer,
the other process the rollout; weights and batches move over a transfer.Channel. Per step:

  trainer (process 0)                          rollout (process 1)
  publish weights v=step  ------------------>  receive policy v=step; eval if due
                                               prompts -> sample -> decode -> reward -> adv
  receive batch (+ info)  <------------------  send batch (traj, adv, valid) + info (JSON:
  update; metrics row; checkpoint                step, policy version, prompts, rewards, times)

Who writes what: the trainer process owns params and optimizer state and writes checkpoints,
metrics.jsonl (rollout statistics and eval rows arrive in the batch info), TensorBoard scalars,
config.json and the summary; the rollout process writes samples/ and eval/ (it holds the
images). Prompts come from the rollout's PromptIterator only (their text travels with the
batch; the trainer encodes them itself, which is cheap and deterministic), so the data position
has one owner; the trainer checkpoints it and tells the rollout where to resume through the
jax.distributed key-value store.
"""

from __future__ import annotations

import json
import time

from absl import logging
import numpy as np

from digen_jax.process import interrupt
from digen_jax.runtime import distributed
from digen_jax.runtime import pipeline
from digen_jax.runtime import publish
from digen_jax.runtime import steps as steps_lib
from digen_jax.runtime import synchronous
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import transfer
from digen_jax.runtime import workers

_KV = 'digen/disagg'
# Control messages wait for the peer's whole step (or an eval); a dead peer ends the job
# through the launcher long before this.
PEER_TIMEOUT_S = 3600.0


def train(exp, workdir: str, cluster) -> dict:
  """Runs the naive disaggregated schedule on `cluster` (runtime.cluster.resolve) for this
  process's role. Returns {'params', 'opt_state', 'step'} where this process trains, else
  {'step'}. config.schedule's GAP/TSP/TAG/TCSS modes run runtime/pipeline.py instead."""
  if pipeline.enabled(exp.config):
    return pipeline.train(exp, workdir, cluster)
  if not cluster.multi_process:
    return synchronous.train(exp, workdir, cluster)
  me = distributed.process_info().process_id
  role = cluster.role_of(me)
  if role == 'trainer':
    return _trainer_process(exp, workdir, cluster)
  if role == 'rollout':
    return _rollout_process(exp, workdir, cluster)
  raise ValueError(f'config.cluster gives process {me} no role')


def _trainer_process(exp, workdir: str, cluster) -> dict:
  config = exp.config
  tracer = trace_lib.Tracer(config.schedule.trace)
  run = steps_lib.TrainerRun(exp, workdir, cluster, tracer)
  trainer, level, start = run.trainer, run.level, run.start
  distributed.kv_set(
      f'{_KV}/start', json.dumps({'step': start, 'data_position': trainer.data_position})
  )
  chan = transfer.Channel(cluster.rollout.process, name='disagg', timeout_s=PEER_TIMEOUT_S)
  batch_abstract = workers.with_shardings(workers.abstract_batch(exp), trainer.batch_shardings)

  def send(params, version):
    manifest = publish.adapter_manifest(exp.weights, params, digest=version == start)
    publish.send_weights(chan, params, version, run.rollout_dtype, manifest)

  with run.stops_cleanly():
    for step in range(start, config.total_steps):
      t0 = time.perf_counter()
      t_start = time.time()
      _, send_s = run.publish(send, step)
      if step == start:
        trainer.compile_update()  # while the rollout process samples the first batch
      with workers.guard(level):
        batch, info, t_move = publish.receive_batch(chan, batch_abstract)
      if info['step'] != step or info['policy_version'] != step:
        raise RuntimeError(
            f'trainer at step {step} got the batch of step {info["step"]} sampled '
            f'by policy version {info["policy_version"]}; the naive schedule is '
            'strictly on-policy'
        )
      run.write_rows(info['evals'])
      tracer.extend(trace_lib.Span.from_json(s) for s in info['spans'])
      t0 += info['eval_s']  # the step's wall time excludes eval
      t_start += info['eval_s']
      chan.wait_delivered(publish.WEIGHTS_TAG)  # the rollout holds its copy: params may be donated
      m, update_s = trainer.train_step(batch, info['batch_prompts'], step, tracer)
      wall = time.perf_counter() - t0
      t_end = time.time()
      run.end_step(
          step,
          data_position=info['data_position'],
          prompts=info['batch_prompts'],
          policy_version=info['policy_version'],
          rewards=np.asarray(info['rewards'], np.float32),
          valid_frac=info['valid_frac'],
          metrics=m,
          wall_s=wall,
          rollout_s=info['rollout_s'],
          reward_s=info['reward_s'],
          update_s=update_s,
          publish_s=send_s + info['publish_pull_s'],
          batch_move_s=t_move,
          utilization=tracer.utilization(t_start, t_end, cluster.num_devices),
      )
  if run.final_eval:
    run.publish(send, config.total_steps)  # the final policy
    run.write_rows(json.loads(distributed.kv_get(f'{_KV}/final_evals', PEER_TIMEOUT_S)))
    chan.wait_delivered(publish.WEIGHTS_TAG)
  return run.finish('disagg (synchronous, 2 processes)')


def _rollout_process(exp, workdir: str, cluster) -> dict:
  config = exp.config
  level = config.runtime.transfer_guard
  start_info = json.loads(distributed.kv_get(f'{_KV}/start', PEER_TIMEOUT_S))
  start = int(start_info['step'])
  exp.prompts.restore(int(start_info['data_position']))
  chan = transfer.Channel(cluster.trainer.process, name='disagg', timeout_s=PEER_TIMEOUT_S)
  rollout = workers.RolloutWorker(
      exp,
      cluster.rollout.mesh,
      publish.rollout_param_shardings(cluster, exp.params),
      level,
      frozen_fsdp=publish.rollout_frozen_fsdp(cluster),
  )
  weights_abstract = transfer.abstract(
      exp.params, rollout.param_shardings, publish.rollout_param_dtype(cluster)
  )
  evals = workers.EvalRunner(
      exp, cluster.rollout.mesh, workdir, frozen_fsdp=publish.rollout_frozen_fsdp(cluster)
  )
  tracer = trace_lib.Tracer(config.schedule.trace)

  def receive(version: int):
    with workers.guard(level):
      policy, pull_s = publish.receive_weights(chan, weights_abstract)
    if policy.version != version:
      raise RuntimeError(f'rollout expected policy version {version}, got {policy.version}')
    publish.verify_policy(exp.weights, policy)
    return policy, pull_s

  G = config.rl.group_size
  for step in range(start, config.total_steps):
    interrupt.check(f'in the rollout of step {step + 1}')
    policy, pull_s = receive(step)
    eval_rows, t_eval = [], time.perf_counter()
    if evals.due(step, start):
      eval_rows.append(evals(policy))
    t_eval = time.perf_counter() - t_eval
    out = rollout.generate(policy, exp.prompts.next_batch(), step, tracer)
    info = {
        'spans': tracer.take_new(),
        'step': step,
        'policy_version': out.policy_version,
        'batch_prompts': out.batch_prompts,
        'data_position': exp.prompts.position,
        'rewards': [float(r) for r in out.rewards],
        'valid_frac': out.valid_frac,
        'rollout_s': out.rollout_s,
        'reward_s': out.reward_s,
        'publish_pull_s': pull_s,
        'eval_s': t_eval,
        'evals': eval_rows,
    }
    with workers.guard(level):
      publish.send_batch(chan, out.batch, info)
    if config.sample_grid_every and (step + 1) % config.sample_grid_every == 0:
      synchronous.write_samples(None, workdir, out, step + 1, G)
    # Keep the batch alive until the trainer has pulled it (it does so at once).
    chan.wait_delivered(publish.BATCH_TAG, timeout_s=PEER_TIMEOUT_S)
    logging.info(
        'rollout step %d/%d: policy v%d, reward_mean=%.4g, sampling %.2fs, '
        'weights pulled in %.3fs',
        step + 1,
        config.total_steps,
        policy.version,
        float(np.mean(out.rewards)),
        out.rollout_s,
        pull_s,
    )
  if evals.enabled and start < config.total_steps:
    policy, _ = receive(config.total_steps)
    distributed.kv_set(f'{_KV}/final_evals', json.dumps([evals(policy)]))
  return {'step': config.total_steps}
