"""python -m digen_jax.perf's documented form: --config profiles the config on this machine, then
predicts the ladder (it used to require --profile and had no --config)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


def _sim(*args, timeout=900):
  cmd = [sys.executable, '-m', 'digen_jax.perf', *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


BAD_ARGUMENTS = [
    (['--json=/tmp/x.json'], 'one of the arguments --profile --config is required'),
    (['--config=configs/shapes.py', '--profile=p.json', '--json=x'], 'not allowed with'),
    (['--config=configs/nope.py', '--json=x'], 'configs/nope.py: no such file'),
    (['--profile=p.json', '--json=x', '--config.seed=1'], 'overrides need --config'),
    (['--config=configs/shapes.py', '--json=x', '--bogus=1'], 'unrecognized arguments'),
    (['--config=configs/shapes.py', '--json=x', '--repeats=0'], 'needs --config and a value >= 1'),
]


def test_bad_arguments_fail_in_one_line_from_the_command():
  args, message = BAD_ARGUMENTS[0]
  r = _sim(*args, timeout=60)
  assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize('args,message', BAD_ARGUMENTS)
def test_bad_arguments_fail_in_one_line(args, message, monkeypatch, capsys):
  """The command's own argument parsing (its main, in this process: an interpreter a case
  would cost ~4 s of imports; the command itself is the test above)."""
  from digen_jax.perf import __main__ as sim  # pylint: disable=g-import-not-at-top

  monkeypatch.chdir(REPO)  # the config paths are the repository's
  with pytest.raises(SystemExit) as e:
    sim.main(args)
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err, err


@pytest.mark.slow
def test_config_form_profiles_then_predicts(tmp_path):
  out = tmp_path / 'sim.json'
  r = _sim(
      '--config=configs/shapes.py:pixel',
      f'--json={out}',
      '--rungs=colocated,disagg',
      '--variants=sp',
      '--steps=3',
      '--repeats=1',  # one timed call per program: the profile's keys, not its precision
      '--config.rl.prompts_per_step=4',  # no --fragments: M = 4, the largest that divides it
  )
  assert r.returncode == 0, r.stderr[-3000:]
  doc = json.loads(out.read_text())
  profile = json.loads((tmp_path / 'sim.json.profile.json').read_text())
  assert set(profile['layouts']) == {'colocated', 'sp'}
  # The fragments were also sampled as the runtime samples them (each scored beside the next).
  seconds = profile['layouts']['sp']['seconds']
  assert {'rollout_piped/8', 'rollout_host/8'} <= set(seconds), sorted(seconds)
  assert '--config.rl.prompts_per_step=4' in profile['argv'] and '--repeats=1' in profile['argv']
  modes = doc['modes']
  assert modes['colocated']['samples_per_s'] > 0 and modes['disagg']['samples_per_s'] > 0
  assert profile['layouts']['sp']['fragments'] == 4


def test_the_fragment_count_defaults_to_what_the_config_divides():
  """configs/shapes.py (8 prompts x 8): M = 8 groups or 16 samples, never the 16 groups its
  profile used to ask for (which validation refused: 16 must divide 8)."""
  from configs import shapes  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import profile  # pylint: disable=g-import-not-at-top

  c = shapes.get_config()
  assert profile.fragments_for(c, 'group', 0) == c.rl.prompts_per_step == 8
  assert profile.fragments_for(c, 'sample', 0) == 16
  assert profile.fragments_for(c, 'group', 2) == 2
  c.rl.prompts_per_step = 6
  assert profile.fragments_for(c, 'group', 0) == 2


def test_a_colocated_config_is_profiled_disaggregated_in_the_disagg_layouts():
  """configs/wan21.py:tiny is colocated: its sp and mp2 profiles run it disaggregated on the
  'auto' roles (it used to fail config validation: TAG needs separate meshes); a disaggregated
  config keeps its own roles; the colocated layout runs colocated."""
  from configs import wan21  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import profile  # pylint: disable=g-import-not-at-top

  config = wan21.get_config('tiny')
  assert config.runtime.mode == 'colocated'
  for layout in ('sp', 'mp2'):
    c = profile.layout_config(config, layout, 2, 'group')
    assert (c.runtime.mode, c.cluster.layout, c.schedule.tag) == ('disagg', 'auto', True)
  c = profile.layout_config(config, 'colocated', 2, 'group')
  assert (c.runtime.mode, c.schedule.tag) == ('colocated', False)
  explicit = wan21.get_config('tiny,disagg')
  explicit.cluster.layout = 'explicit'
  assert profile.layout_config(explicit, 'mp2', 2, 'group').cluster.layout == 'explicit'
  assert config.runtime.mode == 'colocated'  # the caller's config is not changed
