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


class MetricsWriter:
  """Appends rows to <workdir>/metrics.jsonl and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._file = open(self.path, 'a', buffering=1)
    self._tb = None
    if tensorboard:
      self._tb = _summary_writer_class()(os.path.join(workdir, 'tensorboard'))

  def write(self, row: dict[str, Any]):
    row = {k: _jsonable(v) for k, v in row.items()}
    row.setdefault('time', time.time())
    self._file.write(json.dumps(row) + '\n')
    if self._tb is not None:
      step = int(row.get('step', 0))
      for k, v in row.items():
        if k not in ('step', 'time') and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)

  def write_image(self, tag: str, image_hwc_uint8: np.ndarray, step: int):
    if self._tb is not None:
      self._tb.add_image(tag, image_hwc_uint8, step, dataformats='HWC')

  def close(self):
    self._file.close()
    if self._tb is not None:
      self._tb.close()


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
