"""encode_prompts + models/text/text_cache.py against diffusers' FluxPipeline.encode_prompt.

A toy FLUX.1 pipeline folder (digen_jax.experiment.tiny_pipeline.build_flux: FluxPipeline.save_pretrained of
random tiny CLIPTextModel and T5EncoderModel, a byte-level BPE CLIPTokenizer and a Unigram T5
tokenizer trained locally, a tiny transformer, VAE and scheduler) is built here. The real CLI encodes a prompt file into a cache in a subprocess; EmbeddingCache must
reproduce diffusers' T5 sequence embeddings (the attended pad positions included) and CLIP pooled
vectors for every prompt. Nothing is downloaded.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from digen_jax import encode_prompts
from digen_jax.models.text import text_cache
from digen_jax.models.text.encoders import PooledTextEncoder, TextEncoder
from digen_jax.experiment import tiny_pipeline
from tests.helpers.paths import REPO

LONG = 'a red circle and a blue square ' * 12  # past CLIP's 77 tokens and T5's length
PROMPTS = [
    'two red circles on a white background',
    'a red circle left of a blue square on a black background',
    'A photo of an astronaut riding a horse on the moon, highly detailed, 4k, dramatic light.',
    'cat',
    LONG.strip(),
]
EXTRA = ['', ' ']  # the empty prompt and the default negative prompt (CFG)
MAX_SEQUENCE_LENGTH = 40  # the T5 length (FLUX.1-dev 512, -schnell 256), small to keep it fast
# The toy pipeline's encoder widths: distinct, so a swapped encoder cannot pass.
CLIP_DIM = tiny_pipeline.FLUX_TRANSFORMER['pooled_projection_dim']
T5_DIM = tiny_pipeline.FLUX_TRANSFORMER['joint_attention_dim']


def _run(args):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
      [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('flux_text')
  folder = str(root / 'pipeline')
  tiny_pipeline.build_flux(folder, seed=0)
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
          f'--config.text.max_length={MAX_SEQUENCE_LENGTH}',
          f'--out={cache}',
          '--batch_size=3',
      ]
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'{len(PROMPTS) + 2} prompts encoded, 2 truncated' in proc.stdout, proc.stdout
  assert 'pooled dim 32' in proc.stdout, proc.stdout
  pipe = FluxPipeline.from_pretrained(folder)
  return dict(root=root, folder=folder, cache=cache, pipe=pipe)


def _diffusers(pipe, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH):
  with torch.no_grad():
    emb, pooled, _ = pipe.encode_prompt(
        prompts, device='cpu', max_sequence_length=max_sequence_length
    )
  return emb.float().numpy(), pooled.float().numpy()


def _rel_err(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


def test_cache_equals_flux_encode_prompt(setup):
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  assert isinstance(cache, TextEncoder) and isinstance(cache, PooledTextEncoder)
  assert (cache.dim, cache.pooled_dim) == (T5_DIM, CLIP_DIM)
  prompts = PROMPTS + EXTRA
  assert sorted(cache.prompts) == sorted(prompts)
  emb, mask = cache.encode(prompts)
  pooled = cache.encode_pooled(prompts)
  assert emb.shape == (len(prompts), MAX_SEQUENCE_LENGTH, T5_DIM) and emb.dtype == np.float32
  assert pooled.shape == (len(prompts), CLIP_DIM) and pooled.dtype == np.float32
  assert mask.all()  # FLUX passes no mask: every position is attended
  ref_emb, ref_pooled = _diffusers(setup['pipe'], prompts)  # one diffusers batch
  err = (_rel_err(emb, ref_emb), _rel_err(pooled, ref_pooled))
  assert max(err) <= 1e-5, err
  one_err = 0.0
  for i, p in enumerate(prompts):  # and prompt by prompt
    one_emb, one_pooled = _diffusers(setup['pipe'], [p])
    assert cache.length(p) == MAX_SEQUENCE_LENGTH
    one_err = max(one_err, _rel_err(emb[i], one_emb[0]), _rel_err(pooled[i], one_pooled[0]))
  assert one_err <= 1e-5, one_err
  # The pad positions are real conditioning (T5 ran over them unmasked), not zeros: a cache that
  # stored only the true tokens and zero-padded would fail the comparison above.
  n_cat = cache.tokens('cat')['text_encoder_2']
  assert n_cat < MAX_SEQUENCE_LENGTH and np.abs(emb[prompts.index('cat'), n_cat:]).min() > 0
  print('parity rel err (T5 sequence, CLIP pooled):', err, 'per prompt:', one_err)


def test_default_max_sequence_length_is_diffusers(setup):
  """max_sequence_length unset: diffusers' default 512, in the identity and in the embeddings."""
  encoder = encode_prompts.prompt_encoder(setup['folder'], device='cpu')
  assert isinstance(encoder, encode_prompts.FluxPromptEncoder)
  assert encoder.identity['max_sequence_length'] == 512 == text_cache.FLUX_MAX_SEQUENCE_LENGTH
  (entry,) = encoder.embed(['cat'])
  ref_emb, ref_pooled = _diffusers(setup['pipe'], ['cat'], max_sequence_length=512)
  assert entry.embeddings.shape == (512, T5_DIM)
  assert _rel_err(entry.embeddings, ref_emb[0]) <= 1e-5
  assert _rel_err(entry.pooled, ref_pooled[0]) <= 1e-5
  with pytest.raises(ValueError, match=r'max_sequence_length=513: FluxPipeline pads T5 prompts'):
    text_cache.encoder_fingerprint(setup['folder'], 513)


