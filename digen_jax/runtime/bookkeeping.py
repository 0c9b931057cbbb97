"""The trainer's bookkeeping around its steps, the same in every mode (what a run writes).

Per optimizer step a trainer process writes one metrics.jsonl row (plus the eval rows the
rollout sends), logs progress, stops the run after too many non-finite updates in a row,
checkpoints, and on SIGTERM/SIGINT checkpoints the last completed step; at the end it writes
the trace. `Bookkeeping` does these for the one loop (runtime/loop.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable

from absl import logging
import numpy as np

from digen_jax.outputs import checkpoint as ckpt_lib
from digen_jax.outputs import faults
from digen_jax.process import interrupt
from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import report
from digen_jax.runtime import publish
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import inputs


def _skip_reason(rewards, prompts: list[str] | None) -> str:
  """Why an update was skipped: the samples with non-finite rewards (named by prompt), else
  the loss or gradient."""
  bad = np.flatnonzero(~np.isfinite(np.asarray(rewards, np.float32)))
  if not bad.size:
    return 'non-finite loss, gradient or new weights'
  what = f'{bad.size} non-finite reward(s)'
  if prompts is not None:
    names = list(dict.fromkeys(prompts[i] for i in bad))
    what += ' for prompt(s) ' + ', '.join(repr(p[:80]) for p in names[:3])
    what += f' and {len(names) - 3} more' if len(names) > 3 else ''
  return what + " (the reward's error is in the log of the process that scored them)"


def checkpointer(output, workdir: str, multi_process: bool) -> ckpt_lib.Checkpointer:
  """<workdir>/checkpoints, saved and kept as `output` (the Run's OutputSpec) says; a
  multi-process job saves from this (the trainer) process only."""
  cls = ckpt_lib.ProcessCheckpointer if multi_process else ckpt_lib.Checkpointer
  return cls(
      os.path.join(workdir, 'checkpoints'),
      max_to_keep=output.keep_checkpoints,
      save_every=output.checkpoint_every,
  )


class Bookkeeping:
  """The trainer's bookkeeping over steps [trainer.start, total_steps)."""

  def __init__(self, exp, workdir: str, cluster, tracer: trace_lib.Tracer, trainer):
    self.exp, self.workdir, self.cluster, self.tracer = exp, workdir, cluster, tracer
    self.level = exp.runtime.transfer_guard
    self.trainer = trainer
    self.start, self.total = self.trainer.start, exp.total_steps
    self.rollout_dtype = publish.rollout_param_dtype(cluster)
    self.publish_mb = publish.publish_megabytes(exp.params, self.rollout_dtype)
    # A run that trains evaluates once more at its end, with the policy after the last step.
    self.final_eval = exp.eval.every > 0 and self.start < self.total
    # After the checkpoint restored: a run that stops there (a changed model) keeps the
    # config.json of the run that wrote the checkpoints.
    report.write_config(exp.output.config_json, workdir)
    # Rows after the restored step (a fallback to an older checkpoint, a lost save) are redone.
    self.writer = metrics_lib.MetricsWriter(workdir, resume_step=self.start)
    self.progress = metrics_lib.Progress(self.start, self.total)
    self.published_at: dict[int, float] = {}  # policy version -> wall clock after its publish
    self.max_skips = exp.runtime.max_consecutive_skips
    self.skips: list[str] = []  # why each update of the current run of skips was
    self.ended = (self.start, self.trainer.data_position)  # last step with its row written
    self._at_step_end = False  # an interrupt stopped the run between two steps

  @contextlib.contextmanager
  def stops_cleanly(self):
    """Around a schedule's step loop: a SIGTERM/SIGINT (interrupt.Interrupted) abandons the
    in-flight step (its fragments are regenerated after a resume) and checkpoints the last
    completed one, if it is not on disk yet; the Interrupted that goes on says where."""
    try:
      yield
    except interrupt.Interrupted as e:
      raise self._checkpoint_interrupted(e) from None

  def _checkpoint_interrupted(self, e: interrupt.Interrupted) -> interrupt.Interrupted:
    step, position = self.ended
    ck = self.trainer.checkpointer
    ck.wait()
    if step > 0 and ck.latest_step() != step and self.trainer.params_step == step:
      self.trainer.save(step, position, force=True)
      ck.wait()
    latest = ck.latest_step()
    self.trainer.close()
    self.writer.close()
    where = (
        f'checkpoint step {latest} is in {ck.directory}; rerun the same command to resume'
        if latest
        else 'no step was completed: rerun the same command to start over'
    )
    if not self._at_step_end and step < self.total and self.trainer.params_step == step:
      where = f'step {step + 1} abandoned; ' + where
    return interrupt.Interrupted(e.signum, f'{e} ({where})')

  def publish(
      self, send: Callable[[Any, int], Any], version: int, devices=None
  ) -> tuple[Any, float]:
    """send(params, version) under the transfer guard, as a 'publish' span over `devices`
    (None: no span). Returns (what send returned, seconds)."""
    t = time.perf_counter()
    with inputs.guard(self.level):
      if devices is None:
        out = send(self.trainer.sampling_params, version)
      else:
        with self.tracer.span(devices, 'trainer', 'publish', step=version, version=version):
          out = send(self.trainer.sampling_params, version)
    self.published_at[version] = time.time()
    self.published_at.pop(version - 2, None)
    return out, time.perf_counter() - t

  def write_rows(self, rows) -> None:
    """Eval rows (they carry their own step)."""
    for row in rows:
      self.writer.write(row)

  def end_step(
      self,
      step: int,
      *,
      data_position: int,
      extra: dict | None = None,
      prompts: list[str] | None = None,
      **row_fields,
  ) -> dict:
    """Step `step` is applied (or skipped, if its update was not finite): its metrics row
    (step_row(**row_fields) + extra), progress, checkpoint. `prompts`: one per sample,
    to name the ones with non-finite rewards. Returns the row.

    The runtime.max_consecutive_skips-th skipped update in a row raises NonFiniteError before
    this step is checkpointed: the newest checkpoint keeps the last good weights (a skipped
    step's weights are unchanged, so the steps saved in between are good too)."""
    skipped = row_fields['metrics']['nonfinite'] > 0
    if skipped:
      self.trainer.skipped_updates += 1
      why = _skip_reason(row_fields['rewards'], prompts)
      self.skips.append(f'step {step + 1}: {why}')
      logging.error(
          'step %d: update skipped (weights and optimizer state unchanged): %s; '
          '%d in a row, the run stops at %d (config.runtime.max_consecutive_skips)',
          step + 1,
          why,
          len(self.skips),
          self.max_skips,
      )
    else:
      self.skips = []
    row = step_row(step=step + 1, cluster=self.cluster, publish_mb=self.publish_mb, **row_fields)
    row['skipped_updates'] = self.trainer.skipped_updates
    row.update(extra or {})
    # The previous step's asynchronous save must have committed before this row is written: a
    # failed save stops the run here, with its step's row the last one, not some steps later.
    self._storage(self.trainer.checkpointer.wait)
    self.writer.write(row)
    if (step + 1) % self.exp.output.log_every == 0 or step + 1 == self.total:
      self.progress.log(step + 1, row)
    if len(self.skips) >= self.max_skips:
      self.trainer.checkpointer.wait()
      last = self.trainer.checkpointer.latest_step()
      self.writer.close()
      raise faults.NonFiniteError(
          f'{len(self.skips)} consecutive updates skipped for non-finite values '
          f'({"; ".join(self.skips)}); the last checkpoint (step {last or 0}) holds the last '
          'good weights. Fix the reward, or lower config.optim.lr, then rerun to resume (or '
          'raise config.runtime.max_consecutive_skips)'
      )
    stop = interrupt.requested() is not None and step + 1 < self.total
    self._storage(self.trainer.save, step + 1, data_position, force=step + 1 == self.total or stop)
    self.ended = (step + 1, data_position)
    if stop:
      self._at_step_end = True
      interrupt.check(f'after step {step + 1} of {self.total}')
    return row

  def _storage(self, fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs), a checkpoint operation; on its CheckpointError the writer and the
    checkpointer close before it goes on (no save thread outlives the run's last line)."""
    try:
      fn(*args, **kwargs)
    except faults.CheckpointError:
      try:
        self.writer.close()
      except faults.RunError:
        pass  # its events' last write met the same storage (a full disk): one line, the save's
      try:
        self.trainer.close()
      except faults.CheckpointError:
        pass  # the same failure, already being raised
      raise

  def finish(self, title: str, **extra) -> dict:
    """Writes the trace (if config.schedule.trace), closes the checkpointer and the metrics
    writer. Returns {'params', 'opt_state', 'step', **extra}."""
    self.tracer.write(self.workdir, title=title)
    self.trainer.close()
    self.writer.close()
    return {
        'params': self.trainer.params,
        'opt_state': self.trainer.opt_state,
        'step': self.total,
        **extra,
    }


def step_row(
    *,
    step: int,
    policy_version: int,
    rewards: np.ndarray,
    valid_frac: float,
    metrics: dict,
    wall_s: float,
    rollout_s: float,
    reward_s: float,
    update_s: float,
    publish_s: float,
    publish_mb: float,
    batch_move_s: float,
    cluster,
    utilization: float | None = None,
) -> dict:
  """The metrics.jsonl row of one optimizer step.

  utilization = busy device-seconds / (devices x wall seconds): given from the trace spans
  (runtime/trace.py), else estimated as rollout devices busy while sampling, trainer devices
  while updating (host reward scoring and transfers count as idle)."""
  busy = cluster.rollout.size * rollout_s + cluster.trainer.size * update_s
  if utilization is None:
    utilization = busy / (cluster.num_devices * wall_s)
  batch = int(np.size(rewards))
  rewards = np.asarray(rewards, np.float32)
  finite = rewards[np.isfinite(rewards)]  # a faulty reward's NaN must not hide the others
  return {
      'step': step,
      'policy_version': policy_version,
      'reward_mean': float(np.mean(finite)) if finite.size else float('nan'),
      'reward_std': float(np.std(finite)) if finite.size else float('nan'),
      'nonfinite_rewards': batch - int(finite.size),
      'samples': batch,
      'samples_per_s': batch / wall_s,
      'wall_s': wall_s,
      'rollout_s': rollout_s,
      'reward_s': reward_s,
      'update_s': update_s,
      'publish_s': publish_s,
      'publish_mb': publish_mb,
      'batch_move_s': batch_move_s,
      'utilization': min(1.0, utilization),
      'valid_frac': valid_frac,
      **metrics,
  }


def reward_part_metrics(names: list[str], parts: np.ndarray | None) -> dict:
  """Each reward's own 'reward/<name>_mean' and '_std' over its finite scores of the step, when
  several rewards are combined (parts [K, B] in `names`' order, K >= 2; reward_mean is their
  weighted combination); {} for one reward. A failed score (NaN) is left out, as in reward_mean."""
  if parts is None or len(parts) < 2:
    return {}
  out = {}
  for name, row in zip(names, np.asarray(parts, np.float32)):
    finite = row[np.isfinite(row)]
    out[f'reward/{name}_mean'] = float(np.mean(finite)) if finite.size else float('nan')
    out[f'reward/{name}_std'] = float(np.std(finite)) if finite.size else float('nan')
  return out
