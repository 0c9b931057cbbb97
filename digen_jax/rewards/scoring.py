"""A run's rewards as its config declares them (config.reward): where each one runs, how they
combine, and the scores of a batch as the runtime asks for them.

Each name in reward.weights runs in one of three places:
  in-process  pure-code rewards of the registry and the user's callables (rewards/registry.py),
              scored when the batch is submitted, faults guarded as before (NaN, named);
  workers     learned models (rewards/learned.py) and the names in reward.in_workers: N worker
              processes (reward.workers) started by the run, each holding every such model on
              its device (reward.worker_devices), fed batches of reward.batch_size samples as
              fragments finish (rewards/workers.py);
  remote      reward.remote's 'name=URL': a user's HTTP scorer (rewards/remote.py), reward.workers
              requests at a time, the same timeouts and retries.

`Rewards.submit(images, prompts)` returns at once a `PendingScores`; its `result()` is `Scores`:
the K rewards' parts [K, B] (NaN where that sample's reward failed), the weighted total [B] (NaN
where any part failed), and what scoring cost. `Rewards(images, prompts)` is the synchronous
total (evaluation, TAG).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from absl import logging
import numpy as np

from digen_jax.rewards import learned
from digen_jax.rewards import registry
from digen_jax.rewards import remote
from digen_jax.rewards import workers

FAILED_MODES = ('mask', 'skip')
# A score beyond this magnitude counts as failed (NaN, named in the log), like a non-finite one:
# the update's float32 group statistics square the scores and sum them over a batch, which
# overflows to inf from ~1.8e19 (sqrt of float32's max), so nothing would be learned. 1e15 leaves
# room for a million samples' squares.
SCORE_LIMIT = 1e15
COMBINE_MODES = ('sum', 'advantages')  # rl/advantages.py's, checked here before anything starts


@dataclasses.dataclass
class Scores:
  total: np.ndarray  # [B] float32: sum_k w_k parts[k]; NaN where any reward failed
  parts: np.ndarray  # [K, B] float32 in Rewards.names' order
  wall_s: float  # from submit until the last score was in
  compute_s: float  # seconds spent scoring (workers' and in-process), summed
  retries: int
  faults: list

  @property
  def failed(self) -> int:
    return int(np.sum(~np.isfinite(self.total)))


def parse_pairs(spec: str, field: str) -> dict[str, str]:
  """'name=value,...' -> {name: value}."""
  out = {}
  for part in (p.strip() for p in (spec or '').split(',')):
    if not part:
      continue
    name, sep, value = (x.strip() for x in part.partition('='))
    if not sep or not name or not value:
      raise ValueError(f'{field}: {part!r} is not NAME=VALUE')
    out[name] = value
  return out


def names_in(spec: str) -> list[str]:
  """The names of a comma-separated list (reward.in_workers)."""
  return [n.strip() for n in (spec or '').split(',') if n.strip()]


def split_callables(r) -> tuple[str, str]:
  """config.reward.callables as (the in-process ones, the ones in reward.in_workers): a worker's
  callable is imported by the workers only (it may import torch), never here."""
  in_workers = set(names_in(r.in_workers))
  parts = [p.strip() for p in (r.callables or '').split(',') if p.strip()]
  is_worker = lambda p: p.partition('=')[0].strip() in in_workers
  return (
      ','.join(p for p in parts if not is_worker(p)),
      ','.join(p for p in parts if is_worker(p)),
  )


def where_each(r, weights) -> dict[str, str]:
  """{name: 'host' | 'workers' | 'remote'} of reward.weights' names; ValueError naming the field
  for an unknown name or a setting that does not fit (before anything starts). The in-process
  callables must be registered already (registry.register_callables; validation does)."""
  remote_urls = parse_pairs(r.remote, 'config.reward.remote')
  models = parse_pairs(r.models, 'config.reward.models')
  in_workers = names_in(r.in_workers)
  worker_callables = parse_pairs(split_callables(r)[1], 'config.reward.callables')
  known = (
      set(registry.registered_names())
      | set(learned.LOADERS)
      | set(remote_urls)
      | set(worker_callables)
  )
  for field, names in (
      ('config.reward.weights', list(weights)),
      ('config.reward.in_workers', in_workers),
      ('config.reward.models', list(models)),
  ):
    unknown = [n for n in names if n not in known]
    if unknown:
      raise ValueError(
          f'{field}: unknown reward(s) {unknown}; registered: {registry.registered_names()}, '
          f'learned (in workers): {sorted(learned.LOADERS)}, remote: {sorted(remote_urls)}'
      )
  for n, w in weights.items():
    if not np.isfinite(w):
      raise ValueError(
          f'config.reward.weights: weight for reward {n!r} must be a finite number; got {w}'
      )
  for n in weights:
    if n in learned.NEEDS_FOLDER and n not in models:
      raise ValueError(
          f'config.reward.weights names {n!r}, a learned reward: give its local weights folder '
          f'as --config.reward.models={n}=/path/to/folder (nothing is downloaded)'
      )
  if r.failed not in FAILED_MODES:
    raise ValueError(f'config.reward.failed={r.failed!r}: use one of {FAILED_MODES}')
  if r.combine not in COMBINE_MODES:
    raise ValueError(f'config.reward.combine={r.combine!r}: use one of {COMBINE_MODES}')
  for field in ('workers', 'batch_size'):
    if int(r[field]) < 1:
      raise ValueError(f'config.reward.{field}={r[field]} must be >= 1')
  for field in ('retries', 'max_restarts'):
    if int(r[field]) < 0:
      raise ValueError(f'config.reward.{field}={r[field]} must be >= 0')
  return placement(r, weights)


def placement(r, weights) -> dict[str, str]:
  """{name: 'host' | 'workers' | 'remote'} of the names of `weights` (config.reward.weights
  parsed), unchecked (the planner's view; where_each checks the names first)."""
  remote_urls = parse_pairs(r.remote, 'config.reward.remote')
  in_workers = names_in(r.in_workers)
  out = {}
  for n in weights:
    if n in remote_urls:
      out[n] = 'remote'
    elif learned.is_learned(n) or n in in_workers:
      out[n] = 'workers'
    else:
      out[n] = 'host'
  return out


def to_uint8(images: np.ndarray) -> np.ndarray:
  """float in [-1, 1] (NaN-safe) -> uint8 as the PNGs are written; uint8 as it is."""
  images = np.asarray(images)
  if images.dtype == np.uint8:
    return images
  x = np.nan_to_num(images.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
  return np.clip((x + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)


class PendingScores:

  def __init__(self, rewards: 'Rewards', host: dict, host_s: float, pools: list, t0: float):
    self._rewards, self._host, self._host_s, self._pools, self._t0 = (
        rewards,
        host,
        host_s,
        pools,
        t0,
    )

  def done(self) -> bool:
    return all(p.done() for _, p in self._pools)

  def result(self) -> Scores:
    r = self._rewards
    n = len(next(iter(self._host.values()))) if self._host else None
    parts, compute_s, retries, lines, t_done = {}, self._host_s, 0, [], self._t0 + self._host_s
    for pool, pending in self._pools:
      got, info = pending.result()
      parts.update(zip(pool.names, got))
      compute_s += info['compute_s']
      retries += info['retries']
      lines += info['faults']
      t_done = max(t_done, pending.t_done or time.perf_counter())
      n = got.shape[1]
    if lines:  # one line a batch (the in-process rewards' faults are logged by their guard)
      logging.error('%s', registry.fault_summary(lines, n or 0))
    parts.update(self._host)
    stack = np.stack([parts[k] for k in r.names]).astype(np.float32)
    huge = np.isfinite(stack) & (np.abs(stack) > SCORE_LIMIT)
    if huge.any():  # finite, but past what the update's statistics can hold
      k, i = np.argwhere(huge)[0]
      line = (
          f'{int(huge.sum())} scores beyond +-{SCORE_LIMIT:g} (the first: reward '
          f'{r.names[k]!r} scored {float(stack[k, i]):.3g} on sample {i}); they count as failed '
          '(float32 group statistics would overflow)'
      )
      logging.error('%s', line)
      lines.append(line)
      stack = np.where(huge, np.nan, stack)
    w = np.asarray([r.weights[k] for k in r.names], np.float32)[:, None]
    total = np.sum(w * np.nan_to_num(stack), axis=0).astype(np.float32)
    total[~np.all(np.isfinite(stack), axis=0)] = np.nan
    total[np.abs(total) > SCORE_LIMIT] = np.nan  # weights can carry a sum past it too
    del n
    return Scores(total, stack, t_done - self._t0, compute_s, retries, lines)


class Rewards:
  """The run's rewards (module docstring): start() the workers, submit() batches, close()."""

  def __init__(self, r, weights):
    """r: config.reward, weights: its weights parsed ({name: weight}; both checked by
    where_each; the registry holds the user's callables)."""
    self.config = r
    registry.register_callables(split_callables(r)[0])  # idempotent (validation did)
    self.weights = dict(weights)
    self.names = list(self.weights)
    self.where = where_each(r, self.weights)
    self.failed_mode = r.failed
    self._host = {
        n: registry.guarded(
            functools.partial(registry.call_reward, n), r.timeout_s, on_failure=r.failed
        )
        for n, at in self.where.items()
        if at == 'host'
    }
    self.pools: list[workers.Pool] = []

  def start(self) -> None:
    """Starts the worker processes and checks the remote scorers (LoadError: one line)."""
    r = self.config
    kw = dict(
        batch_size=r.batch_size,
        timeout_s=r.timeout_s,
        retries=r.retries,
        max_restarts=r.max_restarts,
    )
    in_workers = [n for n, at in self.where.items() if at == 'workers']
    if in_workers:
      devices = [d.strip() for d in (r.worker_devices or 'cpu').split(',') if d.strip()]
      spec = dict(
          rewards=in_workers,
          # The modules that registered them here (a task's): the worker imports them.
          modules=registry.defined_in(in_workers),
          callables=split_callables(r)[1],
          models=parse_pairs(r.models, 'config.reward.models'),
      )
      backends = [
          workers.WorkerProcess(i, dict(spec, device=devices[i % len(devices)]), r.start_timeout_s)
          for i in range(int(r.workers))
      ]
      self.pools.append(workers.Pool(backends, in_workers, **kw))
    for name, url in parse_pairs(r.remote, 'config.reward.remote').items():
      if name in self.where:
        backends = [remote.HttpScorer(i, name, url) for i in range(int(r.workers))]
        self.pools.append(workers.Pool(backends, [name], **kw))
    try:
      for pool in self.pools:
        pool.start()
    except workers.LoadError:
      self.close()
      raise

  def submit(self, images: np.ndarray, prompts) -> PendingScores:
    t0 = time.perf_counter()
    prompts = list(prompts)
    pools = []
    if self.pools:
      u8 = to_uint8(images)
      pools = [(pool, pool.submit(u8, prompts)) for pool in self.pools]
    host = {n: np.asarray(fn(images, prompts), np.float32) for n, fn in self._host.items()}
    return PendingScores(self, host, time.perf_counter() - t0, pools, t0)

  def __call__(self, images: np.ndarray, prompts) -> np.ndarray:
    return self.submit(images, prompts).result().total

  def components(self, images: np.ndarray, prompts) -> dict[str, np.ndarray]:
    s = self.submit(images, prompts).result()
    return dict(zip(self.names, s.parts))

  def probe(self, prompts, size: int = 64, frames: int = 0) -> None:
    """Scores 2 mid-grey images with the run's first prompts: a reward that returns the wrong
    shape or raises there (it cannot score the run's prompts: e.g. a task's reward on other
    prompts) is a ValueError now, in one line, before anything compiles. A NaN score is not:
    a grey image may have none, and a NaN is masked at run time (config.reward.failed); a
    probe that times out is the guard's, per call (a first call may load a model)."""
    prompts = (list(prompts) * 2)[:2]
    shape = (2, frames, size, size, 3) if frames else (2, size, size, 3)  # frames: a video run
    images = np.full(shape, 128, np.uint8)
    what = f'2 grey videos of {frames} frames' if frames else '2 grey images'
    fail = lambda why: ValueError(
        f'config.reward.weights={self.config.weights!r}: a probe batch ({what} with '
        f"the run's first prompts) failed before training: {why}"
    )
    x = images.astype(np.float32) / np.float32(127.5) - 1
    for name in self._host:
      try:
        registry.call_within(self.config.timeout_s, registry.call_reward, name, x, prompts)
      except registry.RewardShapeError as e:
        raise fail(e) from None
      except registry.NonFiniteScores:
        logging.warning(
            "reward %r scores NaN on the probe's grey images (masked at run time)", name
        )
      except registry.RewardTimeout:
        logging.warning(
            'reward %r: the probe timed out; the run goes on (its guard times calls)', name
        )
      except Exception as e:  # pylint: disable=broad-except  (user code: any error is the finding)
        raise fail(
            f'reward {name!r} raised {type(e).__name__}: {" ".join(str(e).split())[:300]}'
        ) from None
    for pool in self.pools:
      got, info = pool.submit(images, prompts).result()
      if info['faults']:
        raise fail(info['faults'][0])
      bad = [n for n, row in zip(pool.names, got) if not np.all(np.isfinite(row))]
      if bad:
        logging.warning("rewards %s score NaN on the probe's grey images (masked at run time)", bad)

  def close(self) -> None:
    for pool in self.pools:
      pool.close()


def build(r, weights) -> Rewards:
  """The run's Rewards from config.reward and its parsed weights ({name: weight}), its workers
  started (LoadError -> ValueError)."""
  rewards = Rewards(r, weights)
  try:
    rewards.start()
  except workers.LoadError as e:
    raise ValueError(f'{e} (config.reward)') from None
  return rewards


def submit(fn, images, prompts):
  """fn.submit(images, prompts) for a Rewards; a plain reward function (a test's) scored now."""
  if hasattr(fn, 'submit'):
    return fn.submit(images, prompts)
  t0 = time.perf_counter()
  total = np.asarray(fn(images, list(prompts)), np.float32)
  dt = time.perf_counter() - t0
  return _Done(Scores(total, total[None], dt, dt, 0, []))


class _Done:

  def __init__(self, scores: Scores):
    self.scores = scores

  def done(self) -> bool:
    return True

  def result(self) -> Scores:
    return self.scores
