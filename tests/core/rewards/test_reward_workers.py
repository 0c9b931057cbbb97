"""Reward workers: rewards scored in worker processes started by the run, batched and
overlapped with the caller, bounded (a hung batch times out, its worker restarted and the batch
retried; a killed worker likewise), a worker that keeps failing stops the run with one line, a
sample whose reward failed is NaN (never 0) and masked out of its group's advantage and counted in
metrics.jsonl; bad reward settings are one line before anything compiles; the remote HTTP scorer
with its reference server; reward.combine='advantages' in the trainer.

The workers score the callables of tests/helpers/reward_worker_fixtures.py (real worker processes, real
pipes, real kills); nothing is mocked."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.rewards import registry
from digen_jax.rewards import scoring
from digen_jax.rewards import workers
from digen_jax.rl import advantages
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from tests.helpers.cli_cases import last_line, run_cases, written
from tests.helpers.paths import REPO

FIXTURES = 'tests.helpers.reward_worker_fixtures'
NAMES = (
    'brightness',
    'fragile',
    'slow',
    'hang_once',
    'crash_once',
    'always_crash',
    'wrong_shape',
    'batch_len',
    'pid',
    'crash_unless_grey',
)
CALLABLES = ','.join(f'w_{n}={FIXTURES}:{n}' for n in NAMES)  # w_: beside the built-in names


def _reward(weights: str, **fields):
  """config.reward scoring `weights` ('w_slow:1,w_pid:0') in worker processes."""
  r = configlib.base_config().reward
  r.callables = CALLABLES
  r.weights = weights
  r.in_workers = ','.join(registry.parse_weights(weights))
  r.start_timeout_s = 120.0
  for k, v in fields.items():
    r[k] = v
  return r


def _images(n, seed=0):
  """uint8 images whose brightness (the fixtures' score) differs per sample."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)


def _brightness(images):
  return images.astype(np.float32).mean(axis=(1, 2, 3)) / 255.0


def _pids(rewards):
  return {b.proc.pid for pool in rewards.pools for b in pool.backends}


@pytest.fixture
def built():
  """scoring.build(config) -> Rewards, closed (workers stopped) after the test."""
  made = []

  def build(r):
    made.append(scoring.build(r, registry.parse_weights(r.weights)))
    return made[-1]

  yield build
  for rewards in made:
    rewards.close()


def test_batches_are_scored_by_parallel_workers_while_the_caller_goes_on(built):
  """7 samples in batches of 2 on 2 workers: batches of 2, 2, 2, 1; both workers score; submit
  returns at once and the scoring (1.75 s of work) takes about half that wall time."""
  rewards = built(_reward('w_slow:1,w_batch_len:0,w_pid:0', workers=2, batch_size=2))
  images = _images(7)
  t = time.perf_counter()
  pending = rewards.submit(images, [f'p{i}' for i in range(7)])
  submit_s = time.perf_counter() - t
  assert submit_s < 0.5 and not pending.done()  # the caller samples on meanwhile
  s = pending.result()
  assert pending.done()
  np.testing.assert_allclose(s.parts[0], _brightness(images), rtol=1e-6)
  assert list(s.parts[1]) == [2, 2, 2, 2, 2, 2, 1]
  assert set(s.parts[2].astype(int)) == _pids(rewards)  # each worker scored some batches
  np.testing.assert_array_equal(s.total, s.parts[0])  # weights 1, 0, 0
  assert s.compute_s >= 1.75 - 0.05  # 0.25 s a sample, in the workers
  assert s.wall_s < 0.8 * s.compute_s, (s.wall_s, s.compute_s)  # two at a time
  assert s.failed == 0 and s.retries == 0 and s.faults == []


def test_samples_a_reward_fails_on_are_nan_never_zero_and_masked_from_their_group(built, caplog):
  """A reward that raises on one prompt and scores NaN on another: those samples are NaN with a
  line naming the prompt, the rest keep their scores; the advantages leave them out of their
  groups (adv 0, invalid) and normalise each group over the samples that scored."""
  rewards = built(_reward('w_fragile', batch_size=4))
  images = _images(8)
  prompts = ['a', 'a', 'b raise', 'b', 'c', 'c nan', 'd', 'd']
  with caplog.at_level(logging.ERROR):
    s = rewards.submit(images, prompts).result()
  ok = np.array([1, 1, 0, 1, 1, 0, 1, 1], bool)
  assert np.isnan(s.total[~ok]).all() and s.failed == 2
  np.testing.assert_allclose(s.total[ok], _brightness(images)[ok], rtol=1e-6)
  assert any("'b raise'" in f and 'KeyError' in f for f in s.faults), s.faults
  assert any("'c nan'" in f and 'non-finite' in f for f in s.faults), s.faults
  # One line for the batch, however many samples failed (registry.fault_summary).
  errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
  assert errors == [registry.fault_summary(s.faults, 8)] and errors[0].startswith('2 faults in a ')
  adv, valid = (np.asarray(x) for x in advantages.grpo_advantages(s.total, 4, mask_failed=True))
  assert np.isfinite(adv).all() and list(valid) == list(ok)
  assert adv[2] == 0 and adv[5] == 0
  for group in (slice(0, 4), slice(4, 8)):
    r, a = s.total[group], adv[group]
    kept = np.isfinite(r)
    want = (r[kept] - r[kept].mean()) / (r[kept].std() + 1e-4)
    np.testing.assert_allclose(a[kept], np.clip(want, -5, 5), rtol=1e-5)


def test_a_hung_batch_times_out_and_is_retried_on_a_restarted_worker(built, tmp_path, caplog):
  rewards = built(_reward('w_hang_once', batch_size=4, timeout_s=2.0, retries=1))
  before = _pids(rewards)
  images = _images(4)
  prompts = [f'hang @{tmp_path}', f'hang @{tmp_path}', 'x', 'y']  # hangs the first time only
  t = time.perf_counter()
  with caplog.at_level(logging.WARNING):
    s = rewards.submit(images, prompts).result()
  assert time.perf_counter() - t < 60  # 2 s, a restart, the retry: never the 600 s sleep
  np.testing.assert_allclose(s.total, _brightness(images), rtol=1e-6)
  assert s.retries == 1 and s.failed == 0 and rewards.pools[0].restarts == 1
  assert _pids(rewards).isdisjoint(before)  # a new process
  log = ' '.join(r.getMessage() for r in caplog.records)
  assert 'hung: no answer within 2 s (config.reward.timeout_s)' in log, log


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_its_batch_retried(built, tmp_path):
  """kill -9 of a worker in the middle of a batch, then a reward that exits its process: both
  batches are scored on a restarted worker."""
  rewards = built(_reward('w_slow:1,w_crash_once:0', batch_size=4))
  (victim,) = _pids(rewards)
  images = _images(4)
  pending = rewards.submit(images, ['a', 'b', 'c', 'd'])  # 1 s of scoring
  time.sleep(0.4)
  os.kill(victim, signal.SIGKILL)
  s = pending.result()
  np.testing.assert_allclose(s.total, _brightness(images), rtol=1e-6)
  assert s.retries == 1 and s.failed == 0
  (second,) = _pids(rewards)
  assert second != victim
  s = rewards.submit(images, [f'crash @{tmp_path}', 'b', 'c', 'd']).result()
  np.testing.assert_allclose(s.total, _brightness(images), rtol=1e-6)
  assert s.retries == 1 and rewards.pools[0].restarts == 2
  assert _pids(rewards) != {second}


@pytest.mark.slow
def test_a_batch_still_failing_after_its_retries_is_masked_not_scored(built, tmp_path):
  """reward.retries=0: the batch whose worker died is given up (NaN, one line); the next batch
  scores on the restarted worker."""
  rewards = built(_reward('w_crash_once', batch_size=2, retries=0))
  images = _images(4)
  s = rewards.submit(images, [f'crash @{tmp_path}', 'b', 'c', 'd']).result()
  assert np.isnan(s.total[:2]).all() and s.failed == 2
  np.testing.assert_allclose(s.total[2:], _brightness(images)[2:], rtol=1e-6)
  assert len(s.faults) == 1 and 'died' in s.faults[0] and 'config.reward.retries' in s.faults[0]


@pytest.mark.slow
def test_a_worker_failing_max_restarts_times_in_a_row_stops_with_one_line(built):
  rewards = built(_reward('w_always_crash', retries=10, max_restarts=2))
  pending = rewards.submit(_images(2), ['a', 'b'])
  with pytest.raises(workers.RewardWorkerError) as e:
    pending.result()
  line = str(e.value)
  assert '\n' not in line and pending.done()
  assert 'died' in line and 'exit code 3' in line and 'failed 3 times in a row' in line
  assert 'config.reward.max_restarts=2' in line
  assert rewards.pools[0].restarts == 2


# ---------------------------------------------------------------------------------- remote


def _serve(tmp_path, reward, callables=''):
  """The reference server (python -m digen_jax.rewards.remote) on a free port -> (proc, URL)."""
  args = [sys.executable, '-m', 'digen_jax.rewards.remote', f'--reward={reward}', '--port=0']
  if callables:
    args.append(f'--callables={callables}')
  proc = subprocess.Popen(
      args,
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO),
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
  )
  line = proc.stdout.readline()
  m = re.search(r'on (http://\S+/)', line)
  assert m, line
  return proc, m.group(1)


