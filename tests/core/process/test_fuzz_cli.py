"""Bad input to every entry point: main, eval, pretrain, sweep and launch, fed
malformed configs and overrides (wrong types, negative or zero sizes, unknown keys, inconsistent
cluster specs, learning rates that would produce NaN), malformed prompt files (empty, binary,
huge lines, invalid UTF-8, NUL bytes) and corrupt checkpoints and caches.

Every case must end with ONE clear line (the last on stderr) naming the field or file and the
fix, a non-zero exit code, no traceback (so nothing failed inside jit), and nothing written to
the workdir; and a workdir that saw every failure must still run (slow test below).

The cases run through tests/cli_zygote.py: one process imports the libraries once and forks a
child per command line, which runs the entry point as `python -m ...` would (its own argv, exit
code and stderr). A cold interpreter per case would cost ~7 s here, the fork ~1 s.
"""

import glob
import json
import os
import re
import shutil

import pytest

from tests.helpers.cli_cases import last_line, run_cases, written
from tests.helpers.paths import REPO

TINY = '--config=configs/qwenimage.py:tiny'
DISAGG = (TINY, '--config.runtime.mode=disagg')
EXPLICIT = DISAGG + ('--config.cluster.layout=explicit',)
MAIN, EVAL, PRETRAIN = 'digen_jax.main', 'digen_jax.eval', 'digen_jax.tasks.shapes.pretrain'
PRE = '--config=configs/shapes_pretrain.py:test'


