"""A bad model folder is one line from digen_jax.main, before anything compiles: a missing, extra
or mis-shaped key, a tensor of the wrong dtype, an unreadable or missing shard, a missing
component, a size flag that disagrees with the folder. Each line names the key (or the component), the file and what was expected; the exit
code is non-zero and there is no traceback. Each case corrupts a copy of one tiny diffusers
Qwen-Image folder (tests/helpers/model_folders.py) and runs main through tests/cli_zygote.py."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.helpers import model_folders
from tests.helpers.cli_cases import last_line, run_cases

pytestmark = pytest.mark.slow  # about a minute: 9 runs of main, one folder built

TRANSFORMER = 'transformer/diffusion_pytorch_model.safetensors'
VAE = 'vae/diffusion_pytorch_model.safetensors'


def _edit(folder, rel, fn):
  """fn(tensors) edits the {key: array} of folder/rel in place; the file is written back."""
  path = os.path.join(folder, rel)
  tensors = load_file(path)
  fn(tensors)
  save_file(tensors, path, metadata={'format': 'pt'})


def _shard(folder):
  """The transformer split into two shards with an index (as large releases are), then its
  second shard deleted."""
  path = os.path.join(folder, TRANSFORMER)
  tensors = load_file(path)
  os.remove(path)
  keys = sorted(tensors)
  names = [
      'diffusion_pytorch_model-00001-of-00002.safetensors',
      'diffusion_pytorch_model-00002-of-00002.safetensors',
  ]
  halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
  weight_map = {}
  for name, part in zip(names, halves):
    save_file({k: tensors[k] for k in part}, os.path.join(folder, 'transformer', name))
    weight_map.update(dict.fromkeys(part, name))
  with open(
      os.path.join(folder, 'transformer', 'diffusion_pytorch_model.safetensors.index.json'), 'w'
  ) as f:
    json.dump({'metadata': {}, 'weight_map': weight_map}, f)
  os.remove(os.path.join(folder, 'transformer', names[1]))


def _truncate(folder):
  path = os.path.join(folder, TRANSFORMER)
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.truncate(size - 1000)


# id: (corruption of the folder, what the one line must contain)
CASES = {
    'missing_key': (
        lambda d: _edit(d, TRANSFORMER, lambda t: t.pop('norm_out.linear.weight')),
        ['missing diffusers keys', 'norm_out.linear.weight', TRANSFORMER],
    ),
    'extra_key': (
        lambda d: _edit(
            d, TRANSFORMER, lambda t: t.update(extra_lora_A=np.zeros((2, 2), np.float32))
        ),
        ['unexpected diffusers keys', 'extra_lora_A', TRANSFORMER],
    ),
    'misshaped_key': (
        lambda d: _edit(
            d, TRANSFORMER, lambda t: t.update({'proj_out.bias': np.zeros((7,), np.float32)})
        ),
        ["'proj_out.bias' has shape (7,), expected", TRANSFORMER],
    ),
    'wrong_dtype': (
        lambda d: _edit(
            d, VAE, lambda t: t.update({'decoder.conv_out.bias': np.zeros((3,), np.int32)})
        ),
        ["'decoder.conv_out.bias'", 'has dtype I32, expected a floating-point tensor', VAE],
    ),
    'unreadable_shard': (_truncate, ['cannot read safetensors file', TRANSFORMER]),
    'missing_shard': (_shard, ['names missing files', '00002-of-00002.safetensors']),
    'missing_transformer': (
        lambda d: shutil.rmtree(os.path.join(d, 'transformer')),
        ['no config.json in', 'transformer'],
    ),
    # A size given on the command line must agree with the folder's.
    'size_flag_disagrees': (
        lambda d: None,
        [
            'config.model.joint_attention_dim=3584 but the model folder has 40',
            'transformer/config.json',
            'drop --config.model.joint_attention_dim',
        ],
        ['--config.model.joint_attention_dim=3584'],
    ),
    'image_size_not_a_multiple': (
        lambda d: None,
        [
            'config.latent.image_height=72 must be a positive multiple of 16',
            'vae/config.json',
            '--config.latent.image_height=80',
        ],
        ['--config.latent.image_height=72'],
    ),
    'missing_vae': (
        lambda d: shutil.rmtree(os.path.join(d, 'vae')),
        ["config.latent.space='vae'", 'vae/', 'config.model.checkpoint'],
    ),
}


def _flags(folder):
  """configs/qwenimage.py:tiny_pipeline on `folder` with the word encoder (no text cache); its
  sizes, unlike the config's, come from the folder."""
  return [
      '--config=configs/qwenimage.py:tiny_pipeline',
      f'--config.model.checkpoint={folder}',
      '--config.model.build_tiny_pipeline=False',
      '--config.text.encoder=word',
      '--config.text.cache=',
      '--config.text.max_length=16',
      '--config.total_steps=1',
      '--config.eval.every=0',
  ]


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  good = model_folders.qwenimage(str(tmp_path_factory.mktemp('good')))
  root = tmp_path_factory.mktemp('bad')
  cases = []
  for case_id, (corrupt, _, *extra) in CASES.items():
    folder = str(root / case_id)
    shutil.copytree(good, folder)
    corrupt(folder)
    workdir = str(root / f'{case_id}_run')
    flags = [*_flags(folder), *(extra[0] if extra else [])]
    cases.append((case_id, ['-m', 'digen_jax.main', f'--workdir={workdir}', *flags], workdir))
  # The intact folder builds (the corruptions are what the lines are about): a run of one step.
  cases.append(
      (
          'good',
          ['-m', 'digen_jax.main', f'--workdir={root / "good_run"}', *_flags(good)],
          str(root / 'good_run'),
      )
  )
  return run_cases(cases, timeout_s=300)


def test_the_intact_folder_trains(outcomes):
  r = outcomes['good']
  assert r['code'] == 0, r['stderr'][-3000:]


@pytest.mark.parametrize('case_id', list(CASES))
def test_a_bad_folder_is_one_line(outcomes, case_id):
  r = outcomes[case_id]
  line = last_line(r['stderr'])
  assert r['code'] == 1, (r['code'], r['stderr'][-3000:])
  assert 'Traceback' not in r['stderr'], r['stderr'][-3000:]
  assert line.startswith('digen_jax: '), r['stderr'][-3000:]
  for part in CASES[case_id][1]:
    assert part in line, (part, line)