@pytest.fixture
def server(tmp_path):
  procs = []

  def start(reward, callables=''):
    proc, url = _serve(tmp_path, reward, callables)
    procs.append(proc)
    return proc, url

  yield start
  for p in procs:
    p.kill()
    p.wait()


def test_the_remote_scorer_scores_as_the_registry_does(built, server):
  """A built-in reward served over HTTP scores the run's images as it does in-process."""
  _, url = server('jpeg_compressibility')
  r = configlib.base_config().reward
  r.weights, r.remote, r.workers, r.batch_size = (
      'jpeg_compressibility',
      f'jpeg_compressibility={url}',
      2,
      3,
  )
  rewards = built(r)
  assert rewards.where == {'jpeg_compressibility': 'remote'}
  images = _images(7, seed=1)
  s = rewards.submit(images, ['p'] * 7).result()
  here = registry.call_reward(
      'jpeg_compressibility', images.astype(np.float32) / np.float32(127.5) - 1, ['p'] * 7
  )
  np.testing.assert_allclose(s.total, here, rtol=1e-6)
  assert s.failed == 0 and s.compute_s > 0


def test_the_remote_scorer_fails_samples_times_out_and_stops(built, server):
  """A user's reward served remotely: its failed samples come back null -> NaN (named); a scorer
  slower than timeout_s is given up (NaN, never 0); a scorer that is gone stops the run after
  max_restarts tries, in one line."""
  proc, url = server('mine', f'mine={FIXTURES}:fragile')
  r = configlib.base_config().reward
  r.weights, r.remote, r.batch_size, r.max_restarts = 'mine', f'mine={url}', 4, 1
  rewards = built(r)
  images = _images(4)
  s = rewards.submit(images, ['a', 'b raise', 'c nan', 'd']).result()
  assert list(np.isnan(s.total)) == [False, True, True, False]
  np.testing.assert_allclose(s.total[[0, 3]], _brightness(images)[[0, 3]], rtol=1e-6)
  assert len(s.faults) == 2 and "'b raise'" in s.faults[0]

  _, slow_url = server('slow', f'slow={FIXTURES}:slow')  # 0.25 s a sample
  r2 = configlib.base_config().reward
  r2.weights, r2.remote, r2.batch_size = 'slow', f'slow={slow_url}', 4
  r2.timeout_s, r2.retries, r2.max_restarts = 0.3, 0, 5
  s = built(r2).submit(images, ['a', 'b', 'c', 'd']).result()
  assert np.isnan(s.total).all() and s.failed == 4
  assert 'hung: no answer within 0.3 s (config.reward.timeout_s)' in s.faults[0], s.faults

  proc.kill()
  proc.wait()
  with pytest.raises(workers.RewardWorkerError) as e:
    rewards.submit(images, ['a', 'b', 'c', 'd']).result()
  line = str(e.value)
  assert '\n' not in line and f'remote scorer {"mine"!r} at {url}' in line
  assert 'config.reward.max_restarts=1' in line


