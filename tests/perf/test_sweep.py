"""launch/sweep.py: input parsing and its one-line errors, per-run summaries from metrics.jsonl,
launch commands, and real sweeps of configs/qwenimage.py:tiny (failures, timeouts, resume, fresh,
parallel pinned jobs, two processes through launch/local.py)."""

import csv
import json
import os
import statistics
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, 'launch'))
import sweep  # noqa: E402  (launch/ is not a package)

from tests.mp_scripts import launcher_util  # noqa: E402

TINY = os.path.join(REPO, 'configs', 'qwenimage.py') + ':tiny'
TINY_DISAGG = os.path.join(REPO, 'configs', 'qwenimage.py') + ':tiny_disagg'


# ------------------------------------------------------------------------------------ parsing


def test_grid_is_the_cartesian_product_named_by_values():
  axes = sweep.parse_grid(['config.optim.lr=1e-4,3e-4', '--config.rl.group_size=4,8'])
  assert axes == [('optim.lr', ['1e-4', '3e-4']), ('rl.group_size', ['4', '8'])]
  points = sweep.grid_points(axes)
  assert [n for n, _ in points] == [
      'lr=1e-4,group_size=4',
      'lr=1e-4,group_size=8',
      'lr=3e-4,group_size=4',
      'lr=3e-4,group_size=8',
  ]
  assert points[1][1] == ('--config.optim.lr=1e-4', '--config.rl.group_size=8')
  # ';' separates values that contain commas (tuples); same last component -> the whole path.
  axes = sweep.parse_grid(
      ['config.cluster.rollout.devices=0,1;2,3', 'config.cluster.trainer.devices=4']
  )
  assert axes[0] == ('cluster.rollout.devices', ['0,1', '2,3'])
  assert [n for n, _ in sweep.grid_points(axes)] == [
      'cluster.rollout.devices=0,1,cluster.trainer.devices=4',
      'cluster.rollout.devices=2,3,cluster.trainer.devices=4',
  ]


@pytest.mark.parametrize(
    'spec, match',
    [
        ('config.optim.lr=', 'empty grid'),
        ('config.optim.lr=1,,2', 'empty value'),
        ('config.optim.lr=1,1', 'repeated value'),
        ('optim.lr=1,2', 'write config.KEY=V1,V2'),
        ('--config.optim.lr', 'write config.KEY=V1,V2'),
    ],
)
def test_bad_grid(spec, match):
  with pytest.raises(sweep.SweepError, match=match):
    sweep.parse_grid([spec])


def test_runs_and_precedence():
  assert sweep.parse_run('base:') == ('base', ())
  name, words = sweep.parse_run("a: --config.seed=1 --config.data.prompts='/tmp/my prompts.txt'")
  assert name == 'a' and words == ('--config.seed=1', '--config.data.prompts=/tmp/my prompts.txt')
  for bad, match in [
      ('--config.seed=1', 'NAME before a colon'),
      ('a:seed=1', 'not an override'),
      ('a b:--config.seed=1', 'run name'),
      ('a:--workdir=/x', 'not an override'),
      ('a:--config.seed=1 --config.seed=2', 'set twice'),
  ]:
    with pytest.raises(sweep.SweepError, match=match):
      sweep.parse_run(bad)
  # common < run < grid; explicit runs x grid points.
  runs = sweep.build_runs(
      grid=['config.optim.lr=1,2'],
      runs=[('a', ('--config.seed=1', '--config.optim.lr=9')), ('b', ())],
      common=('--config.total_steps=3', '--config.seed=0'),
      num_processes=2,
  )
  assert [r.name for r in runs] == ['a-lr=1', 'a-lr=2', 'b-lr=1', 'b-lr=2']
  assert runs[0].overrides == ('--config.total_steps=3', '--config.seed=1', '--config.optim.lr=1')
  assert runs[3].overrides == ('--config.total_steps=3', '--config.seed=0', '--config.optim.lr=2')
  assert all(r.num_processes == 2 for r in runs)
  with pytest.raises(sweep.SweepError, match='duplicate run name'):
    sweep.build_runs(runs=[('a', ()), ('a', ('--config.seed=1',))])
  with pytest.raises(sweep.SweepError, match='nothing to run'):
    sweep.build_runs()


