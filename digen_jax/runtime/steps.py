"""The trainer's step skeleton, the same in every schedule (DESIGN.md §4).

Around the schedule's own work a trainer process does the same things in every mode: build
the trainer state (resumed from <workdir>/checkpoints), publish each policy (timed, under the
transfer guard, optionally as a trace span), write one metrics.jsonl row per optimizer step
plus the eval rows, log progress, checkpoint, collect the final eval, and write the trace.
`TrainerRun` does these once; runtime/synchronous.py, runtime/disagg.py and
runtime/pipeline.py only decide what happens inside a step.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from absl import logging

from digen_jax import checkpoint as ckpt_lib
from digen_jax import metrics as metrics_lib
from digen_jax.runtime import publish
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import workers


def checkpointer(config, workdir: str, multi_process: bool) -> ckpt_lib.Checkpointer:
  """<workdir>/checkpoints; a multi-process job saves from this (the trainer) process only."""
  cls = ckpt_lib.ProcessCheckpointer if multi_process else ckpt_lib.Checkpointer
  return cls(os.path.join(workdir, 'checkpoints'), max_to_keep=config.keep_checkpoints,
             save_every=config.checkpoint_every)


class TrainerRun:
  """The trainer role's state and bookkeeping over steps [start, total_steps)."""

  def __init__(self, exp, workdir: str, cluster, tracer: trace_lib.Tracer):
    config = exp.config
    self.exp, self.workdir, self.cluster, self.tracer = exp, workdir, cluster, tracer
    self.level = config.runtime.transfer_guard
    self.trainer = workers.TrainerWorker(
        exp, cluster.trainer.mesh, checkpointer(config, workdir, cluster.multi_process),
        self.level)
    self.start, self.total = self.trainer.start, config.total_steps
    self.rollout_dtype = publish.rollout_param_dtype(cluster)
    self.publish_mb = publish.publish_megabytes(exp.params, self.rollout_dtype)
    # A run that trains evaluates once more at its end, with the policy after the last step.
    self.final_eval = config.eval.every > 0 and self.start < self.total
    self.writer = metrics_lib.MetricsWriter(workdir)
    self.progress = metrics_lib.Progress(self.start, self.total)
    self.published_at: dict[int, float] = {}   # policy version -> wall clock after its publish

  def publish(self, send: Callable[[Any, int], Any], version: int,
              devices=None) -> tuple[Any, float]:
    """send(params, version) under the transfer guard, as a 'publish' span over `devices`
    (None: no span). Returns (what send returned, seconds)."""
    t = time.perf_counter()
    with workers.guard(self.level):
      if devices is None:
        out = send(self.trainer.params, version)
      else:
        with self.tracer.span(devices, 'trainer', 'publish', step=version, version=version):
          out = send(self.trainer.params, version)
    self.published_at[version] = time.time()
    self.published_at.pop(version - 2, None)
    return out, time.perf_counter() - t

  def write_rows(self, rows) -> None:
    """Eval rows (they carry their own step)."""
    for row in rows:
      self.writer.write(row)

  def end_step(self, step: int, *, data_position: int, extra: dict | None = None,
               **row_fields) -> dict:
    """Step `step` is applied: its metrics row (workers.step_row(**row_fields) + extra),
    progress, checkpoint. Returns the row."""
    if row_fields['metrics']['nonfinite'] > 0:
      logging.error('step %d: non-finite loss/gradient; the update was skipped (weights '
                    'unchanged)', step + 1)
    row = workers.step_row(step=step + 1, cluster=self.cluster, publish_mb=self.publish_mb,
                           **row_fields)
    row.update(extra or {})
    self.writer.write(row)
    if (step + 1) % self.exp.config.log_every == 0 or step + 1 == self.total:
      self.progress.log(step + 1, row)
    self.trainer.save(step + 1, data_position, force=step + 1 == self.total)
    return row

  def finish(self, title: str, **extra) -> dict:
    """Writes the trace (if config.schedule.trace), closes the checkpointer and the metrics
    writer. Returns {'params', 'opt_state', 'step', **extra}."""
    self.tracer.write(self.workdir, title=title)
    self.trainer.close()
    self.writer.close()
    return {'params': self.trainer.params, 'opt_state': self.trainer.opt_state,
            'step': self.total, **extra}