def test_a_remote_scorer_cut_off_mid_answer_is_retried_then_stops_the_run(built):
  """A server that answers the start's empty batch, then cuts every answer short (the body
  shorter than its Content-Length: http.client.IncompleteRead): each batch is retried like a
  dead worker's and the run stops after max_restarts, in one line; it never waits forever."""
  import http.server  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  class CutOff(http.server.BaseHTTPRequestHandler):

    def do_POST(self):  # noqa: N802 (http.server's name)
      body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
      out = json.dumps({'scores': []}).encode()
      self.send_response(200)
      self.send_header('Content-Length', str(len(out) + (100 if body['prompts'] else 0)))
      self.end_headers()
      self.wfile.write(out)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), CutOff)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    r = configlib.base_config().reward
    url = f'http://127.0.0.1:{server.server_port}/'
    r.weights, r.remote, r.max_restarts, r.timeout_s = 'cut', f'cut={url}', 1, 5.0
    t = time.perf_counter()
    with pytest.raises(workers.RewardWorkerError) as e:
      built(r).submit(_images(2), ['a', 'b']).result()
    assert time.perf_counter() - t < 30
    assert 'IncompleteRead' in str(e.value) and 'config.reward.max_restarts=1' in str(e.value)
  finally:
    server.shutdown()