def test_runs_file(tmp_path):
  f = tmp_path / 'runs.txt'
  f.write_text('# ablation\nbase:\nsmall_lr: --config.optim.lr=1e-5  # lower\n\n')
  assert sweep.read_runs_file(str(f)) == [('base', ()), ('small_lr', ('--config.optim.lr=1e-5',))]
  f.write_text('x: --config.seed=1\nbroken --config.seed=2\n')
  with pytest.raises(sweep.SweepError, match='runs.txt:2:'):
    sweep.read_runs_file(str(f))


def test_unknown_keys_are_found_in_the_config():
  runs = sweep.build_runs(
      runs=[
          ('ok', ('--config.optim.lr=1',)),
          ('typo', ('--config.optim.lrr=1', '--config.seed.x=2')),
      ]
  )
  assert sweep.check_keys(TINY, runs) == {
      'typo': f'{TINY} has no field config.optim.lrr, config.seed.x (unknown key)'
  }
  config = sweep.load_config(TINY)
  assert sweep.has_field(config, 'cluster.rollout.param_dtype')
  assert not sweep.has_field(config, 'cluster.rollout.nope')
  with pytest.raises(sweep.SweepError, match='unknown variant'):
    sweep.load_config(TINY.replace(':tiny', ':nope'))
  with pytest.raises(sweep.SweepError, match='no such file'):
    sweep.load_config('configs/nope.py')


@pytest.mark.parametrize(
    'args, match',
    [
        (['--grid', 'config.optim.lr='], 'empty grid'),
        (['--grid', 'config.optim.lrr=1,2'], 'has no field config.optim.lrr'),
        (['--run', 'a:--config.seed=1', '--run', 'a:--config.seed=2'], 'duplicate run name'),
        (['--run', 'a:seed=1'], 'not an override'),
        (['--run', 'a:', '--set', 'seed=1'], 'not an override'),
        (['--run', 'a:', '--parallel=0'], '--parallel=0'),
        (['--run', 'a:', '--bogus'], 'unrecognized arguments'),
        ([], 'nothing to run'),
    ],
)
def test_cli_bad_input_is_one_line_before_anything_runs(tmp_path, capsys, args, match):
  root = tmp_path / 'root'
  code = sweep.main([f'--config={TINY}', f'--root={root}', *args])
  err = capsys.readouterr().err
  assert code == 2 and err.startswith('sweep: ') and match in err
  assert err.count('\n') == 1, err
  assert not root.exists()


def test_dry_run_prints_commands(tmp_path, capsys):
  code = sweep.main(
      [
          f'--config={TINY}',
          f'--root={tmp_path}',
          '--grid',
          'config.seed=1,2',
          '--set',
          '--config.total_steps=2',
          '--num_processes=2',
          '--pin',
          '--dry_run',
      ]
  )
  out = capsys.readouterr().out.splitlines()
  assert code == 0 and len(out) == 2
  assert (
      out[0].startswith('seed=1: ')
      and 'launch/local.py --num_processes=2 --cpu_pinning --' in out[0]
  )
  assert (
      f'--workdir={tmp_path}/seed=2' in out[1]
      and '--config.total_steps=2 --config.seed=2' in out[1]
  )
  assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- commands, cores


