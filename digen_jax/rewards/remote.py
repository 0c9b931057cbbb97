"""A user's HTTP reward scorer, with the same interface as the worker processes
(config.reward.remote = 'name=http://host:port/path'), and a reference server.

The protocol: POST the URL with JSON {"prompts": [...], "images": [base64 PNG, ...]} (uint8 RGB
as the run's samples/ PNGs); the answer is JSON {"scores": [float or null, ...]}, one per image,
null for a sample the scorer failed on. A non-200 answer or a wrong count fails the batch. The
pool (rewards/workers.py) bounds each request by config.reward.timeout_s and retries it; a
scorer that keeps failing (max_restarts in a row) stops the run.

Serve any reward this package knows over that protocol (a learned one loads its model here):

    python -m digen_jax.rewards.remote --reward=ocr --port=8008 [--host=127.0.0.1]
    python -m digen_jax.rewards.remote --reward=mine --callables=mine=my_module:score
    python -m digen_jax.rewards.remote --reward=shapes --modules=digen_jax.tasks  (a task's)

--port=0 takes a free port; the first line on stdout names the URL.
"""

from __future__ import annotations

import argparse
import base64
import http.server
import io
import json
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from PIL import Image

from digen_jax.rewards import workers


def encode_png(image: np.ndarray) -> str:
  buf = io.BytesIO()
  Image.fromarray(np.asarray(image, np.uint8)).save(buf, format='PNG')
  return base64.b64encode(buf.getvalue()).decode('ascii')


def decode_png(text: str) -> np.ndarray:
  return np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert('RGB'))


class HttpScorer:
  """One connection's worth of requests to a remote scorer (a pool holds reward.workers)."""

  def __init__(self, index: int, name: str, url: str):
    self.name, self.url = name, url
    self.label = f'remote scorer {name!r} at {url} (connection {index})'

  def start(self) -> None:
    """Checks the URL answers (one empty batch) before the run compiles anything."""
    try:
      self._post([], [], 30.0)
    except (workers.Died, workers.Hung, workers.BatchFailed) as e:
      raise workers.LoadError(f'{self.label} does not answer: {e}') from None

  def _post(self, images, prompts, timeout_s: float) -> list:
    body = json.dumps({'prompts': list(prompts), 'images': [encode_png(x) for x in images]})
    req = urllib.request.Request(
        self.url, data=body.encode(), headers={'Content-Type': 'application/json'}
    )
    try:
      with urllib.request.urlopen(req, timeout=timeout_s if timeout_s > 0 else None) as resp:
        scores = json.loads(resp.read())['scores']
    except TimeoutError as e:
      raise workers.Hung(f'no answer within {timeout_s:g} s (config.reward.timeout_s)') from e
    except urllib.error.HTTPError as e:
      raise workers.BatchFailed(f'HTTP {e.code}: {e.read()[:200]!r}') from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
      if 'timed out' in str(e):
        raise workers.Hung(f'no answer within {timeout_s:g} s (config.reward.timeout_s)') from e
      raise workers.Died(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
      raise workers.BatchFailed(f'not a JSON {{"scores": [...]}} answer: {e}') from None
    if len(scores) != len(prompts):
      raise workers.BatchFailed(f'{len(scores)} scores for {len(prompts)} images')
    return scores

  def score(self, batch_id: int, images, prompts, timeout_s: float):
    del batch_id
    t = time.perf_counter()
    scores = self._post(images, prompts, timeout_s)
    parts = np.asarray([[np.nan if s is None else float(s) for s in scores]], np.float32)
    lines = [
        f'{self.label} failed on prompt {p[:120]!r}' for p, s in zip(prompts, scores) if s is None
    ]
    return parts, time.perf_counter() - t, lines

  def restart(self) -> None:
    pass  # nothing of ours to restart: the next request tries again

  def close(self) -> None:
    pass


def serve(reward: str, host: str, port: int, spec: dict | None = None) -> None:
  """Serves `reward` (loaded as a worker loads it) on http://host:port/ until killed."""
  from digen_jax.rewards import worker  # pylint: disable=g-import-not-at-top

  fns = worker.load(dict(spec or {}, rewards=[reward]))

  class Handler(http.server.BaseHTTPRequestHandler):

    def do_POST(self):  # noqa: N802 (http.server's name)
      body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
      prompts = body['prompts']
      scores = []
      if prompts:
        images = np.stack([decode_png(x) for x in body['images']])
        parts, _ = worker.score(fns, images, prompts)
        scores = [None if not np.isfinite(v) else float(v) for v in parts[0]]
      out = json.dumps({'scores': scores}).encode()
      self.send_response(200)
      self.send_header('Content-Type', 'application/json')
      self.send_header('Content-Length', str(len(out)))
      self.end_headers()
      self.wfile.write(out)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer((host, port), Handler)
  print(f'serving reward {reward!r} on http://{host}:{server.server_port}/', flush=True)
  server.serve_forever()


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--reward', required=True)
  ap.add_argument('--host', default='127.0.0.1')
  ap.add_argument('--port', type=int, default=8008)
  ap.add_argument('--model', default='', help='the weights folder of a learned reward')
  ap.add_argument('--device', default='cpu')
  ap.add_argument(
      '--callables', default='', help="a user's reward to serve: 'name=module.path:function'"
  )
  ap.add_argument(
      '--modules',
      default='',
      help="comma-separated modules whose import registers the reward (a task's: digen_jax.tasks)",
  )
  a = ap.parse_args(argv)
  spec = {'models': {a.reward: a.model}, 'device': a.device, 'callables': a.callables}
  spec['modules'] = [m.strip() for m in a.modules.split(',') if m.strip()]
  try:
    serve(a.reward, a.host, a.port, spec)
  except (ValueError, ImportError) as e:  # an unknown reward or module: one line
    sys.exit(f"digen_jax.rewards.remote: {e} (a task's reward: --modules=<its package>)")
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
