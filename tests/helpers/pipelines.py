"""digen_jax.main on a tiny diffusers pipeline folder with torch made unimportable in the
training process, in one process or two, and the metrics rows it wrote."""

import json
import os
import subprocess
import sys

from tests.helpers.paths import REPO
from tests.mp_scripts import launcher_util

QWEN_CONFIG = os.path.join(REPO, 'configs', 'qwenimage.py')

# Runs digen_jax.main with torch (and transformers) made unimportable in this process only: the
# tiny pipeline is built and the prompts encoded in child processes, which are unaffected.
NO_TORCH_MAIN = r"""
import sys
class _Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('torch', 'transformers'):
      raise ImportError(f'{name} imported in the training process')
    return None
sys.meta_path.insert(0, _Block())
import runpy
sys.argv = ['digen_jax.main'] + sys.argv[1:]
runpy.run_module('digen_jax.main', run_name='__main__')
"""


def flags(folder, workdir, variant='tiny_pipeline', *extra, config=QWEN_CONFIG):
  return [
      f'--config={config}:{variant}',
      f'--workdir={workdir}',
      f'--config.model.checkpoint={folder}',
      f'--config.text.cache={folder}/text_cache',
      f'--config.data.data_dir={folder}/data',
      *extra,
  ]


def run_main(folder, workdir, *extra, variant='tiny_pipeline', config=QWEN_CONFIG):
  """digen_jax.main of `config` (configs/qwenimage.py unless another family's) with torch
  blocked."""
  env = dict(os.environ, PYTHONPATH=REPO)
  r = subprocess.run(
      [
          sys.executable,
          '-c',
          NO_TORCH_MAIN,
          *flags(folder, workdir, variant, *extra, config=config),
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  return r


def run_main_two_processes(
    folder, workdir, *extra, variant='tiny_pipeline,disagg', config=QWEN_CONFIG
):
  """run_main over two processes (launch/local.py, jax.distributed on 127.0.0.1)."""
  code, out = launcher_util.run(
      ['--num_processes=2'],
      [
          sys.executable,
          '-c',
          NO_TORCH_MAIN,
          *flags(folder, workdir, variant, *extra, config=config),
      ],
      timeout_s=900,
  )
  assert code == 0, out[-5000:]
  return out


def metrics_rows(workdir):
  """The rows of <workdir>/metrics.jsonl."""
  return [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