def test_run_command(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4 --xla_foo=1')
  run = sweep.Run('r', ('--config.seed=1',), devices_per_process=2)
  argv, env = sweep.run_command(run, 'c.py:x', '/w', python='py')
  assert argv == [
      'py',
      '-m',
      'digen_jax.main',
      '--config=c.py:x',
      '--workdir=/w',
      '--config.seed=1',
  ]
  assert env['XLA_FLAGS'].split() == ['--xla_foo=1', '--xla_force_host_platform_device_count=2']
  assert env['PYTHONPATH'].split(os.pathsep)[0] == REPO
  run = sweep.Run('r', (), num_processes=2, devices_per_process=3, pin=True)
  argv, env = sweep.run_command(run, 'c.py', '/w', python='py')
  assert argv[:5] == [
      'py',
      sweep.LOCAL_LAUNCHER,
      '--num_processes=2',
      '--devices_per_process=3',
      '--cpu_pinning',
  ]
  assert argv[5:8] == ['--', 'py', '-m']
  assert env['XLA_FLAGS'].startswith('--xla_force_host_platform_device_count=4')  # local.py sets it


def test_slot_cores():
  assert sweep.slot_cores(1, [0, 1, 2, 3]) == [[0, 1, 2, 3]]
  assert sweep.slot_cores(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]
  assert sweep.slot_cores(3, [5, 7]) == [[5], [7], [5]]


# ------------------------------------------------------------------------------ summaries


def _write_rows(workdir, rows):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')


def test_summary_skips_the_compiling_step_of_each_invocation(tmp_path):
  w = str(tmp_path)
  train = lambda s, sps, util: {
      'step': s,
      'reward_mean': -s / 10,
      'samples_per_s': sps,
      'utilization': util,
  }
  _write_rows(
      w,
      [{'step': 0, 'eval/strict_accuracy': 0.1, 'eval/reward_mean': -1.0}]
      + [train(1, 1.0, 0.2), train(2, 10.0, 0.8), train(3, 12.0, 0.9)],
  )
  # Not started by the sweep: only its very first step is taken as compiling.
  s = sweep.summarize_workdir(w)
  assert s['steps'] == 3 and s['samples_per_s'] == 11.0
  assert s['utilization'] == pytest.approx(0.85) and s['reward_mean'] == pytest.approx(-0.3)
  assert s['eval_strict_accuracy'] == 0.1 and s['eval_reward_mean'] == -1.0
  # A resumed invocation re-ran step 3 (the last row of a step wins) and compiled again at 3.
  sweep.record_first_step(w, 1)
  sweep.record_first_step(w, 3)
  _write_rows(
      w,
      [
          train(3, 2.0, 0.3),
          train(4, 20.0, 0.7),
          train(5, 30.0, 0.6),
          train(6, 40.0, 0.5),
          {'step': 6, 'eval/strict_accuracy': 0.5, 'eval/reward_mean': -0.5},
      ],
  )
  s = sweep.summarize_workdir(w)
  assert s['steps'] == 6 and s['samples_per_s'] == statistics.median([10.0, 20.0, 30.0, 40.0])
  assert s['utilization'] == pytest.approx((0.8 + 0.7 + 0.6 + 0.5) / 4)
  assert s['eval_strict_accuracy'] == 0.5 and s['reward_mean'] == pytest.approx(-0.6)
  assert json.load(open(os.path.join(w, sweep.STATE_FILE))) == {'first_steps': [1, 3]}


def test_summary_of_a_run_without_metrics(tmp_path):
  s = sweep.summarize_workdir(str(tmp_path / 'never_ran'))
  assert s['steps'] == 0 and s['samples_per_s'] is None and s['eval_strict_accuracy'] is None
  _write_rows(str(tmp_path), [{'step': 1, 'reward_mean': 0.0, 'samples_per_s': 5.0}])
  assert sweep.summarize_workdir(str(tmp_path))['samples_per_s'] is None  # only the compiling step


def test_table_and_csv(tmp_path):
  rows = [
      {
          'name': 'a',
          'status': 'ok',
          'exit_code': 0,
          'steps': 3,
          'samples_per_s': 12.3456,
          'overrides': '--config.seed=1',
          'log_tail': ['fine'],
      },
      {
          'name': 'b',
          'status': 'failed',
          'exit_code': 1,
          'steps': 0,
          'samples_per_s': None,
          'overrides': '',
          'log_tail': ['x', 'digen_jax: config.sampler.sde=bogus'],
      },
  ]
  table = sweep.format_table(rows).splitlines()
  assert table[0].split()[:4] == ['run', 'status', 'exit', 'steps']
  assert table[2].split()[:5] == ['a', 'ok', '0', '3', '12.35']
  assert (
      'b (failed), log tail:' in table
      and table[-1].strip() == 'digen_jax: config.sampler.sde=bogus'
  )
  sweep.write_csv(str(tmp_path / 's.csv'), rows)
  got = list(csv.DictReader(open(tmp_path / 's.csv')))
  assert got[0]['samples_per_s'] == '12.3456' and got[0]['log_tail'] == ''
  assert got[1]['samples_per_s'] == '' and got[1]['log_tail'].endswith('sde=bogus')


# ---------------------------------------------------------------------------- real sweeps


def _sweep(root, *args):
  return sweep.main([f'--config={TINY}', f'--root={root}', '--devices_per_process=2', *args])


@pytest.mark.slow
def test_sweep_reports_metrics_and_failures(tmp_path, capsys):
  """One 2-step tiny run and one that fails at its start (more devices than its process has:
  values the sweep cannot check itself): both in the table; the sweep exits 1."""
  root = tmp_path / 'sw'
  code = _sweep(
      root,
      '--set',
      '--config.total_steps=2',
      '--run',
      'ok:--config.optim.lr=3e-4',
      '--run',
      'bad:--config.runtime.num_devices=64',
  )
  out = capsys.readouterr().out
  assert code == 1
  rows = {r['name']: r for r in json.load(open(root / 'sweep_summary.json'))['runs']}
  ok, bad = rows['ok'], rows['bad']
  assert ok['status'] == 'ok' and ok['exit_code'] == 0 and ok['steps'] == 2
  metrics = [json.loads(l) for l in open(root / 'ok' / 'metrics.jsonl')]
  assert ok['samples_per_s'] == metrics[1]['samples_per_s']  # step 1 compiled: excluded
  assert (
      ok['utilization'] == metrics[1]['utilization']
      and ok['reward_mean'] == metrics[1]['reward_mean']
  )
  assert ok['wall_s'] > 0 and ok['overrides'] == '--config.total_steps=2 --config.optim.lr=3e-4'
  assert bad['status'] == 'failed' and bad['exit_code'] == 1 and bad['steps'] == 0
  assert 'digen_jax: config.runtime.num_devices=64 but only 2 local devices' in bad['log_tail'][-1]
  assert 'bad (failed), log tail:' in out
  table = list(csv.DictReader(open(root / 'sweep_summary.csv')))
  assert [r['name'] for r in table] == ['ok', 'bad'] and table[1]['status'] == 'failed'


def test_timeout_stops_the_run(tmp_path, capsys):
  root = tmp_path / 'sw'
  code = _sweep(root, '--run', 'slow:', '--timeout_s=0.5')
  assert code == 1
  (row,) = json.load(open(root / 'sweep_summary.json'))['runs']
  assert row['status'] == 'timeout' and row['exit_code'] != 0 and row['wall_s'] < 30


@pytest.mark.slow
def test_parallel_pinned_sweep_resumes_and_fresh_restarts(tmp_path, capsys):
  root = tmp_path / 'sw'
  common = ['--set', '--config.total_steps=3', '--parallel=2', '--pin']
  args = ['--grid', 'config.optim.lr=1e-4,3e-4', *common]
  assert _sweep(root, *args) == 0
  assert 'on cores [' in capsys.readouterr().out
  first = {r['name']: r for r in json.load(open(root / 'sweep_summary.json'))['runs']}
  assert set(first) == {'lr=1e-4', 'lr=3e-4'}
  for name, r in first.items():
    assert r['status'] == 'ok' and r['steps'] == 3 and r['samples_per_s'] > 0
    assert json.load(open(root / name / sweep.STATE_FILE)) == {'first_steps': [1]}
  # Again without --fresh (one invocation, both runs resume from their last checkpoint): 3e-4 at
  # the same step count runs no step and keeps its figures; 1e-4, now to 5 steps, excludes the
  # resumed invocation's first step (4) too, which compiles.
  assert (
      _sweep(
          root,
          '--run',
          'lr=1e-4:--config.optim.lr=1e-4 --config.total_steps=5',
          '--run',
          'lr=3e-4:--config.optim.lr=3e-4',
          *common,
      )
      == 0
  )
  again = {r['name']: r for r in json.load(open(root / 'sweep_summary.json'))['runs']}
  assert set(again) == set(first)
  r = again['lr=3e-4']
  assert r['status'] == 'ok' and r['steps'] == 3
  assert r['samples_per_s'] == first['lr=3e-4']['samples_per_s']
  assert json.load(open(root / 'lr=3e-4' / sweep.STATE_FILE)) == {'first_steps': [1]}
  assert json.load(open(root / 'lr=1e-4' / sweep.STATE_FILE)) == {'first_steps': [1, 4]}
  assert again['lr=1e-4']['status'] == 'ok' and again['lr=1e-4']['steps'] == 5
  for name, lines in (('lr=1e-4', 5), ('lr=3e-4', 3)):
    assert 'resumed from' in open(root / name / sweep.LOG_FILE).read()
    assert len(open(root / name / 'metrics.jsonl').readlines()) == lines
  # --fresh: the workdir starts empty.
  assert (
      _sweep(root, '--grid', 'config.optim.lr=1e-4', '--set', '--config.total_steps=2', '--fresh')
      == 0
  )
  assert len(open(root / 'lr=1e-4' / 'metrics.jsonl').readlines()) == 2
  assert 'resumed from' not in open(root / 'lr=1e-4' / sweep.LOG_FILE).read()


def test_sigterm_inside_popen_stops_that_run_and_reports_every_run(tmp_path):
  """The signal lands while Popen is starting the first run (after its fork, before the run is
  recorded): that run is still stopped and reported, none is left running, none is lost."""
  import signal
  import threading

  assert threading.current_thread() is threading.main_thread()  # run_sweep sets the handlers
  root = tmp_path / 'sw'
  with launcher_util.signal_after_first_fork(signal.SIGTERM):
    with pytest.raises(sweep.Interrupted) as e:
      sweep.run_sweep([sweep.Run('a', ()), sweep.Run('b', ())], TINY, str(root), log=lambda _: 0)
  assert e.value.signum == signal.SIGTERM
  rows = {r['name']: r for r in e.value.rows}
  assert set(rows) == {'a', 'b'}
  assert rows['a']['status'] == 'interrupted' and rows['a']['exit_code'] is not None
  assert rows['b']['status'] == 'interrupted' and rows['b']['exit_code'] is None
  assert launcher_util.procs_mentioning(f'--workdir={root}/') == []
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the caller's handler is back


@pytest.mark.slow
def test_two_process_runs_through_local_launcher(tmp_path, capsys):
  root = tmp_path / 'sw'
  code = sweep.main(
      [
          f'--config={TINY_DISAGG}',
          f'--root={root}',
          '--run',
          'mp2:',
          '--set',
          '--config.total_steps=2',
          '--num_processes=2',
          '--devices_per_process=1',
          '--pin',
          '--timeout_s=300',
      ]
  )
  (row,) = json.load(open(root / 'sweep_summary.json'))['runs']
  assert code == 0, row['log_tail']
  assert row['status'] == 'ok' and row['steps'] == 2 and row['samples_per_s'] > 0
  assert 0 < row['utilization'] <= 1
  log = open(root / 'mp2' / sweep.LOG_FILE).read()
  assert '[0] ' in log and '[1] ' in log  # both processes' lines, prefixed by local.py


def test_invalid_runs_are_reported_not_run(tmp_path):
  stale = tmp_path / 'gap'
  _write_rows(str(stale), [{'step': s, 'reward_mean': 0.0, 'samples_per_s': 9.0} for s in (1, 2)])
  runs = [sweep.Run('gap', ('--config.schedule.nope=4',))]
  lines = []
  rows = sweep.run_sweep(
      runs,
      TINY,
      str(tmp_path),
      fresh=True,
      log=lines.append,
      invalid={'gap': 'no field config.schedule.nope'},
  )
  assert rows[0]['status'] == 'invalid' and rows[0]['exit_code'] is None
  assert rows[0]['steps'] == 0 and rows[0]['samples_per_s'] is None  # not the stale workdir's
  assert rows[0]['log_tail'] == ['no field config.schedule.nope'] and not stale.exists()
  assert lines == ['[sweep] gap: not run: no field config.schedule.nope']


def test_sigterm_stops_the_running_run_and_writes_the_summary(tmp_path):
  import signal
  import subprocess
  import time

  root = tmp_path / 'sw'
  proc = subprocess.Popen(
      [
          sys.executable,
          os.path.join(REPO, 'launch', 'sweep.py'),
          f'--config={TINY}',
          f'--root={root}',
          '--run',
          'a:',
          '--run',
          'b:',
          '--devices_per_process=2',
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  log = root / 'a' / sweep.LOG_FILE
  deadline = time.monotonic() + 30
  while (
      not (log.exists() and launcher_util.procs_mentioning(f'--workdir={root}/a'))
      and time.monotonic() < deadline
  ):
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM, out
  rows = {r['name']: r for r in json.load(open(root / 'sweep_summary.json'))['runs']}
  assert rows['a']['status'] == 'interrupted' and rows['b']['status'] == 'interrupted'
  assert rows['b']['exit_code'] is None and not (root / 'b').exists()
  assert launcher_util.procs_mentioning(f'--workdir={root}/') == []
