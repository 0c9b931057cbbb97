"""Ablation sweep: one config, several sets of `--config.x=v` overrides, one workdir per run, one
summary table of what users compare (samples/s, utilization, final reward, eval accuracy).

Usage:
  python launch/sweep.py --config=configs/qwenimage.py:tiny --root=/tmp/sweep \\
      --grid config.optim.lr=1e-4,3e-4 --grid config.rl.group_size=4,8 \\
      [--run "name:--config.a=1 --config.b=2"]... [--runs_file=FILE] [--set=--config.total_steps=3]...
      [--parallel=N] [--pin] [--num_processes=P] [--devices_per_process=D] [--timeout_s=T]
      [--fresh] [--csv=PATH] [--json=PATH] [--dry_run]

Runs:
  --grid config.KEY=V1,V2,...  one axis; several --grid give their cartesian product. Values are split
                               on ';' when the spec has one (for tuple values: `..devices=0,1;2,3`),
                               else on ','. A grid point is named after its values: `lr=1e-4,group_size=4`.
  --run "NAME:FLAGS"           one named run; FLAGS are `--config.KEY=VALUE` words (shell quoting).
  --runs_file FILE             the same, one `NAME: FLAGS` per line ('#' starts a comment).
  Explicit runs and a grid combine as their product (`NAME-POINT`); either alone is the run list.
  --set --config.KEY=VALUE     common to every run; a run's own setting of the same key wins, and a
                               grid value wins over both.
Bad input (a word that is not `--config.KEY=VALUE`, an empty grid or value, a duplicate run name,
a key that the config does not have) stops the sweep with one `sweep: ...` line before anything runs.

Each run is `python -m digen_jax.main --config=CONFIG --workdir=ROOT/NAME FLAGS`, or with
--num_processes=P > 1 the same behind `launch/local.py --num_processes=P` (one jax.distributed
process each). --devices_per_process=D forces D host-platform (CPU) devices per process. Runs go one
after another, or --parallel=N at a time; --pin confines parallel slot i to its own share of this
process's cores (os.sched_setaffinity before exec) and pins local.py's copies one per core in it.
An existing workdir is resumed (digen_jax.main restarts from its last checkpoint) unless --fresh,
which deletes it first. Output of each invocation is appended to ROOT/NAME/sweep.log.

Summary, per run (printed, and written to ROOT/sweep_summary.{csv,json} unless --csv/--json):
  status (ok | failed | timeout | interrupted | invalid) and exit code; steps (last optimizer step in
  metrics.jsonl); samples/s: median over the steps after the first step of each invocation (that step
  compiles); utilization: mean over the same steps; final reward_mean; final eval/strict_accuracy and
  eval/reward_mean when the run evaluated; wall time of this invocation; the overrides. A failed run
  keeps its place in the table with the tail of its log; the sweep goes on, and exits 1 at the end.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_LAUNCHER = os.path.join(REPO_ROOT, 'launch', 'local.py')
GRACE_S = 10.0  # SIGTERM -> SIGKILL; longer than local.py's own grace (5 s) for its copies
POLL_S = 0.1
STATE_FILE = 'sweep_run.json'  # per workdir: the first step of each invocation (they compile)
LOG_FILE = 'sweep.log'
_OVERRIDE = re.compile(r'^--config\.([A-Za-z_]\w*(?:\.\w+)*)=(.*)$', re.S)
_GRID = re.compile(r'^(?:--)?config\.([A-Za-z_]\w*(?:\.\w+)*)=(.*)$', re.S)
_NAME = re.compile(r'^[A-Za-z0-9_.,=+\-]+$')
COLUMNS = (
    'name',
    'status',
    'exit_code',
    'steps',
    'samples_per_s',
    'utilization',
    'reward_mean',
    'eval_strict_accuracy',
    'eval_reward_mean',
    'wall_s',
    'overrides',
    'workdir',
    'log_tail',
)


class SweepError(ValueError):
  """Bad sweep input; main() prints it as one `sweep: ...` line."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the sweep: its name (= workdir under the root) and how to launch it."""

  name: str
  overrides: tuple[str, ...]  # '--config.KEY=VALUE' words
  num_processes: int = 1  # > 1: behind launch/local.py
  devices_per_process: int | None = None  # forced host-platform devices (None: leave XLA_FLAGS)
  pin: bool = False  # confine to the slot's cores; local.py copies one per core