def test_a_remote_scorer_that_does_not_answer_is_one_line_at_start():
  r = configlib.base_config().reward
  r.weights, r.remote = 'mine', 'mine=http://127.0.0.1:9/score'  # the discard port: refused
  with pytest.raises(ValueError) as e:
    scoring.build(r, registry.parse_weights(r.weights))
  assert "remote scorer 'mine' at http://127.0.0.1:9/score" in str(e.value)
  assert 'does not answer' in str(e.value) and '\n' not in str(e.value)


# ------------------------------------------------------------------------------ in the run


@pytest.mark.slow
def test_combine_advantages_normalises_each_reward_in_the_trainer(tmp_path):
  """reward.combine='advantages': the trainer's advantages of a fragment are the weighted sum
  of each reward's own group advantages (rl/advantages.reward_advantages), not the advantages
  of the weighted sum (a reward on a 100x scale would drown the other)."""
  from digen_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import bookkeeping  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  parts = np.stack([rng.uniform(0, 1, 8), rng.uniform(0, 100, 8)]).astype(np.float32)
  total = parts[0] + 0.5 * parts[1]
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  got = {}
  for combine in ('sum', 'advantages'):
    c = configlib.apply_overrides(
        qwenimage.get_config('tiny'),
        {'reward.weights': 'jpeg_compressibility:1,shapes:0.5', 'reward.combine': combine},
    )
    exp = experiment.build(c, str(tmp_path), 1)
    ckpt = bookkeeping.checkpointer(exp.output, str(tmp_path / combine), False)
    tr = trainer_lib.Trainer(exp, mesh, ckpt, exp.plan, tag=False)
    adv, _ = tr.advantages(0, total, parts)
    tr.close()
    got[combine] = np.asarray(adv)[: exp.plan.size]
    want, _ = advantages.reward_advantages(parts, [1.0, 0.5], 4, combine=combine, mask_failed=True)
    np.testing.assert_allclose(got[combine], np.asarray(want), rtol=1e-5, atol=1e-6)
  assert not np.allclose(got['sum'], got['advantages'], atol=1e-2)


@pytest.mark.slow
def test_a_run_masks_failed_worker_rewards_and_counts_them(tmp_path):
  """A tiny run (2 steps) whose rewards are one in 2 workers and one in-process, combined as
  advantages: the prompts with 'nan' fail in the worker; their groups are masked, counted in
  reward_failed, and the steps train on the others (no skip, no NaN)."""
  prompts = tmp_path / 'prompts.txt'
  prompts.write_text('a red circle\na blue square\na nan triangle\ntwo nan squares\n')
  r = _reward('w_fragile:1,jpeg_compressibility:0.5', workers=2, batch_size=4)
  r.in_workers = 'w_fragile'
  config = configlib.apply_overrides(
      qwenimage.get_config('tiny'),
      {
          'total_steps': 2,
          'rl.prompts_per_step': 4,  # every prompt every step: 2 of the 4 groups fail
          'data.prompts': str(prompts),
          'eval.every': 0,
          **{f'reward.{k}': v for k, v in r.items()},
          'reward.combine': 'advantages',
      },
  )
  wd = str(tmp_path / 'run')
  exp = experiment.build(config, wd, 2)
  try:
    assert exp.reward_fn.where == {'w_fragile': 'workers', 'jpeg_compressibility': 'host'}
    loop.train(exp, wd, cluster_lib.colocated(jax.local_devices()[:2]))
  finally:
    exp.reward_fn.close()
  rows = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'))]
  assert [x['reward_failed'] for x in rows] == [8, 8]
  assert [x['nonfinite'] for x in rows] == [0, 0]
  assert [x['skipped_updates'] for x in rows] == [0, 0]
  assert all(x['valid_frac'] <= 0.5 and np.isfinite(x['reward_mean']) for x in rows)
  assert all(x['reward_s_per_sample'] > 0 and x['reward_wait_s'] >= 0 for x in rows)
  assert all(x['reward_retries'] == 0 for x in rows)


