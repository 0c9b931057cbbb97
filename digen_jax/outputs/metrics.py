"""Run outputs: metrics.jsonl (one JSON object per step / eval), TensorBoard scalars, progress logs."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from absl import logging
import numpy as np

from digen_jax.outputs import faults


def _jsonable(v):
  if isinstance(v, (np.generic, np.ndarray)):
    v = v.item() if np.ndim(v) == 0 else np.asarray(v).tolist()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/inf; keep it visible instead of silently dropping it
  return v


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet:
  tensorboardX imports torch only to accept its tensors (we write floats and numpy images), and
  that import costs about 3 s and 300 MB in every training process that has torch installed."""
  block = 'torch' not in sys.modules
  if block:
    sys.modules['torch'] = None  # `import torch` raises ImportError, which tensorboardX expects
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if block:
      del sys.modules['torch']
  return SummaryWriter


SUPERSEDED = 'metrics.superseded.jsonl'


class MetricsWriter:
  """Appends rows to <workdir>/metrics.jsonl and mirrors scalars to TensorBoard.

  resume_step: the step a training run starts from. The rows of earlier runs after it (a step
  redone after a fallback to an older checkpoint or a lost save; with 0, every row: the run
  starts over) move to metrics.superseded.jsonl, and TensorBoard hides their events
  (purge_step), so every step appears once."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, 'metrics.jsonl')
    if resume_step is not None:
      supersede_rows_after(workdir, resume_step)
    self._file = open(self.path, 'a', buffering=1)
    self._tb = None
    if tensorboard:
      # TensorBoard drops the events of earlier files at or after purge_step.
      purge = None if resume_step is None else (resume_step + 1 if resume_step else 0)
      self._tb = _summary_writer_class()(os.path.join(workdir, 'tensorboard'), purge_step=purge)

  def write(self, row: dict[str, Any]):
    row = {k: _jsonable(v) for k, v in row.items()}
    row.setdefault('time', time.time())
    try:
      self._file.write(json.dumps(row) + '\n')
    except OSError as e:  # a full disk: one line, as for a checkpoint's save
      try:
        self._file.close()  # its unwritten row would fail again when collected, with a trace
      except OSError:
        pass
      raise faults.RunError(
          f'writing {self.path} failed: {e.strerror or e}: free space (or fix the cause) and '
          'rerun the same command to resume from the last checkpoint'
      ) from None
    if self._tb is not None:
      step = int(row.get('step', 0))
      for k, v in row.items():
        if k not in ('step', 'time') and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)

  def write_image(self, tag: str, image_hwc_uint8: np.ndarray, step: int):
    if self._tb is not None:
      self._tb.add_image(tag, image_hwc_uint8, step, dataformats='HWC')

  def close(self):
    """Closes metrics.jsonl and the TensorBoard events; a failed write of the events' last
    buffer (a full disk) is a RunError naming the folder, not a traceback."""
    self._file.close()
    if self._tb is not None:
      tb, self._tb = self._tb, None
      try:
        tb.close()
      except OSError as e:
        raise faults.RunError(
            f'writing the TensorBoard events in {tb.logdir} failed: {e.strerror or e}: free '
            'space (or fix the cause) and rerun the same command to resume from the last '
            'checkpoint'
        ) from None


def supersede_rows_after(workdir: str, step: int) -> int:
  """Moves the rows of <workdir>/metrics.jsonl that a run starting at `step` writes again (those
  after it; with step 0 all of them) to metrics.superseded.jsonl. Returns how many moved.

  A row at `step` itself stays when step > 0: its train row describes the restored checkpoint,
  and its eval row, when there is one, is not redone after a resume (runtime/rollout.Evals.due
  redoes only a missing one)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [l if l.endswith('\n') else l + '\n' for l in f if l.strip()]
  keep, moved = [], []
  for line in lines:
    try:
      row_step = json.loads(line).get('step', 0)
    except (ValueError, AttributeError):  # a torn last line of a killed run: not a row
      row_step = None
    (keep if step > 0 and row_step is not None and row_step <= step else moved).append(line)
  if not moved:
    return 0
  with open(os.path.join(workdir, SUPERSEDED), 'a') as f:
    f.writelines(moved)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(keep)
  os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one
  logging.warning(
      'metrics.jsonl: %d row(s) after step %d, written before this run resumed there, moved to %s',
      len(moved),
      step,
      SUPERSEDED,
  )
  return len(moved)


def evaluated_steps(workdir: str) -> set[int]:
  """The policy versions (steps) <workdir>/metrics.jsonl holds an eval row of; a torn line is no
  row."""
  path = os.path.join(workdir, 'metrics.jsonl')
  out = set()
  if not os.path.isfile(path):
    return out
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict) and any(k.startswith('eval/') for k in row):
        out.add(row.get('step'))
  return out


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]


class Progress:
  """Step rate and ETA for the absl log line."""

  def __init__(self, first_step: int, total_steps: int):
    self.first_step, self.total_steps = first_step, total_steps
    self.start = time.perf_counter()

  def log(self, step: int, row: dict[str, Any], keys=('reward_mean', 'loss', 'approx_kl')):
    elapsed = time.perf_counter() - self.start
    done = step - self.first_step
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (self.total_steps - step) / rate if rate > 0 else float('nan')
    shown = ' '.join(f'{k}={row[k]:.4g}' for k in keys if isinstance(row.get(k), (int, float)))
    logging.info(
        'step %d/%d  %.3f steps/s  ETA %.0fs  %s', step, self.total_steps, rate, eta, shown
    )