def test_truncation_is_recorded(setup):
  """Too-long prompts are cut as diffusers cuts them (the parity above covers LONG), and the cache
  says which tokenizer cut each, with its untruncated count."""
  pipe = setup['pipe']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  for p in PROMPTS + EXTRA:
    assert cache.tokens(p) == {
        'text_encoder': len(pipe.tokenizer(p).input_ids),
        'text_encoder_2': len(pipe.tokenizer_2(p).input_ids),
    }
  assert cache.truncated(PROMPTS[4]) == ['text_encoder', 'text_encoder_2']
  assert cache.tokens(PROMPTS[4])['text_encoder'] > 77
  assert cache.truncated(PROMPTS[2]) == ['text_encoder_2']  # long in T5 tokens only
  assert all(cache.truncated(p) == [] for p in PROMPTS[:2] + PROMPTS[3:4] + EXTRA)


def test_identity_covers_both_encoders(setup):
  pipe = setup['pipe']
  ident = text_cache.encoder_fingerprint(setup['folder'], MAX_SEQUENCE_LENGTH)
  assert ident['pipeline'] == 'FluxPipeline' and ident['padding'] == 'max_length'
  clip, t5 = ident['encoders']['text_encoder'], ident['encoders']['text_encoder_2']
  assert clip['class'] == 'transformers.' + type(pipe.text_encoder).__name__
  assert t5['class'] == 'transformers.' + type(pipe.text_encoder_2).__name__
  assert clip['max_length'] == pipe.tokenizer_max_length == 77
  assert (t5['max_length'], ident['max_sequence_length']) == (MAX_SEQUENCE_LENGTH,) * 2
  assert (ident['dim'], ident['pooled_dim']) == (T5_DIM, CLIP_DIM)
  for part in ('text_encoder', 'text_encoder_2'):
    assert {f'{part}/config.json', f'{part}/model.safetensors'} <= set(ident['files'])
  assert 'tokenizer/tokenizer_config.json' in ident['files']
  assert 'tokenizer_2/tokenizer.json' in ident['files']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  cache.check(PROMPTS + EXTRA, ident)  # no error
  assert cache.identity['compute_dtype'] == 'float32'
  # Another T5 length is another encoding, for the reader and for the run's check.
  with pytest.raises(ValueError, match=r'padded to 40 positions.*config\.text\.max_length=40'):
    text_cache.EmbeddingCache(setup['cache'], max_length=64)
  with pytest.raises(ValueError, match=r'different text encoder.*max_length: cache 40 vs 512'):
    cache.check(PROMPTS, text_cache.encoder_fingerprint(setup['folder']))