# ------------------------------------------------------------------------------------- parsing


def parse_override(word: str) -> tuple[str, str]:
  """'--config.a.b=v' -> ('a.b', 'v'); anything else is a SweepError naming the word."""
  m = _OVERRIDE.match(word)
  if not m:
    raise SweepError(
        f'{word!r} is not an override; write --config.KEY=VALUE ' '(e.g. --config.optim.lr=3e-4)'
    )
  return m.group(1), m.group(2)


def merge(*layers: Iterable[str]) -> tuple[str, ...]:
  """Override words of several layers; a later layer's setting of a key replaces an earlier one,
  and one layer may not set a key twice."""
  out: dict[str, str] = {}
  for layer in layers:
    seen = set()
    for word in layer:
      key, _ = parse_override(word)
      if key in seen:
        raise SweepError(f'config.{key} is set twice in {" ".join(layer)!r}')
      seen.add(key)
      out.pop(key, None)  # re-insert: the flag order shows what was applied last
      out[key] = word
  return tuple(out.values())


def parse_grid(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
  """['config.optim.lr=1e-4,3e-4', ...] -> [('optim.lr', ['1e-4', '3e-4']), ...]."""
  axes, keys = [], set()
  for spec in specs:
    m = _GRID.match(spec)
    if not m:
      raise SweepError(
          f'--grid {spec!r}: write config.KEY=V1,V2,... (e.g. config.optim.lr=1e-4,3e-4)'
      )
    key, rhs = m.groups()
    if not rhs.strip():
      raise SweepError(f'--grid {spec!r}: empty grid; give at least one value after "="')
    values = [v.strip() for v in rhs.split(';' if ';' in rhs else ',')]
    if any(not v for v in values):
      raise SweepError(f'--grid {spec!r}: empty value in the list (stray separator?)')
    if len(set(values)) != len(values):
      raise SweepError(f'--grid {spec!r}: repeated value')
    if key in keys:
      raise SweepError(f'--grid config.{key} given twice; put all its values in one --grid')
    keys.add(key)
    axes.append((key, values))
  return axes


def _label(value: str) -> str:
  return re.sub(r'[^A-Za-z0-9_.,=+\-]', '_', value)


def grid_points(axes: list[tuple[str, list[str]]]) -> list[tuple[str, tuple[str, ...]]]:
  """Cartesian product of the axes -> [(name, override words)]. Names use each key's last
  component (`lr=1e-4,group_size=4`), or its whole path where two keys share the last one."""
  last = [k.rsplit('.', 1)[-1] for k, _ in axes]
  short = [l if last.count(l) == 1 else k for l, (k, _) in zip(last, axes)]
  points = []
  for values in itertools.product(*[vals for _, vals in axes]):
    name = ','.join(f'{s}={_label(v)}' for s, v in zip(short, values))
    points.append((name, tuple(f'--config.{k}={v}' for (k, _), v in zip(axes, values))))
  return points


def parse_run(spec: str, where: str = '--run') -> tuple[str, tuple[str, ...]]:
  """'name:--config.a=1 --config.b=2' -> ('name', ('--config.a=1', '--config.b=2'))."""
  name, sep, rest = spec.partition(':')
  name = name.strip()
  if not sep or not name:
    raise SweepError(f'{where} {spec!r}: write NAME:--config.KEY=VALUE ... (NAME before a colon)')
  if not _NAME.match(name):
    raise SweepError(f'{where} {spec!r}: run name {name!r} may only use letters, digits and _.,=+-')
  try:
    words = tuple(shlex.split(rest))
  except ValueError as e:
    raise SweepError(f'{where} {spec!r}: {e}') from None
  for w in words:
    try:
      parse_override(w)
    except SweepError as e:
      raise SweepError(f'{where} {name!r}: {e}') from None
  return name, merge(words)


def read_runs_file(path: str) -> list[tuple[str, tuple[str, ...]]]:
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise SweepError(f'--runs_file {path!r}: {e.strerror}') from None
  except UnicodeDecodeError as e:
    raise SweepError(
        f'--runs_file {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); '
        'give lines "NAME: --config.K=V ..."'
    ) from None
  runs = []
  for i, line in enumerate(lines, 1):
    line = line.split('#', 1)[0].strip()
    if line:
      runs.append(parse_run(line, where=f'{path}:{i}:'))
  return runs


def build_runs(
    *,
    grid: Sequence[str] = (),
    runs: Sequence[tuple[str, Sequence[str]]] = (),
    common: Sequence[str] = (),
    **launch: Any,
) -> list[Run]:
  """The run list: explicit runs x grid points (either alone: itself), each with the common
  overrides underneath. `launch`: Run's launch fields, the same for every run."""
  axes = parse_grid(grid)
  points = grid_points(axes) if axes else [None]
  explicit = list(runs) or [None]
  if explicit == [None] and points == [None]:
    raise SweepError('nothing to run: give --grid, --run or --runs_file')
  common = merge(common)
  out, names = [], set()
  for r, p in itertools.product(explicit, points):
    name = '-'.join(x[0] for x in (r, p) if x is not None)
    if name in names:
      raise SweepError(f'duplicate run name {name!r}; run names must be unique (they are workdirs)')
    names.add(name)
    out.append(Run(name, merge(common, r[1] if r else (), p[1] if p else ()), **launch))
  return out


# ---------------------------------------------------------------------- checking config keys


def load_config(spec: str):
  """configs/x.py[:arg] -> the ConfigDict, loaded the way ml_collections' config_flags does."""
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise SweepError(f'--config={spec}: no such file {path!r}')
  if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # config files import digen_jax
  try:
    module_spec = importlib.util.spec_from_file_location('_sweep_config', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # pylint: disable=broad-except  (any failure of a config file is input)
    raise SweepError(f'--config={spec} does not load: {type(e).__name__}: {e}') from None


def has_field(config, dotted: str) -> bool:
  """Whether `config` (a ConfigDict) has the field 'a.b.c'."""
  node = config
  for part in dotted.split('.'):
    try:
      if part not in node:
        return False
    except TypeError:  # a leaf in the middle of the path
      return False
    node = node[part]
  return True


def missing_keys(config, run: Run) -> list[str]:
  """The override keys of `run` that `config` has no field for (the run would fail at parse)."""
  return [k for k, _ in map(parse_override, run.overrides) if not has_field(config, k)]


def check_keys(config_spec: str, runs: Sequence[Run]) -> dict[str, str]:
  """{run name: one-line problem} for the runs that set fields the config does not have, or
  values that do not parse (ml_collections' own parser) or do not validate (configlib.validate
  on one device: device counts are checked by each run itself)."""
  config = load_config(config_spec)
  problems = {}
  for run in runs:
    bad = missing_keys(config, run)
    if bad:
      problems[run.name] = (
          f'{config_spec} has no field ' + ', '.join(f'config.{k}' for k in bad) + ' (unknown key)'
      )
      continue
    bad_value = value_problem(config, run)
    if bad_value:
      problems[run.name] = bad_value
  return problems


def value_problem(config, run: Run) -> str | None:
  """Why `run`'s overrides give a config digen_jax.main would reject at start, or None."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top

  if not hasattr(config, 'runtime'):  # not a digen_jax.main config tree: leave it to the run
    return None
  values = flags.FlagValues()
  argv = ['sweep', *run.overrides]
  config_flags.DEFINE_config_dict(
      'config', copy.deepcopy(config), flag_values=values, sys_argv=argv
  )
  # The configs name the tasks' prompt sets and rewards: register them as the entry points do.
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top

  try:
    values(argv)
    configlib.validate(values.config, 1)
  except (flags.Error, ValueError, TypeError, AttributeError, KeyError) as e:
    return ' '.join(str(e).split())
  return None


# --------------------------------------------------------------------------------- launching


def run_command(
    run: Run,
    config: str,
    workdir: str,
    cores: Sequence[int] | None = None,
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
  """argv and environment of one run."""
  main = [
      python,
      '-m',
      'digen_jax.main',
      f'--config={config}',
      f'--workdir={workdir}',
      *run.overrides,
  ]
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO_ROOT, env.get('PYTHONPATH')) if p)
  env['PYTHONUNBUFFERED'] = '1'
  if run.num_processes > 1:
    argv = [python, LOCAL_LAUNCHER, f'--num_processes={run.num_processes}']
    if run.devices_per_process is not None:
      argv.append(f'--devices_per_process={run.devices_per_process}')
    if run.pin:
      argv.append('--cpu_pinning')
    return argv + ['--'] + main, env
  if run.devices_per_process is not None:
    flags = [
        f
        for f in env.get('XLA_FLAGS', '').split()
        if not f.startswith('--xla_force_host_platform_device_count')
    ]
    flags.append(f'--xla_force_host_platform_device_count={run.devices_per_process}')
    env['XLA_FLAGS'] = ' '.join(flags)
  return main, env


def slot_cores(parallel: int, cores: Sequence[int] | None = None) -> list[list[int]]:
  """Disjoint core sets, one per parallel slot (wrapping when slots outnumber cores)."""
  cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
  if parallel >= len(cores):
    return [[cores[i % len(cores)]] for i in range(parallel)]
  per = len(cores) // parallel
  return [
      cores[i * per : (i + 1) * per] if i < parallel - 1 else cores[i * per :]
      for i in range(parallel)
  ]


def _preexec(cores: Sequence[int] | None):
  """Runs in the child before exec (the sweep is single-threaded, so this is safe)."""

  def fn():
    if cores:
      os.sched_setaffinity(0, set(cores))
    try:  # die with the sweep, even if it is SIGKILLed (local.py does the same for its copies)
      import ctypes  # pylint: disable=g-import-not-at-top

      ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      pass

  return fn


def _signal_group(pid: int, sig: int) -> None:
  try:
    os.killpg(pid, sig)  # start_new_session=True: the child's process group id is its pid
  except (ProcessLookupError, PermissionError):
    pass


def _stop(proc: subprocess.Popen) -> None:
  """SIGTERM the run's process group, SIGKILL after GRACE_S (jax catches SIGTERM)."""
  _signal_group(proc.pid, signal.SIGTERM)
  try:
    proc.wait(timeout=GRACE_S)
  except subprocess.TimeoutExpired:
    pass
  _signal_group(proc.pid, signal.SIGKILL)
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    pass


# ----------------------------------------------------------------------------- run summaries


def _read_jsonl(path: str) -> list[dict]:
  rows = []
  try:
    with open(path) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          pass  # a line cut off by a kill
  except OSError:
    pass
  return rows


def train_rows(workdir: str) -> list[dict]:
  """metrics.jsonl's optimizer-step rows, one per step (a resumed run may repeat a step: the
  last row wins), in step order."""
  by_step = {}
  for r in _read_jsonl(os.path.join(workdir, 'metrics.jsonl')):
    if 'reward_mean' in r and 'step' in r:
      by_step[int(r['step'])] = r
  return [by_step[s] for s in sorted(by_step)]


def last_step(workdir: str) -> int:
  rows = train_rows(workdir)
  return int(rows[-1]['step']) if rows else 0


def _state(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, STATE_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def record_first_step(workdir: str, step: int) -> None:
  """Remembers that `step` is the first of an invocation (it includes compilation)."""
  state = _state(workdir)
  firsts = sorted(set(state.get('first_steps', [])) | {int(step)})
  with open(os.path.join(workdir, STATE_FILE), 'w') as f:
    json.dump({'first_steps': firsts}, f)


def _num(v) -> float | None:
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def summarize_rows(rows: list[dict], evals: list[dict], firsts: set[int]) -> dict[str, Any]:
  """Per-run figures from train rows (one per step, in order), eval rows, and the steps that
  were the first of an invocation (they compile; left out of samples/s and utilization)."""
  steady = [r for r in rows if int(r['step']) not in firsts]
  sps = [x for x in (_num(r.get('samples_per_s')) for r in steady) if x is not None]
  util = [x for x in (_num(r.get('utilization')) for r in steady) if x is not None]
  out: dict[str, Any] = {
      'steps': int(rows[-1]['step']) if rows else 0,
      'samples_per_s': statistics.median(sps) if sps else None,
      'utilization': statistics.fmean(util) if util else None,
      'reward_mean': _num(rows[-1].get('reward_mean')) if rows else None,
      'eval_strict_accuracy': None,
      'eval_reward_mean': None,
  }
  if evals:
    last = max(evals, key=lambda r: (r.get('step', 0), r.get('time', 0)))
    out['eval_strict_accuracy'] = _num(last.get('eval/strict_accuracy'))
    out['eval_reward_mean'] = _num(last.get('eval/reward_mean'))
  return out


def summarize_workdir(workdir: str) -> dict[str, Any]:
  """summarize_rows of <workdir>/metrics.jsonl, with the first steps recorded by the sweep (or,
  for a workdir the sweep did not start, its first step)."""
  rows = train_rows(workdir)
  firsts = set(_state(workdir).get('first_steps', []))
  if rows and not firsts:
    firsts = {int(rows[0]['step'])}
  evals = [
      r
      for r in _read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
      if 'eval/strict_accuracy' in r or 'eval/reward_mean' in r
  ]
  return summarize_rows(rows, evals, firsts)


def log_tail(path: str, n: int = 20) -> list[str]:
  try:
    with open(path, errors='replace') as f:
      lines = [l.rstrip() for l in f.read().splitlines()[-4 * n :] if l.strip()]
  except OSError:
    return []
  return lines[-n:]


# ------------------------------------------------------------------------------- the sweep


class Interrupted(Exception):
  """SIGINT/SIGTERM during a sweep; `rows` are the result rows with the stopped runs marked."""

  def __init__(self, signum: int, rows: list | None = None):
    super().__init__(signum)
    self.signum, self.rows = signum, rows


def _result(
    run: Run,
    workdir: str,
    status: str,
    code: int | None,
    wall_s: float | None,
    tail: list[str],
    metrics: bool = True,
) -> dict[str, Any]:
  """A result row; metrics=False for a run that did not run now (its workdir may be stale)."""
  r = {
      'name': run.name,
      'status': status,
      'exit_code': code,
      'overrides': ' '.join(run.overrides),
      'workdir': workdir,
      'wall_s': wall_s,
      'num_processes': run.num_processes,
      'devices_per_process': run.devices_per_process,
      'pin': run.pin,
      'log_tail': tail,
  }
  r.update(summarize_workdir(workdir) if metrics else summarize_rows([], [], set()))
  return r


def run_sweep(
    runs: Sequence[Run],
    config: str,
    root: str,
    *,
    parallel: int = 1,
    fresh: bool = False,
    timeout_s: float = 0.0,
    invalid: dict[str, str] | None = None,
    log=print,
    python: str = sys.executable,
) -> list[dict[str, Any]]:
  """Runs every run (`parallel` at a time) and returns one result row per run, in run order.

  invalid: {name: problem} for runs that are reported as status 'invalid' without running.
  Runs with `pin` get their parallel slot's cores. SIGINT/SIGTERM stop the running runs and raise
  Interrupted carrying every row (the stopped and never-started runs with status 'interrupted')."""
  invalid = invalid or {}
  os.makedirs(root, exist_ok=True)
  cores = slot_cores(parallel)
  results: dict[str, dict] = {}
  pending = list(runs)
  running: dict[int, tuple] = {}  # slot -> (run, proc, t0, workdir, log file, first step)
  free = list(range(parallel))
  n_total = len(runs)

  def start(run: Run, slot: int):
    workdir = os.path.join(root, run.name)
    if run.name in invalid:
      if fresh and os.path.isdir(workdir):
        shutil.rmtree(workdir)  # no stale figures or timeline from an earlier sweep
      results[run.name] = _result(
          run, workdir, 'invalid', None, None, [invalid[run.name]], metrics=False
      )
      log(f'[sweep] {run.name}: not run: {invalid[run.name]}')
      free.append(slot)
      return
    if fresh and os.path.isdir(workdir):
      shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    first = last_step(workdir) + 1
    argv, env = run_command(run, config, workdir, python=python)
    logf = open(os.path.join(workdir, LOG_FILE), 'a', buffering=1)
    logf.write(f'\n=== sweep {time.strftime("%Y-%m-%d %H:%M:%S")}: {shlex.join(argv)}\n')
    slot_set = cores[slot] if run.pin else None
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_preexec(slot_set),
    )
    running[slot] = (run, proc, time.monotonic(), workdir, logf, first)
    done = len(results) + len(running)
    where = f' on cores {slot_set}' if slot_set else ''
    log(f'[sweep] start {done}/{n_total} {run.name}{where} -> {workdir}/{LOG_FILE}')

  def finish(slot: int, status: str | None = None):
    run, proc, t0, workdir, logf, first = running.pop(slot)
    code = proc.returncode
    logf.close()
    wall = time.monotonic() - t0
    if last_step(workdir) >= first:
      record_first_step(workdir, first)
    if status is None:
      status = 'ok' if code == 0 else 'failed'
    code = 128 - code if code is not None and code < 0 else code  # killed by signal s: 128+s
    r = results[run.name] = _result(run, workdir, status, code, wall, log_tail(logf.name))
    sps = r['samples_per_s']
    log(
        f'[sweep] {status} {run.name} (exit {code}) in {wall:.1f}s: {r["steps"]} steps'
        + (f', {sps:.3g} samples/s' if sps is not None else '')
    )
    free.append(slot)

  # The handler only records the signal; the loop acts on it between starts and polls. Raising
  # from the handler could land anywhere, e.g. inside Popen after its fork: a run started but
  # never recorded (no row for it, and its process never stopped).
  caught: list[int] = []

  def on_signal(signum, frame):
    caught.append(signum)

  # Signal handlers can only be set from the main thread; elsewhere the caller handles signals.
  main_thread = threading.current_thread() is threading.main_thread()
  old = (
      {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
      if main_thread
      else {}
  )
  try:
    while (pending or running) and not caught:
      while pending and free and not caught:
        start(pending.pop(0), free.pop(0))
      for slot in list(running):
        run, proc, t0 = running[slot][:3]
        if proc.poll() is not None:
          finish(slot)
        elif timeout_s > 0 and time.monotonic() - t0 > timeout_s:
          log(f'[sweep] {run.name}: timeout after {timeout_s:.0f}s; stopping it')
          _stop(proc)
          finish(slot, 'timeout')
      if not caught:
        time.sleep(POLL_S)
    if caught:
      for slot in list(running):
        _stop(running[slot][1])
        finish(slot, 'interrupted')
      for run in pending:
        results[run.name] = _result(
            run, os.path.join(root, run.name), 'interrupted', None, None, [], metrics=not fresh
        )
      raise Interrupted(caught[0], [results[r.name] for r in runs])
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  return [results[r.name] for r in runs]


# -------------------------------------------------------------------------------- reporting


def fmt(v, digits: int = 4) -> str:
  if v is None:
    return '-'
  if isinstance(v, float):
    return f'{v:.{digits}g}'
  return str(v)


def format_table(
    rows: Sequence[dict], columns: Sequence[tuple[str, str]] | None = None, tail_lines: int = 3
) -> str:
  """Fixed-width text table; runs that did not succeed get their log tail underneath."""
  columns = columns or (
      ('name', 'run'),
      ('status', 'status'),
      ('exit_code', 'exit'),
      ('steps', 'steps'),
      ('samples_per_s', 'samples/s'),
      ('utilization', 'util'),
      ('reward_mean', 'reward'),
      ('eval_strict_accuracy', 'eval acc'),
      ('eval_reward_mean', 'eval reward'),
      ('wall_s', 'wall s'),
      ('overrides', 'overrides'),
  )
  cells = [[h for _, h in columns]] + [[fmt(r.get(k)) for k, _ in columns] for r in rows]
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  lines = []
  for j, c in enumerate(cells):
    lines.append('  '.join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
    if j == 0:
      lines.append('  '.join('-' * w for w in widths))
  for r in rows:
    if r['status'] != 'ok' and r.get('log_tail'):
      lines.append(f'{r["name"]} ({r["status"]}), log tail:')
      lines += ['    ' + l for l in r['log_tail'][-tail_lines:]]
  return '\n'.join(lines)


def _csv_cell(row: dict, key: str):
  v = row.get(key)
  if key == 'log_tail':  # only where it explains something: runs that did not succeed
    return ' | '.join(v[-3:]) if v and row.get('status') != 'ok' else ''
  return '' if v is None else v


def write_csv(path: str, rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> None:
  with open(path, 'w', newline='') as f:
    w = csv.writer(f)
    w.writerow(columns)
    for r in rows:
      w.writerow([_csv_cell(r, k) for k in columns])


def write_json(path: str, payload: dict) -> None:
  with open(path, 'w') as f:
    json.dump(payload, f, indent=1)


# ------------------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one `sweep: ...` line (SweepError), not usage + message."""

  def error(self, message):
    raise SweepError(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = _Parser(
      prog='launch/sweep.py',
      description=__doc__.split('\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument('--config', required=True, help='config file[:variant], as for digen_jax.main')
  p.add_argument('--root', required=True, help='one workdir per run under here')
  p.add_argument('--grid', action='append', default=[], help='config.KEY=V1,V2,... (repeatable)')
  p.add_argument('--run', action='append', default=[], help='"NAME:--config.K=V ..." (repeatable)')
  p.add_argument('--runs_file', default=None, help='lines "NAME: --config.K=V ..."')
  p.add_argument(
      '--set',
      action='append',
      default=[],
      dest='common',
      help='--config.K=V for every run (repeatable; write --set=--config.K=V)',
  )
  p.add_argument('--parallel', type=int, default=1, help='runs at a time')
  p.add_argument('--pin', action='store_true', help='pin each parallel slot to its own cores')
  p.add_argument('--num_processes', type=int, default=1, help='> 1: each run via launch/local.py')
  p.add_argument(
      '--devices_per_process',
      type=int,
      default=None,
      help='forced host-platform (CPU) devices per process',
  )
  p.add_argument('--timeout_s', type=float, default=0.0, help='per run; 0 = none')
  p.add_argument('--fresh', action='store_true', help='delete existing workdirs (else resume)')
  p.add_argument('--csv', default=None, help='default ROOT/sweep_summary.csv')
  p.add_argument('--json', default=None, help='default ROOT/sweep_summary.json')
  p.add_argument('--dry_run', action='store_true', help='print the commands and stop')
  a = p.parse_args(argv)
  if a.parallel < 1:
    raise SweepError(f'--parallel={a.parallel} must be >= 1')
  if a.num_processes < 1:
    raise SweepError(f'--num_processes={a.num_processes} must be >= 1')
  if a.devices_per_process is not None and a.devices_per_process < 1:
    raise SweepError(f'--devices_per_process={a.devices_per_process} must be >= 1')
  if not 0 <= a.timeout_s < float('inf'):  # also NaN
    raise SweepError(f'--timeout_s={a.timeout_s} must be a finite number >= 0 (0 = none)')
  return a


def _join_set(argv: list[str]) -> list[str]:
  """`--set --config.K=V` -> `--set=--config.K=V` (argparse would read the value as a flag)."""
  out, i = [], 0
  while i < len(argv):
    if argv[i] == '--set' and i + 1 < len(argv):
      out.append('--set=' + argv[i + 1])
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    a = parse_args(_join_set(argv))
    explicit = [parse_run(s) for s in a.run]
    if a.runs_file:
      explicit += read_runs_file(a.runs_file)
    for w in a.common:
      parse_override(w)
    runs = build_runs(
        grid=a.grid,
        runs=explicit,
        common=a.common,
        num_processes=a.num_processes,
        devices_per_process=a.devices_per_process,
        pin=a.pin,
    )
    problems = check_keys(a.config, runs)
    if problems:
      name, msg = next(iter(problems.items()))
      raise SweepError(
          f'run {name!r}: {msg}'
          + (f' (and {len(problems) - 1} more runs)' if len(problems) > 1 else '')
      )
  except SweepError as e:
    print(f'sweep: {e}', file=sys.stderr)
    return 2
  if a.dry_run:
    for run in runs:
      argv_, _ = run_command(run, a.config, os.path.join(a.root, run.name))
      print(f'{run.name}: {shlex.join(argv_)}')
    return 0
  t0 = time.time()
  code = 0
  try:
    rows = run_sweep(
        runs, a.config, a.root, parallel=a.parallel, fresh=a.fresh, timeout_s=a.timeout_s
    )
  except Interrupted as e:
    code, rows = 128 + e.signum, e.rows
  print(format_table(rows), flush=True)
  csv_path = a.csv or os.path.join(a.root, 'sweep_summary.csv')
  json_path = a.json or os.path.join(a.root, 'sweep_summary.json')
  write_csv(csv_path, rows)
  write_json(
      json_path,
      {
          'config': a.config,
          'root': a.root,
          'argv': argv,
          'started': t0,
          'wall_s': time.time() - t0,
          'runs': rows,
      },
  )
  print(f'[sweep] summary: {csv_path} {json_path}')
  if code:
    return code
  return 0 if all(r['status'] == 'ok' for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
