"""encode_prompts + models/text/text_cache.py against diffusers' WanPipeline.encode_prompt.

A toy Wan2.1 pipeline folder (digen_jax.experiment.tiny_pipeline.build_wan: WanPipeline's
save_pretrained of a random tiny UMT5EncoderModel, a Unigram T5 tokenizer trained locally, a tiny
transformer, VAE and scheduler) is built here. The real CLI encodes a prompt file into a cache in
a subprocess; EmbeddingCache must reproduce diffusers' prompt embeddings (cleaned prompts, zero
rows past each prompt's length) and the negative prompt's for true CFG. Nothing is downloaded.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from digen_jax import encode_prompts
from digen_jax.experiment import tiny_pipeline
from digen_jax.models import family as family_lib
from digen_jax.models.text import text_cache
from digen_jax.models.vae import wan_vae
from digen_jax.models.text.encoders import TextEncoder
from tests.helpers.paths import REPO

LONG = 'a red circle and a blue square ' * 8  # past the test's umT5 length
PROMPTS = [
    'two red circles on a white background',
    'A photo of an astronaut riding a horse on the moon, highly detailed, 4k, dramatic light.',
    'a red &amp;  blue \t square',  # prompt_clean: HTML entities and whitespace runs
    'cat',
    LONG.strip(),
]
EXTRA = ['', ' ']  # WanPipeline's default negative prompt and the config's default
MAX_SEQUENCE_LENGTH = 80  # WanPipeline's 512, small to keep the test fast
TEXT_DIM = tiny_pipeline.WAN_TRANSFORMER['text_dim']


def _run(args):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
      [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
  )


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('wan_text')
  folder = str(root / 'pipeline')
  sizes = tiny_pipeline.build_wan(folder, seed=0)
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
  assert f'{len(PROMPTS) + 2} prompts encoded, 1 truncated' in proc.stdout, proc.stdout
  pipe = WanPipeline.from_pretrained(folder)
  return dict(root=root, folder=folder, cache=cache, pipe=pipe, sizes=sizes)


def _prompts():
  return PROMPTS + EXTRA


def _diffusers(pipe, prompts, negative=None, max_sequence_length=MAX_SEQUENCE_LENGTH):
  with torch.no_grad():
    emb, neg = pipe.encode_prompt(
        prompts,
        negative_prompt=negative,
        do_classifier_free_guidance=True,
        max_sequence_length=max_sequence_length,
        device='cpu',
    )
  return emb.float().numpy(), neg.float().numpy()


def _rel_err(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


def test_cache_equals_wan_encode_prompt(setup):
  pipe = setup['pipe']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  assert isinstance(cache, TextEncoder) and cache.pooled_dim is None
  assert cache.dim == setup['sizes']['text_dim'] == TEXT_DIM
  prompts = _prompts()
  assert sorted(cache.prompts) == sorted(prompts)
  emb, mask = cache.encode(prompts)
  assert emb.shape == (len(prompts), MAX_SEQUENCE_LENGTH, TEXT_DIM) and emb.dtype == np.float32
  ref, ref_negative = _diffusers(pipe, prompts)  # one diffusers batch
  err = _rel_err(emb, ref)
  assert err <= 1e-5, err
  assert not emb[mask == 0].any() and not ref[mask == 0].any()  # the same zero rows
  # The negative prompt of true CFG: WanPipeline's default is ''.
  negative = cache.encode([''])[0]
  assert _rel_err(np.broadcast_to(negative, ref_negative.shape), ref_negative) <= 1e-5
  one_err = 0.0
  for i, p in enumerate(prompts):  # and prompt by prompt
    one, _ = _diffusers(pipe, [p])
    n = int(mask[i].sum())
    assert cache.length(p) == n == int(np.abs(one[0]).sum(-1).astype(bool).sum())
    one_err = max(one_err, _rel_err(emb[i], one[0]))
  assert one_err <= 1e-5, one_err
  # prompt_clean ran: the messy prompt encodes as its clean form.
  clean, _ = _diffusers(pipe, ['a red & blue square'])
  assert _rel_err(emb[2], clean[0]) <= 1e-5
  print('Wan text cache rel err (batch, per prompt):', err, one_err)


def test_truncation_identity_and_lengths(setup):
  pipe = setup['pipe']
  cache = text_cache.EmbeddingCache(setup['cache'], max_length=MAX_SEQUENCE_LENGTH)
  long = LONG.strip()
  assert cache.truncated(long) == ['text_encoder'] and cache.length(long) == MAX_SEQUENCE_LENGTH
  assert cache.tokens(long)['text_encoder'] == len(pipe.tokenizer(long).input_ids)
  assert all(cache.truncated(p) == [] for p in _prompts() if p != long)
  ident = text_cache.encoder_fingerprint(setup['folder'], MAX_SEQUENCE_LENGTH)
  assert (ident['pipeline'], ident['padding'], ident['dim']) == ('WanPipeline', 'zeros', TEXT_DIM)
  assert ident['encoders']['text_encoder']['class'] == 'transformers.UMT5EncoderModel'
  assert {'text_encoder/model.safetensors', 'tokenizer/tokenizer.json'} <= set(ident['files'])
  cache.check(_prompts(), ident)  # no error
  assert cache.identity['prompt_clean'] in ('html, whitespace', 'ftfy, html, whitespace')
  # The zero rows are attended conditioning: the run must pad to exactly the encoded length.
  with pytest.raises(ValueError, match=r'zero-pads to 80 positions.*config\.text\.max_length=80'):
    text_cache.EmbeddingCache(setup['cache'], max_length=96)
  with pytest.raises(ValueError, match=r'different text encoder.*max_length: cache 80 vs 512'):
    cache.check(_prompts(), text_cache.encoder_fingerprint(setup['folder']))
  encoder = encode_prompts.UMT5PromptEncoder(setup['folder'], device='cpu')
  with text_cache.CacheWriter(str(setup['root'] / 'other'), encoder.identity, TEXT_DIM) as writer:
    with pytest.raises(ValueError, match=r'expected \[len <= 512, 32\]'):
      writer.add([('x', np.zeros((513, TEXT_DIM)))])


def test_default_length_is_diffusers_512(setup):
  encoder = encode_prompts.prompt_encoder(setup['folder'], device='cpu')
  assert isinstance(encoder, encode_prompts.UMT5PromptEncoder)
  assert encoder.max_sequence_length == 512 == text_cache.WAN_MAX_SEQUENCE_LENGTH
  (entry,) = encoder.embed(['cat'])
  ref, _ = _diffusers(setup['pipe'], ['cat'], max_sequence_length=512)
  padded = np.zeros((512, TEXT_DIM), np.float32)
  padded[: len(entry.embeddings)] = entry.embeddings
  assert _rel_err(padded, ref[0]) <= 1e-5


def test_tiny_pipeline_reads_as_the_wan_family(setup):
  fam = family_lib.get('wan')
  cfg = fam.read_config(setup['folder'])
  t = tiny_pipeline.WAN_TRANSFORMER
  assert (cfg.num_layers, cfg.inner_dim, cfg.joint_attention_dim) == (2, 32, t['text_dim'])
  assert fam.vae is wan_vae
  vcfg = wan_vae.read_vae_config(setup['folder'])
  assert (vcfg.z_dim, vcfg.spatial_compression, vcfg.temporal_compression) == (4, 8, 4)
  scheduler = setup['pipe'].scheduler.config
  assert (scheduler.use_flow_sigmas, scheduler.flow_shift) == (True, 3.0)
