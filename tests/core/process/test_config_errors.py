"""An override that leaves the config names itself, the section it reaches and the nearest valid
fields (process/config_errors.py), in every entry point that takes --config, plan included."""

import os
import subprocess
import sys

from digen_jax.process import config_errors
from tests.helpers.paths import REPO

SHAPES = '--config=' + os.path.join(REPO, 'configs/shapes.py')


def test_a_misspelt_field_names_the_override_the_section_and_the_nearest_fields():
  said = config_errors.unknown_field([SHAPES, '--config.rl.grup_size=3'], 'grup_size')
  assert said.startswith("--config.rl.grup_size: config.rl has no field 'grup_size'; nearest: ")
  assert 'group_size' in said.split(';')[1] and 'config.rl has: ' in said


def test_a_missing_section_and_a_field_of_a_leaf():
  said = config_errors.unknown_field([SHAPES, '--config.rll.group_size=3'])
  assert "config has no field 'rll' (so no config.rll.group_size); nearest: rl" in said
  said = config_errors.unknown_field([SHAPES, '--config.seed.x=3'])
  assert said == "--config.seed.x: config.seed = 0 (int), not a section: it has no field 'x'"


def test_the_override_that_breaks_is_the_one_reported():
  argv = [SHAPES, '--config.rl.group_size=4', '--config.optim.lrr=1', '--config.rl.bad=2']
  assert config_errors.unknown_field(argv, 'bad').startswith('--config.rl.bad:')
  assert config_errors.unknown_field(argv).startswith('--config.optim.lrr:')
  assert config_errors.unknown_field([SHAPES, '--config.rl.group_size=4']) is None
  assert config_errors.unknown_field(['--config=/no/such/file.py', '--config.x=1']) is None


def test_plan_says_it_in_one_line():
  r = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.plan',
          SHAPES,
          '--cluster=8xH100',
          '--config.rl.grup_size=1',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 1 and 'Traceback' not in r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1, r.stderr
  assert lines[0].startswith('digen_jax.plan: bad --config: --config.rl.grup_size: config.rl has ')