def test_cache_from_another_encoder(setup, tmp_path):
  other = str(tmp_path / 'other_pipeline')
  tiny_pipeline.build_flux(other, seed=1)
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  with pytest.raises(ValueError, match=r'different text encoder.*text_encoder/model\.safetensors'):
    cache.check(PROMPTS, text_cache.encoder_fingerprint(other, MAX_SEQUENCE_LENGTH))
  # Appending with the other encoder, or with another T5 length, is refused before any write.
  before = sorted(os.listdir(setup['cache']))
  encoder = encode_prompts.FluxPromptEncoder(
      other, device='cpu', max_sequence_length=MAX_SEQUENCE_LENGTH
  )
  with pytest.raises(ValueError, match='different text encoder'):
    encode_prompts.encode_to_cache(encoder, ['a new prompt'], setup['cache'])
  longer = encode_prompts.FluxPromptEncoder(setup['folder'], device='cpu', max_sequence_length=64)
  with pytest.raises(ValueError, match=r'different text encoder.*max_length: cache 40 vs 64'):
    encode_prompts.encode_to_cache(longer, ['a new prompt'], setup['cache'])
  assert sorted(os.listdir(setup['cache'])) == before


def test_missing_prompt_is_one_clear_error(setup):
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  absent = ['a purple square above a cyan circle on a white background', 'dog']
  assert cache.missing(PROMPTS + absent) == absent
  argv = [
      '--config=configs/qwenimage.py',
      '--config.model.checkpoint',
      '/x/y',
      f'--config.text.max_length={MAX_SEQUENCE_LENGTH}',
  ]
  cmd = text_cache.encode_command(argv, setup['cache'])
  assert '--config.text.max_length=40' in cmd  # the command keeps the T5 length
  with pytest.raises(ValueError) as e:
    cache.check(
        PROMPTS + absent,
        text_cache.encoder_fingerprint(setup['folder'], MAX_SEQUENCE_LENGTH),
        command=cmd,
    )
  msg = str(e.value)
  assert 'lacks 2 of the 7 prompts' in msg and repr(absent[0]) in msg and cmd in msg
  with pytest.raises(ValueError, match=r"prompt 'dog' is not in embedding cache.*encode_prompts"):
    cache.encode_pooled(['cat', 'dog'])
  with pytest.raises(ValueError, match=r"prompt 'dog' is not in embedding cache"):
    cache.encode(['dog'])


def test_append_and_corrupt_pooled_tensor(setup, tmp_path):
  cache_dir = str(tmp_path / 'cache')
  shutil.copytree(setup['cache'], cache_dir)
  encoder = encode_prompts.FluxPromptEncoder(
      setup['folder'], device='cpu', max_sequence_length=MAX_SEQUENCE_LENGTH
  )
  stats = encode_prompts.encode_to_cache(encoder, PROMPTS + ['dog'], cache_dir)
  assert (stats['new'], stats['cached'], stats['truncated']) == (1, 5, 0)
  cache = text_cache.EmbeddingCache(cache_dir, max_length=MAX_SEQUENCE_LENGTH)
  ref_emb, ref_pooled = _diffusers(setup['pipe'], ['dog'])
  assert _rel_err(cache.encode(['dog'])[0], ref_emb) <= 1e-5
  assert _rel_err(cache.encode_pooled(['dog']), ref_pooled) <= 1e-5
  # A writer refuses entries without the pooled vector this cache needs, or of another length.
  with text_cache.CacheWriter(cache_dir, encoder.identity, T5_DIM, CLIP_DIM) as writer:
    with pytest.raises(ValueError, match='a pooled vector is required'):
      writer.add([('x', np.zeros((MAX_SEQUENCE_LENGTH, T5_DIM)))])
    with pytest.raises(ValueError, match=r'expected \[40, 48\]'):
      writer.add([text_cache.Entry('x', np.zeros((5, T5_DIM)), np.zeros(CLIP_DIM))])
  # The pooled tensors are covered by the shard hash like the sequences.
  shard = os.path.join(cache_dir, 'shard-00001.safetensors')
  data = bytearray(open(shard, 'rb').read())
  data[-3] ^= 0xFF
  open(shard, 'wb').write(bytes(data))
  lazy = text_cache.EmbeddingCache(cache_dir, max_length=MAX_SEQUENCE_LENGTH, verify=False)
  with pytest.raises(ValueError, match=r'shard-00001\.safetensors is corrupt'):
    lazy.encode_pooled(['dog'])
