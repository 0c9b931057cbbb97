"""A reward worker process: loads the rewards it serves once, then scores batches until its
parent closes the pipe (python -m digen_jax.rewards.worker; started by rewards/workers.py, never
by hand).

Messages (multiprocessing.connection over two inherited pipe fds, so a model's prints on stdout
cannot corrupt them):
  worker -> parent  ('ready', {'names': [...], 'load_s': s})  or  ('error', 'one line')
  parent -> worker  ('score', batch_id, uint8 images [b, ...], prompts)  or  ('stop',)
  worker -> parent  ('scores', batch_id, float32 [K, b] (NaN: that sample's reward failed),
                     compute_s, [fault lines])  or  ('failed', batch_id, 'one line')

A reward that raises on a batch is retried one sample at a time: the samples that raise (or
score non-finite) are NaN, the others keep their scores. A reward that returns the wrong shape
fails the whole batch ('failed'): a bug, which the run's probe batch reports before compiling.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from multiprocessing import connection

import numpy as np

from digen_jax.rewards import learned
from digen_jax.rewards import registry


def short(e: BaseException, limit: int = 300) -> str:
  text = f'{type(e).__name__}: ' + ' '.join(str(e).split())
  return text if len(text) <= limit else text[: limit - 3] + '...'


def load(spec: dict) -> dict:
  """{name: fn(uint8 images, prompts) -> [b]} of spec['rewards'] (learned loaders, or registered
  rewards and the user's callables in the registry's float contract). spec['modules']: the
  modules whose import registers the rewards (a task's, which the core does not import)."""
  for module in spec.get('modules', ()):
    importlib.import_module(module)
  if spec.get('callables'):
    registry.register_callables(spec['callables'])
  fns = {}
  for name in spec['rewards']:
    if learned.is_learned(name):
      fns[name] = learned.load(
          name, spec.get('models', {}).get(name, ''), spec.get('device', 'cpu')
      )
    else:
      registry.get_reward(name)  # unknown: a clear error now

      def fn(images, prompts, _name=name):
        x = images.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
        return registry.call_reward(_name, x, prompts)

      fns[name] = fn
  return fns


class BadShape(ValueError):
  pass


def _one(fn, name: str, images, prompts) -> np.ndarray:
  try:
    out = np.asarray(fn(images, list(prompts)), np.float32)
  except registry.RewardShapeError as e:  # the registry's own check of a registered reward
    raise BadShape(str(e)) from None
  if out.shape != (len(prompts),):
    raise BadShape(f'reward {name!r} returned shape {out.shape}; expected ({len(prompts)},)')
  return out


def score(fns: dict, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, list[str]]:
  """([K, b] float32 with NaN for the samples a reward failed on, the fault lines)."""
  parts = np.full((len(fns), len(prompts)), np.nan, np.float32)
  faults = []
  for k, (name, fn) in enumerate(fns.items()):
    try:
      out = _one(fn, name, images, prompts)
      if np.all(np.isfinite(out)):
        parts[k] = out
        continue
    except BadShape:
      raise
    except Exception:  # pylint: disable=broad-except  (model code: find the samples)
      pass
    for i in range(len(prompts)):
      try:
        one = _one(fn, name, images[i : i + 1], prompts[i : i + 1])
        if not np.isfinite(one[0]):
          raise ValueError(f'non-finite score {one[0]}')
        parts[k, i] = one[0]
      except BadShape:
        raise
      except Exception as e:  # pylint: disable=broad-except
        faults.append(f'reward {name!r} failed on prompt {prompts[i][:120]!r}: {short(e)}')
  return parts, faults


def serve(conn_in, conn_out, spec: dict) -> int:
  t = time.perf_counter()
  try:
    fns = load(spec)
  except BaseException as e:  # pylint: disable=broad-except  (reported to the parent)
    conn_out.send(('error', short(e)))
    return 1
  conn_out.send(('ready', {'names': list(fns), 'load_s': time.perf_counter() - t}))
  while True:
    try:
      msg = conn_in.recv()
    except (EOFError, OSError):
      return 0  # the parent is gone or closed the pipe
    if msg[0] == 'stop':
      return 0
    _, batch_id, images, prompts = msg
    t = time.perf_counter()
    try:
      parts, faults = score(fns, images, prompts)
    except BadShape as e:
      conn_out.send(('failed', batch_id, str(e)))
      continue
    conn_out.send(('scores', batch_id, parts, time.perf_counter() - t, faults))


def main(argv: list[str]) -> int:
  fd_in, fd_out, spec = int(argv[1]), int(argv[2]), json.loads(argv[3])
  conn_in = connection.Connection(fd_in, writable=False)
  conn_out = connection.Connection(fd_out, readable=False)
  return serve(conn_in, conn_out, spec)


if __name__ == '__main__':
  sys.exit(main(sys.argv))
