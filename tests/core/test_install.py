"""The set-up installs the package (requirements.txt's `-e .`): the entry points and a user's own
reward module run from any directory, without PYTHONPATH, and a config given by its path in the
checkout (configs/shapes.py) is found from there too."""

import importlib.metadata
import os
import subprocess
import sys

from tests.helpers.paths import REPO


def test_requirements_install_the_package_editable():
  with open(os.path.join(REPO, 'requirements.txt')) as f:
    assert '-e .' in [l.strip() for l in f]
  # This environment was set up from it: digen_jax is an installed distribution.
  assert importlib.metadata.distribution('digen_jax').metadata['Name'] == 'digen_jax'


def test_main_runs_from_any_directory(tmp_path):
  """From a user's own folder (no PYTHONPATH): the package imports, configs/shapes.py resolves
  to the checkout's, and the user's reward module beside them is importable by name. The run
  stops at config load on the one field left bad on purpose, after the reward was imported."""
  (tmp_path / 'my_reward.py').write_text(
      'import numpy as np\n\ndef score(images, prompts):\n'
      '  return np.zeros(len(images), np.float32)\n'
  )
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  base = [
      sys.executable,
      '-m',
      'digen_jax.main',
      '--config=configs/shapes.py',
      f'--workdir={tmp_path / "wd"}',
      '--config.data.prompts=',
  ]

  def run(callable_spec):
    return subprocess.run(
        base + [f'--config.reward.callables={callable_spec}', '--config.reward.weights=mine'],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

  r = run('mine=my_reward:score')
  assert r.returncode == 1, r.stderr[-2000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith('digen_jax: config.data.prompts is empty'), r.stderr[-2000:]
  assert 'Traceback' not in r.stderr
  # The same command with a module that does not exist fails on the reward instead: the first
  # run really imported my_reward from the user's folder.
  r = run('mine=no_such_module:score')
  assert r.returncode == 1 and 'config.reward.callables' in r.stderr, r.stderr[-2000:]
