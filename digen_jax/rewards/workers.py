"""Reward worker pools: batches of samples scored by N backends (worker processes, or a user's
HTTP scorer: rewards/remote.py) beside the rollout, bounded and fault-tolerant.

`Pool.submit(uint8 images, prompts)` cuts the samples into batches of `batch_size`, queues them
and returns at once a `Pending`; one thread per backend takes batches off the queue, so N
backends score N batches at a time while the rollout samples on. Per batch:

  - no answer within timeout_s: the backend is hung; it is restarted (a process killed and
    started again) and the batch retried, up to `retries` more times;
  - the backend died (a process that exited, a refused connection): likewise;
  - the reward failed on some samples (it raised, or scored NaN): those samples' scores are NaN
    (a failed reward: the run masks them out of their groups; rl/advantages.py), no retry;
  - the reward returned the wrong shape: the whole batch fails (NaN), no retry.
A batch still failing after its retries is NaN too. A backend that fails max_restarts times in a
row (no batch scored in between) stops the run: `Pending.result` raises RewardWorkerError, one
line naming the worker, what happened and the field to change.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from multiprocessing import connection

from absl import logging
import numpy as np

from digen_jax.outputs import faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RewardWorkerError(faults.RunError):
  """A reward worker cannot go on (it keeps dying or hanging): the run stops."""


class LoadError(ValueError):
  """A backend could not start (its weights do not load, its URL does not answer)."""


class Hung(Exception):
  pass


class Died(Exception):
  pass


class BatchFailed(Exception):
  pass


class WorkerProcess:
  """One worker process (rewards/worker.py) serving spec['rewards'] on spec['device']."""

  def __init__(self, index: int, spec: dict, start_timeout_s: float):
    self.index, self.spec, self.start_timeout_s = index, spec, start_timeout_s
    self.label = f'reward worker {index} ({",".join(spec["rewards"])} on {spec["device"]})'
    self.proc = None
    self._tail: collections.deque = collections.deque(maxlen=8)

  def start(self) -> None:
    r_req, w_req = os.pipe()
    r_rep, w_rep = os.pipe()
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH', '')) if p)
    env.setdefault('OMP_NUM_THREADS', '1')
    args = [sys.executable, '-m', 'digen_jax.rewards.worker', str(r_req), str(w_rep)]
    self.proc = subprocess.Popen(
        args + [json.dumps(self.spec)],
        pass_fds=(r_req, w_rep),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    os.close(r_req)
    os.close(w_rep)
    self._out = connection.Connection(w_req, readable=False)
    self._in = connection.Connection(r_rep, writable=False)
    self._tail.clear()
    threading.Thread(target=self._read_stderr, args=(self.proc,), daemon=True).start()
    if not self._in.poll(self.start_timeout_s):
      self.kill()
      raise LoadError(
          f'{self.label} did not load within {self.start_timeout_s:g} s '
          '(config.reward.start_timeout_s)'
      )
    try:
      msg = self._in.recv()
    except (EOFError, OSError):
      raise LoadError(f'{self.label} exited while loading: {self.why_dead()}') from None
    if msg[0] == 'error':
      self.kill()
      raise LoadError(f'{self.label} cannot load: {msg[1]}')
    logging.info('%s ready in %.1f s', self.label, msg[1]['load_s'])

  def _read_stderr(self, proc) -> None:
    for line in iter(proc.stderr.readline, b''):
      self._tail.append(line.decode('utf-8', 'replace').rstrip())

  def why_dead(self) -> str:
    code = self.proc.wait(timeout=5) if self.proc is not None else None
    time.sleep(0.05)  # the stderr reader's last lines
    tail = ' | '.join(x for x in list(self._tail)[-3:] if x.strip())
    return f'exit code {code}' + (f' ({tail[-300:]})' if tail else '')

  def score(self, batch_id: int, images, prompts, timeout_s: float):
    try:
      self._out.send(('score', batch_id, images, list(prompts)))
      if not self._in.poll(timeout_s if timeout_s > 0 else None):
        raise Hung(f'no answer within {timeout_s:g} s (config.reward.timeout_s)')
      msg = self._in.recv()
    except (EOFError, OSError, BrokenPipeError):
      raise Died(f'exited ({self.why_dead()})') from None
    if msg[0] == 'failed':
      raise BatchFailed(msg[2])
    _, _, parts, compute_s, lines = msg
    return parts, compute_s, lines

  def kill(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()

  def restart(self) -> None:
    self.kill()
    for c in (self._out, self._in):
      c.close()
    self.start()

  def close(self) -> None:
    if self.proc is None or self.proc.poll() is not None:
      return
    try:
      self._out.send(('stop',))
      self.proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
      self.kill()


@dataclasses.dataclass
class _Job:
  pending: 'Pending'
  lo: int
  hi: int
  tries: int = 0


class Pending:
  """The scores of one submit: result() -> (parts [K, B] float32, NaN where failed; info)."""

  def __init__(self, pool: 'Pool', k: int, n: int, jobs: int):
    self._pool, self._cv = pool, threading.Condition()
    self.parts = np.full((k, n), np.nan, np.float32)
    self._left = jobs
    self.info = {'retries': 0, 'compute_s': 0.0, 'faults': []}
    self.t_submit = time.perf_counter()
    self.t_done = self.t_submit if not jobs else None

  def fill(self, lo, hi, parts=None, compute_s=0.0, lines=()) -> None:
    with self._cv:
      if parts is not None:
        self.parts[:, lo:hi] = parts
      self.info['compute_s'] += compute_s
      self.info['faults'] += list(lines)
      self._left -= 1
      if not self._left:
        self.t_done = time.perf_counter()
      self._cv.notify_all()

  def wake(self) -> None:
    with self._cv:
      self._cv.notify_all()

  def done(self) -> bool:
    return not self._left or self._pool.fatal is not None

  def result(self) -> tuple[np.ndarray, dict]:
    with self._cv:
      while self._left and self._pool.fatal is None:
        self._cv.wait(0.5)
    self._pool.forget(self)
    if self._pool.fatal is not None:
      raise RewardWorkerError(self._pool.fatal)
    return self.parts, self.info


class Pool:
  """N backends (WorkerProcess, remote.HttpScorer) scoring the K rewards `names` in batches."""

  def __init__(self, backends, names, *, batch_size, timeout_s, retries, max_restarts):
    self.backends, self.names = list(backends), list(names)
    self.batch_size, self.timeout_s = int(batch_size), float(timeout_s)
    self.retries, self.max_restarts = int(retries), int(max_restarts)
    self.fatal: str | None = None
    self.restarts = 0
    self._queue: queue.Queue = queue.Queue()
    self._threads: list[threading.Thread] = []
    self._closed = False
    self._waiting: set = set()

  def start(self) -> None:
    """Starts every backend (in parallel); a backend that cannot start: LoadError, one line,
    after every started one is closed again."""
    errors = []

    def start(b):
      try:
        b.start()
      except LoadError as e:
        errors.append(str(e))

    starters = [threading.Thread(target=start, args=(b,)) for b in self.backends]
    for t in starters:
      t.start()
    for t in starters:
      t.join()
    if errors:
      self.close()
      raise LoadError(errors[0])
    for b in self.backends:
      t = threading.Thread(target=self._serve, args=(b,), name=b.label, daemon=True)
      t.start()
      self._threads.append(t)
    atexit.register(self.close)

  def submit(self, images: np.ndarray, prompts) -> Pending:
    n = len(prompts)
    cuts = list(range(0, n, self.batch_size))
    pending = Pending(self, len(self.names), n, len(cuts))
    pending.images, pending.prompts = images, list(prompts)
    self._waiting.add(pending)
    for lo in cuts:
      self._queue.put(_Job(pending, lo, min(lo + self.batch_size, n)))
    return pending

  def _serve(self, backend) -> None:
    in_a_row = 0
    while not self._closed:
      try:
        job = self._queue.get(timeout=0.5)
      except queue.Empty:
        continue
      p = job.pending
      try:
        parts, compute_s, lines = backend.score(
            id(job), p.images[job.lo : job.hi], p.prompts[job.lo : job.hi], self.timeout_s
        )
        in_a_row = 0
        p.fill(job.lo, job.hi, parts, compute_s, lines)
      except BatchFailed as e:
        in_a_row = 0
        p.fill(job.lo, job.hi, lines=[f'{backend.label}: {e}'])
      except (Hung, Died) as e:
        in_a_row += 1
        if not self._recover(backend, job, e, in_a_row):
          return
      except Exception as e:  # pylint: disable=broad-except  (e.g. http.client.IncompleteRead)
        # Anything else a backend raises is handled as its death: this thread must go on, or
        # the batch would never be filled in and the run would wait for it forever.
        in_a_row += 1
        if not self._recover(backend, job, Died(f'{type(e).__name__}: {e}'), in_a_row):
          return

  def _recover(self, backend, job: _Job, e: Exception, in_a_row: int) -> bool:
    """After a hang or death: restart the backend and retry the batch (or give it up as failed);
    False when the run must stop (self.fatal set)."""
    what = f'{backend.label} {"hung" if isinstance(e, Hung) else "died"}: {e}'
    if in_a_row > self.max_restarts:
      self._stop(
          f'{what}; it failed {in_a_row} times in a row (config.reward.max_restarts='
          f'{self.max_restarts}): fix the reward or raise config.reward.timeout_s / max_restarts'
      )
      return False
    logging.warning('%s; restarting it (%d in a row)', what, in_a_row)
    self.restarts += 1
    try:
      backend.restart()
    except LoadError as le:
      self._stop(f'{what}, and could not be restarted: {le}')
      return False
    job.tries += 1
    job.pending.info['retries'] += 1
    if job.tries > self.retries:
      line = f'{what}; batch given up after {job.tries} tries (config.reward.retries)'
      logging.error('%s: its %d samples are masked out', line, job.hi - job.lo)
      job.pending.fill(job.lo, job.hi, lines=[line])
    else:
      self._queue.put(job)
    return True

  def _stop(self, message: str) -> None:
    logging.error('%s', message)
    self.fatal = message
    for p in list(self._waiting):
      p.wake()

  def forget(self, pending: Pending) -> None:
    self._waiting.discard(pending)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for b in self.backends:
      try:
        b.close()
      except Exception:  # pylint: disable=broad-except  (closing at exit)
        pass