def _files(d):
  """Malformed inputs, written once per session."""
  os.makedirs(d, exist_ok=True)
  w = lambda name, data: open(os.path.join(d, name), 'wb').write(data)
  w('empty.txt', b'')
  w('binary.txt', bytes(range(256)) * 8)
  w('bad_utf8.txt', b'a red circle\n\xff\xfe two squares\n')
  w('huge_line.txt', b'a red circle ' * 20000 + b'\n')
  w('nul.txt', b'a red\x00 circle\n')
  w('blank_line.txt', b'a red circle\n\n')
  w('runs_binary.txt', b'\xd9\x00\xff' * 50)
  w('config_binary.py', b'\x00\x01 def get_config(): pass')
  w('config_raises.py', b'def get_config():\n  raise RuntimeError("broken config file")\n')
  w('config_decodes.py', b'x = b"\\xff".decode()\n')  # UnicodeDecodeError: 5-argument constructor
  w('config_no_get.py', b'a = 1\n')
  for name, damage in (('ckpt_truncated', 'truncate'), ('ckpt_bad_json', 'json')):
    folder = os.path.join(d, name)
    shutil.copytree(os.path.join(REPO, 'assets', 'shapes_base'), folder)
    if damage == 'truncate':
      with open(os.path.join(folder, 'params.safetensors'), 'r+b') as f:
        f.truncate(100_000)
    else:
      w(os.path.join(name, 'config.json'), b'{"format": ')
  # A prepared prompt dataset (tfds array_record) whose records file lost its second half.
  from digen_jax.data import prompts as prompt_data  # pylint: disable=g-import-not-at-top

  w('twelve.txt', ''.join(f'a red circle number {i}\n' for i in range(12)).encode())
  prompt_data.build_prompt_file_dataset(
      'twelve', {'train': os.path.join(d, 'twelve.txt')}, os.path.join(d, 'pdata')
  )
  (records,) = glob.glob(
      os.path.join(d, 'pdata', 'prompt_file', 'twelve', '*', '*train.array_record*')
  )
  with open(records, 'r+b') as f:
    f.truncate(os.path.getsize(records) // 2)
  os.makedirs(os.path.join(d, 'cache_no_index'))
  cache = os.path.join(d, 'cache_bad_index')
  os.makedirs(cache)
  w(os.path.join('cache_bad_index', 'index.json'), b'{"format": "digen_jax.embedding_cache/2", ')
  return d


# (id, module or script, args, substrings the last stderr line must hold). '{d}' is the folder
# of malformed inputs. Each main/eval/pretrain case gets its own fresh --workdir.
CASES = [
    # wrong types
    (
        'int_is_text',
        MAIN,
        [TINY, '--config.rl.group_size=abc'],
        ["config.rl.group_size=abc: invalid literal for int() with base 10: 'abc'"],
    ),
    ('int_is_float', MAIN, [TINY, '--config.total_steps=2.5'], ['config.total_steps=2.5']),
    ('bool_is_text', MAIN, [TINY, '--config.schedule.tsp=maybe'], ['config.schedule.tsp']),
    ('float_is_text', MAIN, [TINY, '--config.optim.lr=fast'], ['config.optim.lr=fast']),
    (
        'tuple_is_text',
        MAIN,
        [*DISAGG, '--config.cluster.trainer.devices=a,b'],
        ['config.cluster.trainer.devices'],
    ),
    # negative or zero sizes
    ('zero_steps', MAIN, [TINY, '--config.total_steps=0'], ['config.total_steps=0', '>= 1']),
    (
        'negative_prompts',
        MAIN,
        [TINY, '--config.rl.prompts_per_step=-2'],
        ['config.rl.prompts_per_step=-2', '>= 1'],
    ),
    ('group_of_one', MAIN, [TINY, '--config.rl.group_size=1'], ['config.rl.group_size=1', '>= 2']),
    (
        'zero_image',
        MAIN,
        [TINY, '--config.latent.height=0', '--config.latent.width=0'],
        ['config.latent.height=0', '>= 1'],
    ),
    ('negative_image', MAIN, [TINY, '--config.latent.width=-16'], ['config.latent.width=-16']),
    ('zero_layers', MAIN, [TINY, '--config.model.num_layers=0'], ['config.model.num_layers=0']),
    (
        'zero_heads',
        MAIN,
        [TINY, '--config.model.num_attention_heads=0'],
        ['config.model.num_attention_heads=0'],
    ),
    ('zero_text_length', MAIN, [TINY, '--config.text.max_length=0'], ['config.text.max_length=0']),
    (
        'one_sampling_step',
        MAIN,
        [TINY, '--config.sampler.num_steps=1'],
        ['config.sampler.num_steps=1', '>= 2'],
    ),
    (
        'zero_eval_batch',
        MAIN,
        [TINY, '--config.eval.every=1', '--config.eval.batch_size=0'],
        ['config.eval.batch_size=0'],
    ),
    (
        'negative_devices',
        MAIN,
        [TINY, '--config.runtime.num_devices=-1'],
        ['config.runtime.num_devices=-1', '0 = all local devices'],
    ),
    (
        'too_many_devices',
        MAIN,
        [TINY, '--config.runtime.num_devices=64'],
        ['config.runtime.num_devices=64', 'local devices'],
    ),
    (
        'zero_checkpoint_every',
        MAIN,
        [TINY, '--config.checkpoint_every=0'],
        ['config.checkpoint_every=0'],
    ),
    ('zero_keep', MAIN, [TINY, '--config.keep_checkpoints=0'], ['config.keep_checkpoints=0']),
    (
        'zero_fragments',
        MAIN,
        [TINY, '--config.schedule.fragments=0'],
        ['config.schedule.fragments=0'],
    ),
    (
        'zero_skips',
        MAIN,
        [TINY, '--config.runtime.max_consecutive_skips=0'],
        ['config.runtime.max_consecutive_skips=0'],
    ),
    (
        'negative_reward_timeout',
        MAIN,
        [TINY, '--config.reward.timeout_s=-1'],
        ['config.reward.timeout_s=-1'],
    ),
    ('negative_seed', MAIN, [TINY, '--config.seed=-1'], ['config.seed=-1']),
    (
        'negative_clip_range',
        MAIN,
        [TINY, '--config.rl.clip_range=-1'],
        ['config.rl.clip_range=-1', 'PPO epsilon'],
    ),
    (
        'fraction_above_one',
        MAIN,
        [TINY, '--config.rl.timesteps=random_fraction', '--config.rl.timestep_fraction=1.5'],
        ['config.rl.timestep_fraction=1.5'],
    ),
    # unknown keys, bad choices, broken config files
    (
        'unknown_key',
        MAIN,
        [TINY, '--config.rl.grup_size=3'],
        ["--config.rl.grup_size: config.rl has no field 'grup_size'; nearest: group_size"],
    ),
    (
        'unknown_section',
        MAIN,
        [TINY, '--config.nonexistent.x=1'],
        ["config has no field 'nonexistent' (so no config.nonexistent.x)", 'config has: '],
    ),
    (
        'field_of_a_leaf',
        MAIN,
        [TINY, '--config.optim.lr.x=1'],
        ['config.optim.lr = ', "(float), not a section: it has no field 'x'"],
    ),
    ('bad_choice', MAIN, [TINY, '--config.sampler.sde=ddim'], ['config.sampler.sde', 'flow_grpo']),
    (
        'typo_key',
        MAIN,
        [TINY, '--config.totl_steps=3'],
        ["--config.totl_steps: config has no field 'totl_steps'; nearest: total_steps"],
    ),
    ('unknown_variant', MAIN, ['--config=configs/qwenimage.py:big'], ['unknown variant']),
    (
        'real_size_without_weights',
        MAIN,
        ['--config=configs/qwenimage.py'],
        ['config.model.checkpoint is empty', 'configs/qwenimage.py:tiny'],
    ),
    (
        'channels_mismatch',
        MAIN,
        [TINY, '--config.model.in_channels=7'],
        ['config.model.in_channels=7 must equal'],
    ),
    ('step_loop_choice', MAIN, [TINY, '--config.rl.step_loop=map'], ['config.rl.step_loop']),
    (
        'reward_weight_text',
        MAIN,
        [TINY, '--config.reward.weights=shapes:x'],
        ["config.reward.weights: reward weights 'shapes:x': 'shapes:x' is not NAME or NAME:WEIGHT"],
    ),
    ('no_config_file', MAIN, ['--config=configs/nope.py'], ['cannot load --config', 'nope.py']),
    ('binary_config_file', MAIN, ['--config={d}/config_binary.py'], ['config_binary.py']),
    ('config_file_raises', MAIN, ['--config={d}/config_raises.py'], ['broken config file']),
    (
        'config_file_decode_error',
        MAIN,
        ['--config={d}/config_decodes.py'],
        ['config_decodes.py: it raised UnicodeDecodeError', "can't decode byte 0xff"],
    ),
    (
        'config_file_without_get_config',
        MAIN,
        ['--config={d}/config_no_get.py'],
        ['config_no_get.py: it defines no get_config()'],
    ),
    # the workdir
    (
        'workdir_is_a_file',
        MAIN,
        [TINY, '--workdir={d}/empty.txt'],
        ['--workdir=', 'empty.txt is a file, not a directory'],
    ),
    (
        'workdir_under_a_file',
        MAIN,
        [TINY, '--workdir={d}/empty.txt/run'],
        ['empty.txt/run cannot be created: Not a directory'],
    ),
    (
        'eval_workdir_is_a_file',
        EVAL,
        [TINY, '--workdir={d}/empty.txt'],
        ['empty.txt is a file, not a directory'],
    ),
    (
        'unknown_reward',
        MAIN,
        [TINY, '--config.reward.weights=shapez'],
        ["config.reward.weights: unknown reward(s) ['shapez']"],
    ),
    (
        'reward_module_missing',
        MAIN,
        [TINY, '--config.reward.callables=r=nope.mod:fn'],
        ['config.reward.callables', "'nope.mod'"],
    ),
    # learning rates that would put NaN/inf into the weights
    ('lr_nan', MAIN, [TINY, '--config.optim.lr=nan'], ['config.optim.lr=nan', 'must be']),
    ('lr_inf', MAIN, [TINY, '--config.optim.lr=inf'], ['config.optim.lr=inf', '1e-4 is typical']),
    ('lr_overflows_float32', MAIN, [TINY, '--config.optim.lr=1e39'], ['config.optim.lr=1e+39']),
    ('lr_negative', MAIN, [TINY, '--config.optim.lr=-3e-4'], ['config.optim.lr=-0.0003']),
    (
        'weight_decay_nan',
        MAIN,
        [TINY, '--config.optim.weight_decay=nan'],
        ['config.optim.weight_decay=nan'],
    ),
    ('beta_one', MAIN, [TINY, '--config.optim.b2=1.0'], ['config.optim.b2=1.0']),
    (
        'final_lr_frac_nan',
        MAIN,
        [TINY, '--config.optim.final_lr_frac=nan'],
        ['config.optim.final_lr_frac=nan'],
    ),
    ('shift_nan', MAIN, [TINY, '--config.sampler.shift=nan'], ['config.sampler.shift=nan']),
    # inconsistent cluster specs (4 CPU devices, one process)
    (
        'roles_overlap',
        MAIN,
        [*EXPLICIT, '--config.cluster.trainer.devices=0,1', '--config.cluster.rollout.devices=1,2'],
        ['config.cluster.trainer and config.cluster.rollout overlap on device'],
    ),
    (
        'device_missing',
        MAIN,
        [*EXPLICIT, '--config.cluster.trainer.devices=0,1', '--config.cluster.rollout.devices=7'],
        ['config.cluster.rollout.devices=(7,) names device 7'],
    ),
    (
        'role_empty',
        MAIN,
        [*EXPLICIT, '--config.cluster.trainer.devices=0,1'],
        ['config.cluster.rollout is empty'],
    ),
    (
        'mesh_too_big',
        MAIN,
        [*DISAGG, '--config.cluster.trainer.mesh_shape=3,2'],
        ['config.cluster.trainer.mesh_shape=(3, 2) holds 6 devices'],
    ),
    (
        'axis_names_short',
        MAIN,
        [*DISAGG, '--config.cluster.trainer.mesh_shape=2,1'],
        ['config.cluster.trainer.axis_names'],
    ),
    (
        'process_missing',
        MAIN,
        [*EXPLICIT, '--config.cluster.trainer.processes=0', '--config.cluster.rollout.processes=3'],
        ['config.cluster.rollout.processes=(3,) names process 3'],
    ),
    (
        'devices_and_processes',
        MAIN,
        [
            *EXPLICIT,
            '--config.cluster.trainer.devices=0,1',
            '--config.cluster.trainer.processes=0',
            '--config.cluster.rollout.devices=2,3',
        ],
        ['config.cluster.trainer: give devices or processes, not both'],
    ),
    (
        'negative_speed',
        MAIN,
        [*DISAGG, '--config.cluster.trainer.speed=-1'],
        ['config.cluster.trainer.speed=-1'],
    ),
    (
        'transfer_on_all_interfaces',
        MAIN,
        [*DISAGG, '--config.cluster.transfer_host=0.0.0.0'],
        ['config.cluster.transfer_host', 'every interface'],
    ),
    (
        'transfer_host_name',
        MAIN,
        [*DISAGG, '--config.cluster.transfer_host=eth0'],
        ['config.cluster.transfer_host', "'hostname'"],
    ),
    (
        'tag_without_disagg',
        MAIN,
        [TINY, '--config.schedule.tag=True'],
        ['config.schedule.tag', 'runtime.mode=disagg'],
    ),
    # malformed prompt files
    (
        'prompts_empty',
        MAIN,
        [TINY, '--config.data.prompts={d}/empty.txt'],
        ['config.data.prompts', 'no prompts (the file is empty)'],
    ),
    (
        'prompts_binary',
        MAIN,
        [TINY, '--config.data.prompts={d}/binary.txt'],
        ['config.data.prompts', 'binary.txt'],
    ),
    (
        'prompts_bad_utf8',
        MAIN,
        [TINY, '--config.data.prompts={d}/bad_utf8.txt'],
        ['config.data.prompts', 'not UTF-8 text'],
    ),
    (
        'prompts_huge_line',
        MAIN,
        [TINY, '--config.data.prompts={d}/huge_line.txt'],
        ['config.data.prompts', 'huge_line.txt:1', 'raise config.data.max_prompt_chars (now 512)'],
    ),
    (
        'prompts_nul',
        MAIN,
        [TINY, '--config.data.prompts={d}/nul.txt'],
        ['config.data.prompts', "control character '\\x00'", 'binary file'],
    ),
    (
        'prompts_blank_line',
        MAIN,
        [TINY, '--config.data.prompts={d}/blank_line.txt'],
        ['blank_line.txt:2: empty line'],
    ),
    (
        'prompts_missing',
        MAIN,
        [TINY, '--config.data.prompts={d}/nope.txt'],
        ['config.data.prompts', 'not found'],
    ),
    (
        'prompt_dataset_corrupt',
        MAIN,
        [TINY, '--config.data.prompts=prompt_file/twelve', '--config.data.data_dir={d}/pdata'],
        ['config.data.prompts', 'unreadable', 'delete its folder'],
    ),
    (
        'eval_split_missing',
        MAIN,
        [TINY, '--config.eval.every=1', '--config.eval.split=nosuch'],
        ['config.eval.split', "no split 'nosuch'"],
    ),
    # corrupt model checkpoints and embedding caches
    (
        'checkpoint_truncated',
        MAIN,
        ['--config=configs/shapes.py:pixel', '--config.model.checkpoint={d}/ckpt_truncated'],
        ['params.safetensors is corrupt'],
    ),
    (
        'checkpoint_bad_json',
        MAIN,
        ['--config=configs/shapes.py:pixel', '--config.model.checkpoint={d}/ckpt_bad_json'],
        ['config.json is not valid JSON', 'corrupt'],
    ),
    (
        'checkpoint_missing',
        MAIN,
        [TINY, '--config.model.init=checkpoint', '--config.model.checkpoint=/nonexistent/qwen'],
        ['config.model.checkpoint', '/nonexistent/qwen'],
    ),
    (
        'cache_without_index',
        MAIN,
        [TINY, '--config.text.encoder=qwen2.5-vl', '--config.text.cache={d}/cache_no_index'],
        ['no embedding cache', 'encode_prompts'],
    ),
    (
        'cache_bad_index',
        MAIN,
        [TINY, '--config.text.encoder=qwen2.5-vl', '--config.text.cache={d}/cache_bad_index'],
        ['index.json', 'not valid JSON'],
    ),
    # eval and pretrain
    (
        'eval_bad_samples',
        EVAL,
        [TINY, '--config.eval.samples_per_prompt=0'],
        ['config.eval.samples_per_prompt=0'],
    ),
    ('eval_unknown_key', EVAL, [TINY, '--config.eval.sample=1'], ['no field', 'sample']),
    (
        'eval_prompts_binary',
        EVAL,
        [TINY, '--config.data.prompts={d}/binary.txt'],
        ['config.data.prompts'],
    ),
    (
        'pretrain_negative_batch',
        PRETRAIN,
        [PRE, '--config.pretrain.batch=-4'],
        ['config.pretrain.batch=-4'],
    ),
    ('pretrain_unknown_key', PRETRAIN, [PRE, '--config.nope=1'], ['no field', 'nope']),
    ('pretrain_lr_nan', PRETRAIN, [PRE, '--config.pretrain.lr=nan'], ['config.pretrain.lr=nan']),
    (
        'pretrain_wrong_type',
        PRETRAIN,
        [PRE, '--config.pretrain.steps=many'],
        ['config.pretrain.steps=many'],
    ),
    # sweep
    (
        'sweep_type',
        'launch/sweep.py',
        [TINY, '--root={w}', '--grid', 'config.rl.group_size=abc,4'],
        ["run 'group_size=abc'", 'config.rl.group_size=abc'],
    ),
    (
        'sweep_nan_lr',
        'launch/sweep.py',
        [TINY, '--root={w}', '--grid', 'config.optim.lr=nan,1e-4'],
        ["run 'lr=nan'", 'config.optim.lr=nan'],
    ),
    (
        'sweep_unknown_key',
        'launch/sweep.py',
        [TINY, '--root={w}', '--grid', 'config.rl.grup=1,2'],
        ['has no field config.rl.grup'],
    ),
    (
        'sweep_zero_parallel',
        'launch/sweep.py',
        [TINY, '--root={w}', '--run', 'a:', '--parallel=0'],
        ['--parallel=0'],
    ),
    (
        'sweep_negative_timeout',
        'launch/sweep.py',
        [TINY, '--root={w}', '--run', 'a:', '--timeout_s=-1'],
        ['--timeout_s=-1.0'],
    ),
    (
        'sweep_runs_file_binary',
        'launch/sweep.py',
        [TINY, '--root={w}', '--runs_file={d}/runs_binary.txt'],
        ['runs_binary.txt', 'not UTF-8 text'],
    ),
    (
        'sweep_bad_cluster',
        'launch/sweep.py',
        [TINY, '--root={w}', '--run', 'a:--config.cluster.transfer_host=0.0.0.0'],
        ["run 'a'", 'config.cluster.transfer_host'],
    ),
    # launch/local.py
    (
        'local_zero_processes',
        'launch/local.py',
        ['--num_processes=0', '--', 'true'],
        ['--num_processes=0 must be >= 1'],
    ),
    (
        'local_text_processes',
        'launch/local.py',
        ['--num_processes=abc', '--', 'true'],
        ['--num_processes', "'abc'"],
    ),
    (
        'local_port',
        'launch/local.py',
        ['--num_processes=1', '--port=70000', '--', 'true'],
        ['--port=70000'],
    ),
    (
        'local_timeout_nan',
        'launch/local.py',
        ['--num_processes=1', '--timeout_s=nan', '--', 'true'],
        ['--timeout_s=nan'],
    ),
    (
        'local_zero_devices',
        'launch/local.py',
        ['--num_processes=1', '--devices_per_process=0', '--', 'true'],
        ['--devices_per_process=0'],
    ),
    ('local_no_command', 'launch/local.py', ['--num_processes=1', '--'], ['no command']),
    # the simulator's profiler
    (
        'profile_fragment_grads',
        'digen_jax.perf.profile',
        [TINY, '--out={w}/profile.json', '--fragment_grads=tsp,fast'],
        ['--fragment_grads=tsp,fast', 'plain,tsp'],
    ),
]


def _argv(entry, args, d, w):
  args = [a.format(d=d, w=w) for a in args]
  if entry.endswith('.py'):
    return [entry, *args]
  return ['-m', entry, f'--workdir={w}', *args]


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  d = _files(str(tmp_path_factory.mktemp('inputs')))
  root = tmp_path_factory.mktemp('workdirs')
  cases = [(i, _argv(entry, args, d, str(root / i)), str(root / i)) for i, entry, args, _ in CASES]
  return run_cases(cases), {i: w for i, _, w in cases}


@pytest.mark.parametrize(
    'case_id, expected', [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_clear_line(outcomes, case_id, expected):
  results, workdirs = outcomes
  r = results[case_id]
  line = last_line(r['stderr'])
  assert r['code'] not in (0, -9), (r['code'], r['stderr'][-2000:])
  assert 'Traceback' not in r['stderr'], r['stderr'][-3000:]
  assert line.startswith(
      (
          'digen_jax: ',
          'digen_jax.tasks.shapes.pretrain: ',
          'sweep: ',
          'launch/local.py: ',
          '[local] ',
          '[0] ',
          '[1] ',
      )
  ), line
  for text in expected:
    assert text in line, (text, line)
  assert written(workdirs[case_id]) == [], written(workdirs[case_id])
  assert r['seconds'] < 60, r['seconds']  # refused at start, not after compiling


_NAN_REWARD = """
import numpy as np
def score(images, prompts):
  return np.full(len(prompts), np.nan, np.float32)
"""


@pytest.mark.slow
def test_a_workdir_that_saw_every_failure_runs_and_corrupt_checkpoints_are_one_line(tmp_path):
  """The failures above, on one workdir, leave it able to run; a reward that only returns NaN
  stops the resumed run after max_consecutive_skips with one line and the good checkpoint kept;
  with every checkpoint corrupt, main and eval refuse in one line."""
  d = _files(str(tmp_path / 'inputs'))
  wd = str(tmp_path / 'run')
  # The cases that get furthest before refusing (prompt datasets are built under the workdir;
  # clusters resolved; rewards imported); test_bad_input_is_one_clear_line checks all of them
  # leave nothing behind.
  furthest = {
      'prompts_binary',
      'prompts_nul',
      'prompts_huge_line',
      'eval_split_missing',
      'roles_overlap',
      'transfer_on_all_interfaces',
      'lr_nan',
      'reward_module_missing',
      'checkpoint_truncated',
      'config_file_raises',
  }
  failures = [(i, _argv(e, a, d, wd), wd) for i, e, a, _ in CASES if i in furthest]
  assert len(failures) == len(furthest)
  reward = tmp_path / 'nan_reward.py'
  reward.write_text(_NAN_REWARD)
  nan_run = [
      '--config.total_steps=3',
      f'--config.reward.callables=nanr={reward}:score',
      '--config.reward.weights=nanr',
      '--config.runtime.max_consecutive_skips=1',
      # A resume under another reward changes the run: accepted explicitly (resume_guard).
      '--config.runtime.resume_changed=reward.callables,reward.weights',
  ]
  cases = failures + [
      ('good', _argv(MAIN, [TINY, '--config.total_steps=2'], d, wd), wd),
      ('nan_reward', _argv(MAIN, [TINY, *nan_run], d, wd), wd),
  ]
  out = run_cases(cases, timeout_s=400)  # the session's compilation cache: the second run reuses it
  for i, _, _ in failures:
    assert out[i]['code'] != 0 and 'Traceback' not in out[i]['stderr'], i
  good = out['good']
  assert good['code'] == 0, good['stderr'][-3000:]
  rows = [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl')) if '"loss"' in l]
  assert [(r['step'], r['nonfinite']) for r in rows] == [(1, 0), (2, 0), (3, 1)]  # 3: nan_reward
  assert rows[2]['skipped_updates'] == 1 and rows[2]['nonfinite_rewards'] == rows[2]['samples']

  nan = out['nan_reward']
  line = last_line(nan['stderr'])
  assert nan['code'] != 0 and 'Traceback' not in nan['stderr'], nan['stderr'][-3000:]
  assert line.startswith('digen_jax: 1 consecutive updates skipped') and 'step 3' in line, line
  assert 'last checkpoint (step 2)' in line and 'config.optim.lr' in line, line
  ckpts = os.path.join(wd, 'checkpoints')
  assert sorted(os.listdir(ckpts)) == ['1', '2']

  # A resume with a changed model: refused before anything compiles, naming the fields and the
  # flag that accepts them; accepted, the checkpoint's line alone (it used to be followed by
  # two "Event loop is closed" tracebacks). The config.json of the run that wrote it is kept.
  config_json = open(os.path.join(wd, 'config.json')).read()
  changed = [TINY, '--config.model.attention_head_dim=16', '--config.model.axes_dims_rope=4,6,6']
  out = run_cases([('changed_model', _argv(MAIN, changed, d, wd), wd)], timeout_s=120)
  line = last_line(out['changed_model']['stderr'])
  assert line.startswith(f'digen_jax: {wd} holds a run saved with other settings'), line
  assert 'model.attention_head_dim' in line and 'reward.weights' in line, line
  accept = re.search(r'(--config\.runtime\.resume_changed=\S+) \(recorded', line).group(1)
  out = run_cases([('accepted', _argv(MAIN, changed + [accept], d, wd), wd)], timeout_s=120)
  r = out['accepted']
  assert r['code'] != 0 and 'Traceback' not in r['stderr'], r['stderr'][-3000:]
  assert 'Event loop is closed' not in r['stderr'] and 'Exception ignored' not in r['stderr']
  line = last_line(r['stderr'])
  assert line.startswith('digen_jax: checkpoint step 2 in ') and 'does not fit this run' in line
  assert open(os.path.join(wd, 'config.json')).read() == config_json

  for step in ('1', '2'):  # rot every checkpoint
    data = max(
        glob.glob(os.path.join(ckpts, step, 'state', '**', 'd', '*'), recursive=True),
        key=os.path.getsize,
    )
    with open(data, 'r+b') as f:
      f.truncate(os.path.getsize(data) // 2)
  out = run_cases(
      [
          (
              'main',
              _argv(MAIN, [TINY, '--config.total_steps=3', nan_run[-1]], d, wd),
              wd,
          ),
          ('eval', _argv(EVAL, [TINY], d, wd), wd),
      ],
      timeout_s=120,
  )
  for i in ('main', 'eval'):
    line = last_line(out[i]['stderr'])
    assert out[i]['code'] != 0 and 'Traceback' not in out[i]['stderr'], out[i]['stderr'][-3000:]
    assert line.startswith('digen_jax: no readable checkpoint in ') and 'step 2:' in line, line
    assert 'move that directory away' in line
  assert sorted(os.listdir(ckpts)) == ['1', '2']  # nothing moved or deleted
