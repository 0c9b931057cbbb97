"""encode_prompts + models/text/text_cache.py against diffusers' QwenImagePipeline.encode_prompt.

A toy Qwen-Image pipeline folder (digen_jax/experiment/tiny_pipeline.py, saved with diffusers'
save_pretrained) is built once; the real CLI encodes a prompt file into a cache in a subprocess;
EmbeddingCache must reproduce diffusers' embeddings, masks and lengths for every prompt.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from digen_jax.experiment import config as configlib
from digen_jax import encode_prompts
from digen_jax.experiment import tiny_pipeline
from digen_jax.models.text import text_cache
from digen_jax.models.text.encoders import TextEncoder
from tests.helpers.paths import REPO

PROMPTS = [
    'two red circles on a white background',
    'a red circle left of a blue square on a black background',
    'A photo of an astronaut riding a horse on the moon, highly detailed, 4k, dramatic light.',
    'cat',
    'yellow triangles',
]
EXTRA = ['', ' ']  # the empty prompt and diffusers' default negative prompt (CFG)
MAX_LENGTH = 80


def _run(args, **kw):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
      [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, **kw
  )


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('encode_prompts')
  folder = str(root / 'pipeline')
  sizes = tiny_pipeline.build(folder, seed=0)
  prompt_file = root / 'prompts.txt'
  prompt_file.write_text('\n'.join(PROMPTS) + '\n')
  cache = str(root / 'cache')
  proc = _run(
      [
          '-m',
          'digen_jax.encode_prompts',
          '--config=configs/qwenimage.py',
          f'--config.model.checkpoint={folder}',
          f'--prompts={prompt_file}',
          f'--out={cache}',
          '--batch_size=3',
      ]
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'{len(PROMPTS) + 2} prompts encoded' in proc.stdout, proc.stdout
  pipe = QwenImagePipeline.from_pretrained(folder)
  return dict(root=root, folder=folder, sizes=sizes, cache=cache, pipe=pipe)


def _diffusers(pipe, prompts):
  with torch.no_grad():
    emb, mask = pipe.encode_prompt(prompts, device='cpu')
  emb = emb.float().numpy()
  # encode_prompt drops an all-ones mask (no padding in the batch).
  mask = np.ones(emb.shape[:2], np.int64) if mask is None else mask.numpy()
  return emb, mask


# The cache encodes batches of 3 prompts sorted by length; the references are one padded batch of
# all of them, or one prompt alone. torch's CPU kernels are not batch-invariant on every host
# (below 1e-6 on the AMD EPYC hosts; 8.7e-5 for the padded batch and 1.35e-4 for a single prompt
# on an AVX-512 Intel Xeon, 2026-11-28), so this is float32 agreement, not bit equality. A wrong
# template, mask or drop index moves the error by orders of magnitude more.
BATCH_INVARIANCE = 5e-4


def _rel_err(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


def test_cache_equals_diffusers_encode_prompt(setup):
  pipe = setup['pipe']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH)
  assert isinstance(cache, TextEncoder)
  assert cache.dim == setup['sizes']['text_dim'] == 32 and cache.max_length == MAX_LENGTH
  prompts = PROMPTS + EXTRA
  assert sorted(cache.prompts) == sorted(prompts)
  emb, mask = cache.encode(prompts)
  assert emb.shape == (len(prompts), MAX_LENGTH, 32) and emb.dtype == np.float32
  assert mask.dtype == np.int32
  ref_emb, ref_mask = _diffusers(pipe, prompts)  # one padded diffusers batch
  width = ref_emb.shape[1]
  np.testing.assert_array_equal(mask[:, :width], ref_mask)
  assert not mask[:, width:].any() and not emb[:, width:].any()
  assert not emb[mask == 0].any()  # padding is exactly zero
  err = _rel_err(emb[:, :width], ref_emb)
  assert err <= BATCH_INVARIANCE, err
  lengths = []
  for i, p in enumerate(prompts):  # and prompt by prompt
    one_emb, one_mask = _diffusers(pipe, [p])
    n = one_emb.shape[1]
    assert cache.length(p) == n == int(mask[i].sum()) == int(one_mask.sum())
    assert _rel_err(emb[i, :n], one_emb[0]) <= BATCH_INVARIANCE
    lengths.append(n)
  assert len(set(lengths)) == len(lengths), lengths  # the prompts differ in length
  print('parity rel err (batch):', err, 'lengths:', dict(zip(prompts, lengths)))


def test_identity_matches_diffusers_and_folder(setup):
  pipe = setup['pipe']
  ident = text_cache.encoder_fingerprint(setup['folder'])
  assert ident['template'] == pipe.prompt_template_encode
  assert ident['drop_idx'] == pipe.prompt_template_encode_start_idx
  assert ident['max_sequence_length'] == pipe.tokenizer_max_length
  assert ident['class'] == 'transformers.' + type(pipe.text_encoder).__name__
  # The toy tokenizer splits the template's system prefix into exactly drop_idx tokens, as
  # Qwen's real tokenizer does, so the dropped positions are the template's own.
  prefix = ident['template'].split('{}')[0]
  assert len(pipe.tokenizer(prefix)['input_ids']) == ident['drop_idx']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH)
  cache.check(PROMPTS + EXTRA, ident)  # no error
  assert cache.identity['compute_dtype'] == 'float32'
  assert set(ident['files']) == {
      'text_encoder/config.json',
      'text_encoder/model.safetensors',
      'tokenizer/tokenizer.json',
      'tokenizer/tokenizer_config.json',
  }


def test_missing_prompt_is_one_clear_error(setup):
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH)
  absent = ['a purple square above a cyan circle on a white background', 'dog']
  assert cache.missing(PROMPTS + absent + absent) == absent
  cmd = text_cache.encode_command(
      ['--config=configs/qwenimage.py', '--config.model.checkpoint', '/x/y', '--workdir=/w'],
      setup['cache'],
  )
  assert cmd == (
      'python -m digen_jax.encode_prompts --config=configs/qwenimage.py '
      f"--config.model.checkpoint=/x/y --out={setup['cache']}"
  )
  with pytest.raises(ValueError) as e:
    cache.check(PROMPTS + absent, text_cache.encoder_fingerprint(setup['folder']), command=cmd)
  msg = str(e.value)
  assert 'lacks 2 of the 7 prompts' in msg and repr(absent[0]) in msg and cmd in msg
  with pytest.raises(ValueError, match='dog'):
    cache.encode(['cat', 'dog'])


def test_prompt_longer_than_max_length(setup):
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=20)
  with pytest.raises(ValueError, match=r'astronaut.*config\.text\.max_length is 20'):
    cache.check(PROMPTS)
  with pytest.raises(ValueError, match=r'astronaut.*raise config\.text\.max_length'):
    cache.encode([PROMPTS[2]])
  cache.encode(PROMPTS[:2])  # short ones still read


def test_cache_from_another_encoder(setup, tmp_path):
  other = str(tmp_path / 'other_pipeline')
  tiny_pipeline.build(other, seed=1)
  ident = text_cache.encoder_fingerprint(other)
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH)
  with pytest.raises(ValueError, match=r'different text encoder.*text_encoder/model\.safetensors'):
    cache.check(PROMPTS, ident)
  # Appending with the other encoder to the same folder is refused before anything is written.
  before = sorted(os.listdir(setup['cache']))
  encoder = encode_prompts.QwenPromptEncoder(other, device='cpu')
  with pytest.raises(ValueError, match='different text encoder'):
    encode_prompts.encode_to_cache(encoder, ['a new prompt'], setup['cache'])
  assert sorted(os.listdir(setup['cache'])) == before
  # Same folder encoded in another compute dtype is another encoder too.
  bf16 = encode_prompts.QwenPromptEncoder(setup['folder'], device='cpu', dtype='bfloat16')
  with pytest.raises(ValueError, match=r"compute_dtype: cache 'float32' vs 'bfloat16'"):
    encode_prompts.encode_to_cache(bf16, ['a new prompt'], setup['cache'])


def test_tiny_pipeline_is_deterministic(setup, tmp_path):
  again = str(tmp_path / 'again')
  assert tiny_pipeline.build(again, seed=0) == setup['sizes']

  def digests(d):
    return {
        os.path.relpath(os.path.join(r, f), d): hashlib.sha256(
            open(os.path.join(r, f), 'rb').read()
        ).hexdigest()
        for r, _, fs in os.walk(d)
        for f in fs
    }

  assert digests(again) == digests(setup['folder'])
  with pytest.raises(ValueError, match='not an empty folder'):
    tiny_pipeline.build(again)
  sizes = setup['sizes']
  assert sizes['vae_scale_factor'] == 8 and sizes['latent_channels'] == 4
  t = sizes['transformer']
  assert t['in_channels'] == sizes['latent_channels'] * t['patch_size'] ** 2
  assert t['attention_head_dim'] == sum(t['axes_dims_rope'])
  assert t['joint_attention_dim'] == sizes['text_dim']
  json.dumps(sizes)
  # Non-trivial weights: the transformer's output layer and modulations are not zero.
  pipe = setup['pipe']
  assert pipe.transformer.proj_out.weight.abs().min() > 0
  assert pipe.transformer.transformer_blocks[0].img_mod[1].weight.std() > 0.05
  assert pipe.vae.config.latents_std != [1.0] * 4


def test_corrupt_cache_is_a_clear_error(setup, tmp_path):
  bad = str(tmp_path / 'bad')
  shutil.copytree(setup['cache'], bad)
  shard = os.path.join(bad, 'shard-00000.safetensors')
  data = bytearray(open(shard, 'rb').read())
  data[-7] ^= 0xFF  # inside the tensor bytes
  open(shard, 'wb').write(bytes(data))
  with pytest.raises(ValueError, match=r'shard-00000\.safetensors is corrupt'):
    text_cache.EmbeddingCache(bad, max_length=MAX_LENGTH)
  lazy = text_cache.EmbeddingCache(bad, max_length=MAX_LENGTH, verify=False)
  with pytest.raises(ValueError, match=r'shard-00000\.safetensors is corrupt'):
    lazy.encode(['cat'])
  # A hand-edited index (a prompt's length) fails its digest.
  shutil.copy(os.path.join(setup['cache'], 'shard-00000.safetensors'), shard)
  index_path = os.path.join(bad, 'index.json')
  index = json.load(open(index_path))
  index['prompts'][0]['length'] += 1
  json.dump(index, open(index_path, 'w'))
  with pytest.raises(ValueError, match=r'index\.json: corrupt embedding cache index.*digest'):
    text_cache.EmbeddingCache(bad, max_length=MAX_LENGTH)
  with pytest.raises(ValueError, match=r'no embedding cache at .*index\.json not found'):
    text_cache.EmbeddingCache(str(tmp_path), max_length=MAX_LENGTH)


def test_append_adds_only_new_prompts(setup, tmp_path):
  cache_dir = str(tmp_path / 'cache')
  shutil.copytree(setup['cache'], cache_dir)
  # Leftovers of an interrupted append: a temp file and a shard the index never listed.
  open(os.path.join(cache_dir, '.tmp-123-shard-00001.safetensors'), 'wb').write(b'partial')
  open(os.path.join(cache_dir, 'shard-00001.safetensors'), 'wb').write(b'orphan')
  old = text_cache.EmbeddingCache(cache_dir, max_length=MAX_LENGTH)  # still valid
  old_emb, old_mask = old.encode(PROMPTS + EXTRA)
  encoder = encode_prompts.QwenPromptEncoder(setup['folder'], device='cpu')
  new = ['a green square below a white triangle on a black background', 'dog']
  stats = encode_prompts.encode_to_cache(encoder, PROMPTS + new, cache_dir, batch_size=8)
  assert (stats['new'], stats['cached'], stats['total']) == (2, 5, 9)
  assert stats['shards'] == ['shard-00001.safetensors']
  assert not [n for n in os.listdir(cache_dir) if n.startswith('.tmp-')]
  cache = text_cache.EmbeddingCache(cache_dir, max_length=MAX_LENGTH)
  emb, mask = cache.encode(PROMPTS + EXTRA)
  np.testing.assert_array_equal(emb, old_emb)  # old entries untouched
  np.testing.assert_array_equal(mask, old_mask)
  emb, mask = cache.encode(new)
  ref_emb, ref_mask = _diffusers(setup['pipe'], new)
  width = ref_emb.shape[1]
  np.testing.assert_array_equal(mask[:, :width], ref_mask)
  assert _rel_err(emb[:, :width], ref_emb) <= 1e-6
  again = encode_prompts.encode_to_cache(encoder, PROMPTS + new, cache_dir)
  assert (again['new'], again['shards']) == (0, [])


def test_gather_prompts_file_and_tfds(setup, tmp_path):
  config = configlib.base_config()
  config.sampler.negative_prompt = 'blurry'
  prompt_file = setup['root'] / 'prompts.txt'
  got = encode_prompts.gather_prompts(config, str(prompt_file))
  assert got == ['blurry', ''] + PROMPTS
  with pytest.raises(ValueError, match='only the split train'):
    encode_prompts.gather_prompts(config, str(prompt_file), split='eval')
  from digen_jax.data import prompts as prompt_data

  data_dir = str(tmp_path / 'data')
  got = encode_prompts.gather_prompts(config, 'shapes', data_dir=data_dir)
  train = prompt_data.load_prompts('shapes', 'train', data_dir)[:]
  evals = prompt_data.load_prompts('shapes', 'eval', data_dir)[:]
  assert got == ['blurry', ''] + train + evals
  assert encode_prompts.gather_prompts(config, 'shapes', 'eval', data_dir) == ['blurry', ''] + evals


def test_text_cache_reads_without_torch(setup):
  code = (
      'import sys\n'
      'from digen_jax.models.text import text_cache\n'
      f'c = text_cache.EmbeddingCache({setup["cache"]!r}, max_length=32)\n'
      'e, m = c.encode(["cat", ""])\n'
      f'text_cache.encoder_fingerprint({setup["folder"]!r})\n'
      'heavy = ("torch", "transformers", "diffusers")\n'
      'bad = [k for k in sys.modules if k.split(".")[0] in heavy]\n'
      'assert not bad, bad\n'
      'print(e.shape, int(m.sum()))\n'
  )
  proc = _run(['-c', code])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == [
      '(2,',
      '32,',
      '32)',
      str(int(text_cache.EmbeddingCache(setup['cache'], 32).encode(['cat', ''])[1].sum())),
  ]


def test_qwen_cache_has_no_pooled_vectors(setup):
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH)
  assert cache.pooled_dim is None and cache.tokens('cat') == {} and cache.truncated('cat') == []
  with pytest.raises(ValueError, match=r'has no pooled vectors.*Qwen2_5_VL'):
    cache.encode_pooled(['cat'])


def test_format_1_cache_is_read_and_upgraded(setup, tmp_path):
  """A cache written before pooled vectors existed (format 1: no pooled_dim) stays valid; the
  next append rewrites its index as format 2."""
  cache_dir = str(tmp_path / 'v1')
  shutil.copytree(setup['cache'], cache_dir)
  index_path = os.path.join(cache_dir, 'index.json')
  index = json.load(open(index_path))
  assert index['format'] == text_cache.FORMAT == 'digen_jax.embedding_cache/2'
  assert index['pooled_dim'] is None
  del index['pooled_dim'], index['digest']
  index['format'] = 'digen_jax.embedding_cache/1'
  canonical = json.dumps(index, sort_keys=True, ensure_ascii=True, separators=(',', ':'))
  index['digest'] = hashlib.sha256(canonical.encode()).hexdigest()
  json.dump(index, open(index_path, 'w'))
  old = text_cache.EmbeddingCache(cache_dir, max_length=MAX_LENGTH)
  assert old.pooled_dim is None
  np.testing.assert_array_equal(
      old.encode(PROMPTS)[0],
      text_cache.EmbeddingCache(setup['cache'], max_length=MAX_LENGTH).encode(PROMPTS)[0],
  )
  encoder = encode_prompts.prompt_encoder(setup['folder'], device='cpu')
  assert isinstance(encoder, encode_prompts.QwenPromptEncoder)
  assert encode_prompts.encode_to_cache(encoder, PROMPTS + ['dog'], cache_dir)['new'] == 1
  index = json.load(open(index_path))
  assert index['format'] == text_cache.FORMAT and index['pooled_dim'] is None
  assert not text_cache.EmbeddingCache(cache_dir, max_length=MAX_LENGTH).missing(PROMPTS + ['dog'])