# ------------------------------------------------------------------- bad input, via main

TINY = '--config=configs/qwenimage.py:tiny'
IN_WORKERS = (f'--config.reward.callables={CALLABLES}', '--config.reward.start_timeout_s=120')


def _case(name, *flags):
  return name, ['-m', 'digen_jax.main', '--workdir={w}', TINY, *flags]


CASES = [
    (
        _case(
            'wrong_shape',
            *IN_WORKERS,
            '--config.reward.weights=w_wrong_shape',
            '--config.reward.in_workers=w_wrong_shape',
        ),
        [
            "config.reward.weights='w_wrong_shape': a probe batch",
            "reward 'w_wrong_shape' returned shape (3,); expected (2,)",
        ],
    ),
    (
        _case('host_wrong_shape', *IN_WORKERS, '--config.reward.weights=w_wrong_shape'),
        [
            "config.reward.weights='w_wrong_shape': a probe batch",
            "reward 'w_wrong_shape' returned shape (3,); expected (2,)",
        ],
    ),
    (
        _case('unknown_in_workers', '--config.reward.in_workers=nosuch'),
        ["config.reward.in_workers: unknown reward(s) ['nosuch']"],
    ),
    (
        _case(
            'weights_do_not_load',
            '--config.reward.weights=ocr',
            '--config.reward.models=ocr={w}/no_such_folder',
        ),
        ['reward worker 0 (ocr on cpu) cannot load', 'no_such_folder', 'det.onnx', 'config.reward'],
    ),
    (
        _case(
            'worker_module_missing',
            '--config.reward.callables=mine=nope.mod:fn',
            '--config.reward.weights=mine',
            '--config.reward.in_workers=mine',
        ),
        ['reward worker 0 (mine on cpu) cannot load', "cannot import 'nope.mod'"],
    ),
    (
        _case('learned_without_folder', '--config.reward.weights=clip_score'),
        ['--config.reward.models=clip_score=/path/to/folder'],
    ),
    (
        _case('combine_typo', '--config.reward.combine=advantage'),
        ["config.reward.combine='advantage'", "('sum', 'advantages')"],
    ),
]


def _run(cases):
  """[(name, argv with {w})] through main (tests/cli_zygote.py) -> ({name: result}, {name: w})."""
  root = _run.root
  named = [
      (name, [a.format(w=str(root / name)) for a in argv], str(root / name)) for name, argv in cases
  ]
  return run_cases(named, timeout_s=300), {name: w for name, _, w in named}


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  _run.root = tmp_path_factory.mktemp('workdirs')
  return _run([case for case, _ in CASES])


@pytest.mark.slow
@pytest.mark.parametrize(
    'name, expected', [(c[0][0], c[1]) for c in CASES], ids=[c[0][0] for c in CASES]
)
def test_bad_reward_settings_are_one_line_before_anything_compiles(outcomes, name, expected):
  results, workdirs = outcomes
  r = results[name]
  line = last_line(r['stderr'])
  assert r['code'] not in (0, -9), (r['code'], r['stderr'][-2000:])
  assert 'Traceback' not in r['stderr'], r['stderr'][-3000:]
  assert line.startswith('digen_jax: '), line
  for text in expected:
    assert text in line, (text, line)
  assert written(workdirs[name]) == [], written(workdirs[name])
  assert r['seconds'] < 60, r['seconds']  # refused at start, not after compiling


@pytest.mark.slow
def test_a_worker_that_keeps_dying_stops_the_run_with_one_line(tmp_path):
  """The probe batch scores (grey images); every real batch kills its worker: after
  max_restarts restarts the run stops, its last line saying so."""
  _run.root = tmp_path
  results, _ = _run(
      [
          _case(
              'keeps_dying',
              *IN_WORKERS,
              '--config.reward.weights=w_crash_unless_grey',
              '--config.reward.in_workers=w_crash_unless_grey',
              '--config.reward.max_restarts=1',
              '--config.total_steps=2',
          )
      ]
  )
  r = results['keeps_dying']
  line = last_line(r['stderr'])
  assert r['code'] not in (0, -9), (r['code'], r['stderr'][-2000:])
  assert 'Traceback' not in r['stderr'], r['stderr'][-3000:]
  assert line.startswith('digen_jax: reward worker 0 (w_crash_unless_grey on cpu) died'), line
  assert 'exit code 3' in line and 'config.reward.max_restarts=1' in line, line
