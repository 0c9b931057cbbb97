"""Toy Qwen-Image, FLUX.1 and Wan2.1 pipeline folders: the real diffusers layouts and classes at
test size.

  python -m digen_jax.experiment.tiny_pipeline --out=DIR [--seed=0] [--family=qwenimage|flux|wan]

`build(folder, seed)` saves diffusers' `QwenImagePipeline(...)` with `save_pretrained`, so
model_index.json, transformer/, vae/, text_encoder/, tokenizer/ and scheduler/ are exactly what a
real checkpoint has: a random QwenImageTransformer2DModel (2 blocks, 2 heads x 16), a random
AutoencoderKLQwenImage (z_dim 4, 8x spatial compression), a random Qwen2.5-VL text encoder (hidden
size = the transformer's joint_attention_dim) and a byte-level BPE Qwen2Tokenizer trained here on
the prompt template and the ShapesBench words. Every weight is redrawn from a generator seeded by
`seed` with O(1) activations in mind (no zero-initialised output or modulation layers), so the
models' outputs depend on every weight. Nothing is downloaded. Uses torch: tests and tools only.

`build_flux(folder, seed)` saves diffusers' `FluxPipeline(...)` the same way: a random
FluxTransformer2DModel with the guidance embedding (FLUX.1-dev's layout: 1 double- and 2
single-stream blocks, 2 heads x 16), a random AutoencoderKL (4 latent channels, 2x compression,
FLUX's scaling and shift factors), a random CLIPTextModel with a locally trained byte-level BPE
CLIPTokenizer, and a random T5EncoderModel with a locally trained Unigram T5 tokenizer.

`build_wan(folder, seed)` saves diffusers' `WanPipeline(...)` the same way (Wan2.1's text-to-video
layout): a random WanTransformer3DModel (2 blocks, 2 heads x 16, 1 x 2 x 2 patches), a random
AutoencoderKLWan (z_dim 4, 8x spatial and 4x temporal compression), a random UMT5EncoderModel
with the same locally trained Unigram T5 tokenizer, and Wan2.1's UniPC flow scheduler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import string
from typing import Any

from absl import app
from absl import flags

from digen_jax.models.text import text_cache

# Toy sizes. The transformer's attention_head_dim is sum(axes_dims_rope); in_channels is
# z_dim * patch_size**2 (packed 2x2 latent patches).
Z_DIM = 4
TRANSFORMER = dict(
    patch_size=2,
    in_channels=Z_DIM * 4,
    out_channels=Z_DIM,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
VAE = dict(
    base_dim=16,
    z_dim=Z_DIM,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[0.31, -0.52, 0.17, -0.08],
    latents_std=[1.7, 0.6, 2.3, 1.1],
)
VAE_SCALE_FACTOR = 2 ** len(VAE['temperal_downsample'])
# Text model: 2 layers, 2 heads of 16 (mrope sections sum to head_dim / 2), 1 KV head.
TEXT = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    mrope_section=[2, 3, 3],
)
# The toy tokenizers' own words, each one token: those of the toy prompts (ShapesBench's, in its
# grammar's order; tests/test_shapes_grammar.py checks they are the same).
TOY_WORDS = (
    'a',
    'above',
    'background',
    'below',
    'black',
    'blue',
    'circle',
    'circles',
    'cyan',
    'gray',
    'green',
    'left',
    'of',
    'on',
    'purple',
    'red',
    'right',
    'square',
    'squares',
    'three',
    'triangle',
    'triangles',
    'two',
    'white',
    'yellow',
)
SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
# Qwen2.5-VL's vision placeholders: ids exist in the vocabulary but are never in a prompt.
VISION_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|image_pad|>', '<|video_pad|>')


def _tokenizer():
  """A byte-level BPE Qwen2Tokenizer: Qwen2's pre-tokenizer, trained on the template and words.

  Every template word and ShapesBench word is one token (so the template's system prefix is
  exactly QWENIMAGE_DROP_IDX = 34 tokens, as with the real tokenizer); other text falls back to
  smaller pieces down to single bytes.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
  from tokenizers import trainers
  from tokenizers.models import BPE
  from transformers import Qwen2Tokenizer
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

  # The same pipeline Qwen2Tokenizer builds around its BPE, so training splits text as it will.
  bpe = Tokenizer(
      BPE(
          unk_token=None,
          continuing_subword_prefix='',
          end_of_word_suffix='',
          fuse_unk=False,
          byte_fallback=False,
      )
  )
  bpe.normalizer = normalizers.NFC()
  bpe.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior='isolated', invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )
  words = list(TOY_WORDS)
  corpus = [text_cache.QWENIMAGE_TEMPLATE.format(' '.join(words))]
  corpus += [f' {w}' for w in words] + words  # each word both inside and at the start of a prompt
  trainer = trainers.BpeTrainer(
      vocab_size=4096,
      min_frequency=1,
      special_tokens=list(SPECIAL_TOKENS + VISION_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  bpe.train_from_iterator(corpus, trainer)
  model = json.loads(bpe.to_str())['model']
  tok = Qwen2Tokenizer(vocab=model['vocab'], merges=[tuple(m) for m in model['merges']])
  tok.add_tokens(
      [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[1:] + VISION_TOKENS]
  )
  return tok


def _randomize(module, seed: int) -> None:
  """Redraws every parameter from a seeded generator: weights N(0, 1/fan_in), norm scales
  1 + N(0, 0.1^2), biases N(0, 0.1^2). Independent of the libraries' own init schemes."""
  import torch  # pylint: disable=g-import-not-at-top

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      leaf = name.rsplit('.', 1)[-1]
      if leaf == 'gamma' or (leaf == 'weight' and p.ndim == 1):
        value = 1.0 + 0.1 * noise
      elif leaf == 'bias':
        value = 0.1 * noise
      else:
        value = noise / (p[0].numel() ** 0.5)
      p.copy_(value.to(p.dtype))


def _text_encoder(vocab: dict[str, int], hidden_size: int, seed: int):
  from transformers import Qwen2_5_VLConfig  # pylint: disable=g-import-not-at-top
  from transformers import Qwen2_5_VLForConditionalGeneration  # pylint: disable=g-import-not-at-top

  eot = vocab['<|endoftext|>']
  config = Qwen2_5_VLConfig(
      text_config=dict(
          vocab_size=len(vocab),
          hidden_size=hidden_size,
          intermediate_size=TEXT['intermediate_size'],
          num_hidden_layers=TEXT['num_hidden_layers'],
          num_attention_heads=TEXT['num_attention_heads'],
          num_key_value_heads=TEXT['num_key_value_heads'],
          max_position_embeddings=2048,
          rope_parameters={
              'rope_type': 'default',
              'mrope_section': TEXT['mrope_section'],
              'rope_theta': 1000000.0,
          },
          bos_token_id=eot,
          eos_token_id=vocab['<|im_end|>'],
          pad_token_id=eot,
      ),
      # The smallest vision tower the config allows; text-only prompts never run it.
      vision_config=dict(
          depth=1,
          hidden_size=16,
          intermediate_size=16,
          num_heads=2,
          out_hidden_size=hidden_size,
          patch_size=2,
          spatial_merge_size=1,
          temporal_patch_size=1,
          window_size=4,
          fullatt_block_indexes=[0],
      ),
      image_token_id=vocab['<|image_pad|>'],
      video_token_id=vocab['<|video_pad|>'],
      vision_start_token_id=vocab['<|vision_start|>'],
      vision_end_token_id=vocab['<|vision_end|>'],
  )
  model = Qwen2_5_VLForConditionalGeneration(config)
  _randomize(model, seed)
  return model.eval()


def build(folder: str, seed: int = 0) -> dict[str, Any]:
  """Writes the toy pipeline into `folder` (new or empty); returns its sizes as a JSON-able dict:
  {transformer: the transformer config's init args, vae: {z_dim, base_dim, dim_mult, latents_mean,
  latents_std}, vae_scale_factor: 8, latent_channels, text_dim, text_vocab_size, seed}."""
  import torch  # pylint: disable=g-import-not-at-top
  from diffusers import AutoencoderKLQwenImage  # pylint: disable=g-import-not-at-top
  from diffusers import FlowMatchEulerDiscreteScheduler  # pylint: disable=g-import-not-at-top
  from diffusers import QwenImagePipeline  # pylint: disable=g-import-not-at-top
  from diffusers import QwenImageTransformer2DModel  # pylint: disable=g-import-not-at-top

  from digen_jax.diffusion import sigmas as sigmas_lib  # pylint: disable=g-import-not-at-top

  folder = _new_folder(folder, seed)
  sub = _streams(seed)
  torch.manual_seed(sub('construct'))  # the libraries' own init, overwritten by _randomize
  tokenizer = _tokenizer()
  transformer = QwenImageTransformer2DModel(**TRANSFORMER)
  _randomize(transformer, sub('transformer'))
  vae = AutoencoderKLQwenImage(**VAE)
  _randomize(vae, sub('vae'))
  text_encoder = _text_encoder(
      tokenizer.get_vocab(), TRANSFORMER['joint_attention_dim'], sub('text_encoder')
  )
  scheduler = FlowMatchEulerDiscreteScheduler(
      **dataclasses.asdict(sigmas_lib.qwenimage_scheduler_config())
  )
  pipe = QwenImagePipeline(
      scheduler=scheduler,
      vae=vae,
      text_encoder=text_encoder,
      tokenizer=tokenizer,
      transformer=transformer.eval(),
  )
  pipe.save_pretrained(folder, safe_serialization=True)
  return {
      'transformer': {k: list(v) if isinstance(v, tuple) else v for k, v in TRANSFORMER.items()},
      'vae': {k: VAE[k] for k in ('z_dim', 'base_dim', 'dim_mult', 'latents_mean', 'latents_std')},
      'vae_scale_factor': VAE_SCALE_FACTOR,
      'latent_channels': Z_DIM,
      'text_dim': TRANSFORMER['joint_attention_dim'],
      'text_vocab_size': len(tokenizer),
      'seed': seed,
  }


# FLUX toy sizes (configs/flux.py:tiny_pipeline reads the same numbers).
FLUX_Z_DIM = 4
FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=FLUX_Z_DIM * 4,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=48,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
FLUX_VAE = dict(
    block_out_channels=(8, 16),
    down_block_types=('DownEncoderBlock2D',) * 2,
    up_block_types=('UpDecoderBlock2D',) * 2,
    latent_channels=FLUX_Z_DIM,
    norm_num_groups=4,
    layers_per_block=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
FLUX_VAE_SCALE_FACTOR = 2 ** (len(FLUX_VAE['block_out_channels']) - 1)
FLUX_CLIP_MAX_LENGTH = 77


def _flux_words() -> list[str]:
  return list(TOY_WORDS) + 'and cat photo astronaut riding horse moon'.split()


def clip_tokenizer():
  """CLIPTokenizer (byte-level BPE, '</w>' word ends, 77 tokens) trained on the toy words and
  every printable ASCII character, so any English prompt tokenizes."""
  from tokenizers import Tokenizer, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  from tokenizers.models import BPE  # pylint: disable=g-import-not-at-top
  from transformers import CLIPTokenizer  # pylint: disable=g-import-not-at-top

  backend = CLIPTokenizer().backend_tokenizer  # CLIP's own normalizer and pre-tokenizer
  bpe = Tokenizer(
      BPE(
          unk_token='<|endoftext|>',
          continuing_subword_prefix='',
          end_of_word_suffix='</w>',
          fuse_unk=False,
      )
  )
  bpe.normalizer, bpe.pre_tokenizer = backend.normalizer, backend.pre_tokenizer
  words = _flux_words()
  corpus = words + [
      ' '.join(words),
      ' '.join(string.digits + string.ascii_letters + string.punctuation),
  ]
  trainer = trainers.BpeTrainer(
      vocab_size=1000,
      min_frequency=1,
      special_tokens=['<|startoftext|>', '<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      end_of_word_suffix='</w>',
      show_progress=False,
  )
  bpe.train_from_iterator(corpus, trainer)
  model = json.loads(bpe.to_str())['model']
  return CLIPTokenizer(
      vocab=model['vocab'],
      merges=[tuple(m) for m in model['merges']],
      model_max_length=FLUX_CLIP_MAX_LENGTH,
  )


def _t5_tokenizer():
  """T5TokenizerFast (Unigram, '</s>' appended, <pad> = 0) trained on the toy words and ASCII."""
  from tokenizers import Tokenizer, trainers  # pylint: disable=g-import-not-at-top
  from tokenizers.models import Unigram  # pylint: disable=g-import-not-at-top
  from transformers import T5TokenizerFast  # pylint: disable=g-import-not-at-top

  uni = Tokenizer(Unigram())
  uni.pre_tokenizer = T5TokenizerFast(extra_ids=0).backend_tokenizer.pre_tokenizer
  trainer = trainers.UnigramTrainer(
      vocab_size=200,
      special_tokens=['<pad>', '</s>', '<unk>'],
      unk_token='<unk>',
      initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
      show_progress=False,
  )
  words = _flux_words()
  uni.train_from_iterator(words + [' '.join(words)], trainer)
  vocab = [tuple(v) for v in json.loads(uni.to_str())['model']['vocab']]
  return T5TokenizerFast(vocab=vocab, extra_ids=4)


def build_flux(folder: str, seed: int = 0) -> dict[str, Any]:
  """Writes the toy FLUX.1 pipeline into `folder` (new or empty); returns its sizes."""
  import torch  # pylint: disable=g-import-not-at-top
  from diffusers import AutoencoderKL  # pylint: disable=g-import-not-at-top
  from diffusers import FlowMatchEulerDiscreteScheduler  # pylint: disable=g-import-not-at-top
  from diffusers import FluxPipeline  # pylint: disable=g-import-not-at-top
  from diffusers import FluxTransformer2DModel  # pylint: disable=g-import-not-at-top
  from transformers import CLIPTextConfig, CLIPTextModel  # pylint: disable=g-import-not-at-top
  from transformers import T5Config, T5EncoderModel  # pylint: disable=g-import-not-at-top

  from digen_jax.diffusion import sigmas as sigmas_lib  # pylint: disable=g-import-not-at-top

  folder = _new_folder(folder, seed)
  sub = _streams(seed)
  torch.manual_seed(sub('construct'))
  clip_tok, t5_tok = clip_tokenizer(), _t5_tokenizer()
  t = FLUX_TRANSFORMER
  clip = CLIPTextModel(
      CLIPTextConfig(
          vocab_size=len(clip_tok),
          hidden_size=t['pooled_projection_dim'],
          intermediate_size=64,
          num_hidden_layers=2,
          num_attention_heads=2,
          max_position_embeddings=FLUX_CLIP_MAX_LENGTH,
          projection_dim=t['pooled_projection_dim'],
          bos_token_id=clip_tok.bos_token_id,
          eos_token_id=clip_tok.eos_token_id,
          pad_token_id=clip_tok.pad_token_id,
      )
  )
  t5 = T5EncoderModel(
      T5Config(
          vocab_size=len(t5_tok),
          d_model=t['joint_attention_dim'],
          d_kv=16,
          d_ff=64,
          num_layers=2,
          num_heads=3,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=32,
          feed_forward_proj='gated-gelu',
          pad_token_id=t5_tok.pad_token_id,
          eos_token_id=t5_tok.eos_token_id,
          decoder_start_token_id=t5_tok.pad_token_id,
      )
  )
  transformer = FluxTransformer2DModel(**t)
  vae = AutoencoderKL(**FLUX_VAE)
  for name, module in (('clip', clip), ('t5', t5), ('transformer', transformer), ('vae', vae)):
    _randomize(module, sub(name))
  scheduler = FlowMatchEulerDiscreteScheduler(
      **dataclasses.asdict(sigmas_lib.flux_scheduler_config())
  )
  pipe = FluxPipeline(
      scheduler=scheduler,
      vae=vae.eval(),
      text_encoder=clip.eval(),
      tokenizer=clip_tok,
      text_encoder_2=t5.eval(),
      tokenizer_2=t5_tok,
      transformer=transformer.eval(),
  )
  pipe.save_pretrained(folder, safe_serialization=True)
  return {
      'family': 'flux',
      'transformer': {k: list(v) if isinstance(v, tuple) else v for k, v in t.items()},
      'vae_scale_factor': FLUX_VAE_SCALE_FACTOR,
      'latent_channels': FLUX_Z_DIM,
      'text_dim': t['joint_attention_dim'],
      'pooled_dim': t['pooled_projection_dim'],
      'seed': seed,
  }


# Wan2.1 toy sizes (the text width is the transformer's text_dim).
WAN_Z_DIM = 4
WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=WAN_Z_DIM,
    out_channels=WAN_Z_DIM,
    text_dim=32,
    freq_dim=256,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm='rms_norm_across_heads',
    eps=1e-6,
)
WAN_VAE = dict(
    base_dim=8,
    z_dim=WAN_Z_DIM,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.31, -0.52, 0.17, -0.08],
    latents_std=[1.7, 0.6, 2.3, 1.1],
)
# Wan2.1-T2V's scheduler: UniPC on flow sigmas, static shift 3 (480p; 720p uses 5).
WAN_SCHEDULER = dict(
    prediction_type='flow_prediction',
    use_flow_sigmas=True,
    flow_shift=3.0,
    num_train_timesteps=1000,
)


def build_wan(folder: str, seed: int = 0) -> dict[str, Any]:
  """Writes the toy Wan2.1 pipeline into `folder` (new or empty); returns its sizes."""
  import torch  # pylint: disable=g-import-not-at-top
  from diffusers import AutoencoderKLWan  # pylint: disable=g-import-not-at-top
  from diffusers import UniPCMultistepScheduler  # pylint: disable=g-import-not-at-top
  from diffusers import WanPipeline  # pylint: disable=g-import-not-at-top
  from diffusers import WanTransformer3DModel  # pylint: disable=g-import-not-at-top
  from transformers import UMT5Config, UMT5EncoderModel  # pylint: disable=g-import-not-at-top

  folder = _new_folder(folder, seed)
  sub = _streams(seed)
  torch.manual_seed(sub('construct'))
  tokenizer = _t5_tokenizer()  # umT5's tokenizer is a T5TokenizerFast too (Unigram, </s>, <pad>)
  umt5 = UMT5EncoderModel(
      UMT5Config(
          vocab_size=len(tokenizer),
          d_model=WAN_TRANSFORMER['text_dim'],
          d_kv=16,
          d_ff=64,
          num_layers=2,
          num_heads=2,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=32,
          feed_forward_proj='gated-gelu',
          pad_token_id=tokenizer.pad_token_id,
          eos_token_id=tokenizer.eos_token_id,
          decoder_start_token_id=tokenizer.pad_token_id,
      )
  )
  transformer = WanTransformer3DModel(**WAN_TRANSFORMER)
  vae = AutoencoderKLWan(**WAN_VAE)
  for name, module in (('umt5', umt5), ('transformer', transformer), ('vae', vae)):
    _randomize(module, sub(name))
  pipe = WanPipeline(
      tokenizer=tokenizer,
      text_encoder=umt5.eval(),
      vae=vae.eval(),
      scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER),
      transformer=transformer.eval(),
  )
  pipe.save_pretrained(folder, safe_serialization=True)
  return {
      'family': 'wan',
      'transformer': {
          k: list(v) if isinstance(v, tuple) else v for k, v in WAN_TRANSFORMER.items()
      },
      'vae': {
          k: WAN_VAE[k] for k in ('z_dim', 'base_dim', 'dim_mult', 'latents_mean', 'latents_std')
      },
      'vae_scale_factor': 2 ** len(WAN_VAE['temperal_downsample']),
      'vae_scale_factor_temporal': 2 ** sum(WAN_VAE['temperal_downsample']),
      'latent_channels': WAN_Z_DIM,
      'text_dim': WAN_TRANSFORMER['text_dim'],
      'seed': seed,
  }


def _new_folder(folder, seed) -> str:
  folder = os.fspath(folder)
  if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
    raise ValueError(f'{folder} exists and is not an empty folder; choose a new --out')
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f'seed={seed!r} must be a non-negative int')
  return folder


def _streams(seed):
  """Distinct, seed-determined generator seeds per component (no shared global RNG state)."""
  return lambda name: int.from_bytes(hashlib.sha256(f'{seed}/{name}'.encode()).digest()[:6], 'big')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  try:
    make = {'qwenimage': build, 'flux': build_flux, 'wan': build_wan}[flags.FLAGS.family]
    sizes = make(flags.FLAGS.out, seed=flags.FLAGS.seed)
  except ValueError as e:
    raise SystemExit(f'digen_jax.experiment.tiny_pipeline: {e}') from None
  print(json.dumps(sizes, indent=1))


if __name__ == '__main__':
  # Defined here, not at import: tests import build() next to other modules' flags.
  flags.DEFINE_string('out', None, 'Folder to write the toy pipeline into (new or empty).')
  flags.DEFINE_integer('seed', 0, 'Seed of every weight.')
  flags.DEFINE_enum('family', 'qwenimage', ['qwenimage', 'flux', 'wan'], 'Which pipeline to build.')
  flags.mark_flags_as_required(['out'])
  app.run(main)
