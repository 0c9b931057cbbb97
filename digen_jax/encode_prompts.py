"""Runs a pipeline folder's text encoder once per prompt; writes the embedding cache training reads.

  python -m digen_jax.encode_prompts --config=configs/qwenimage.py[:variant] \
      [--prompts=FILE|tfds-name] [--split=train,eval] [--data_dir=DIR] [--out=DIR] \
      [--batch_size=16] [--device=cuda] [--dtype=bfloat16] \
      [--config.model.checkpoint=/path/Qwen-Image] [--config.x=y ...]

The pipeline folder is config.model.checkpoint; its text encoder(s) and tokenizer(s) are loaded
with transformers and every prompt is encoded exactly as diffusers' encode_prompt does, chosen by
model_index.json's _class_name:
  QwenImagePipeline  text_encoder/ + tokenizer/ (Qwen2.5-VL): chat template, the first 34 template
                     tokens dropped, last hidden state at the attended positions, at most 1024
                     tokens.
  FluxPipeline       text_encoder_2/ + tokenizer_2/ (T5): last hidden state of the prompt padded
                     to max_sequence_length = config.text.max_length (FLUX.1-dev 512, -schnell
                     256), pads included (FLUX attends to them); text_encoder/ + tokenizer/
                     (CLIP): pooler_output of the prompt padded to 77 tokens, the pooled vector.
  WanPipeline        text_encoder/ + tokenizer/ (umT5): diffusers' prompt_clean, last hidden state
                     at the prompt's own tokens of the prompt padded to max_sequence_length =
                     config.text.max_length (512); the reader pads it back with zeros, as the
                     pipeline does.
A prompt longer than a tokenizer's limit is truncated, as diffusers does (it only warns): the
cached embeddings are then exactly what the pipeline would condition on. The run logs how many,
and a FLUX or Wan cache records each prompt's token counts (EmbeddingCache.truncated says which
encoders cut it). Besides the prompts, config.sampler.negative_prompt and '' are encoded, so
classifier-free guidance finds them. --prompts defaults to config.data.prompts: a text file (one
prompt per line) or a tfds prompt dataset ('shapes', 'prompt_file/<name>'), whose --split
defaults to config.data.split and config.eval.split. --out defaults to config.text.cache.

The cache format is models/text/text_cache.py's. An existing cache made by the same encoder (same
files, same compute dtype, for FLUX the same max_sequence_length) gets only the prompts it lacks;
a different encoder is an error. One shard is written at a time and the index replaced
atomically after each, so an interrupted run keeps every completed shard and the next run carries
on. Torch runs in this process only.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Optional, Sequence, Union

from absl import app
from absl import flags
from absl import logging

from digen_jax.models.text import text_cache

DTYPES = ('float32', 'bfloat16', 'float16')


def folder_dtype(config_json: dict[str, Any]) -> str:
  """The dtype a text_encoder/config.json says its weights are in (float32 if unrecorded)."""
  text_config = config_json.get('text_config') or {}
  for c in (config_json, text_config):
    dtype = c.get('dtype') or c.get('torch_dtype')
    if dtype:
      return dtype
  return 'float32'


def _transformers_class(folder: str, part: str, qualified: str):
  """The transformers class model_index.json names ('transformers.X') for a component."""
  import transformers  # pylint: disable=g-import-not-at-top

  library, name = qualified.split('.', 1)
  if library != 'transformers' or not hasattr(transformers, name):
    raise ValueError(
        f"{os.path.join(folder, 'model_index.json')}: {part} class "
        f'{library}.{name} is not a transformers class'
    )
  return getattr(transformers, name)


def _load(
    folder: str, encoder: str, tokenizer: str, classes: tuple[str, str], dtype: str, device: str
):
  """(tokenizer, text encoder in eval mode on device, in dtype) of a pipeline folder's parts."""
  import torch  # pylint: disable=g-import-not-at-top

  tok = _transformers_class(folder, tokenizer, classes[1]).from_pretrained(
      os.path.join(folder, tokenizer)
  )
  # use_safetensors: never fall back to pickled .bin weights (torch.load runs code).
  model = (
      _transformers_class(folder, encoder, classes[0])
      .from_pretrained(
          os.path.join(folder, encoder), dtype=getattr(torch, dtype), use_safetensors=True
      )
      .to(device)
      .eval()
  )
  return tok, model


def _check_dtype(dtype: str) -> str:
  if dtype not in DTYPES:
    raise ValueError(f'--dtype={dtype!r} must be one of {DTYPES}')
  return dtype


class QwenPromptEncoder:
  """A pipeline folder's Qwen2.5-VL text encoder and tokenizer, as QwenImagePipeline runs them.

  folder: the diffusers pipeline folder. device: torch device ('' = cuda if available, else cpu).
  dtype: compute dtype name ('' = the dtype the folder's weights are stored in).
  """

  pooled_dim = None  # Qwen-Image conditions on the sequence alone

  def __init__(self, folder: str, device: str = '', dtype: str = ''):
    import torch  # pylint: disable=g-import-not-at-top

    self.torch = torch
    self.identity = text_cache.encoder_fingerprint(folder)
    self.dtype = _check_dtype(dtype or folder_dtype(self.identity['config']))
    self.identity['compute_dtype'] = self.dtype
    self.device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    self.tokenizer, self.model = _load(
        folder,
        'text_encoder',
        'tokenizer',
        (self.identity['class'], self.identity['tokenizer_class']),
        self.dtype,
        self.device,
    )
    self.name = self.identity['class']
    self.dim = self.identity['dim']
    self.template = self.identity['template']
    self.drop_idx = self.identity['drop_idx']
    self.max_sequence_length = self.identity['max_sequence_length']

  def token_counts(self, prompts: Sequence[str]) -> list[int]:
    """Templated token counts before truncation (sorting by them keeps batches' padding small)."""
    enc = self.tokenizer([self.template.format(p) for p in prompts])
    return [len(ids) for ids in enc['input_ids']]

  def truncated(self, prompts: Sequence[str]) -> list[str]:
    """The prompts with more than max_sequence_length tokens after the template (diffusers cuts
    them)."""
    limit = self.max_sequence_length + self.drop_idx
    return [p for p, n in zip(prompts, self.token_counts(prompts)) if n > limit]

  def embed(self, prompts: Sequence[str]) -> list[text_cache.Entry]:
    """Per prompt its [len_i, dim] float32 embeddings: diffusers' _get_qwen_prompt_embeds,
    unpadded."""
    torch = self.torch
    tokens = self.tokenizer(
        [self.template.format(p) for p in prompts],
        max_length=self.max_sequence_length + self.drop_idx,
        padding=True,
        truncation=True,
        return_tensors='pt',
    ).to(self.device)
    with torch.inference_mode():
      # The language model alone: hidden_states[-1] of the full model is this model's last
      # hidden state, and skipping the lm_head saves a [B, T, vocab] logits tensor (5 GB for
      # 16 long prompts with Qwen's 152k vocabulary) that diffusers computes and discards.
      out = self.model.model(
          input_ids=tokens.input_ids,
          attention_mask=tokens.attention_mask,
          output_hidden_states=True,
          use_cache=False,
      )
      hidden = out.hidden_states[-1]
      mask = tokens.attention_mask.bool()
      split = torch.split(hidden[mask], mask.sum(dim=1).tolist(), dim=0)
      return [
          text_cache.Entry(p, e[self.drop_idx :][: self.max_sequence_length].float().cpu().numpy())
          for p, e in zip(prompts, split)
      ]


class FluxPromptEncoder:
  """A FLUX.1 pipeline folder's two text encoders, as FluxPipeline.encode_prompt runs them: T5
  (text_encoder_2) gives the sequence, CLIP (text_encoder) the pooled vector.

  folder, device: as QwenPromptEncoder's. dtype: compute dtype of both ('' = the dtype the
  folder's weights are stored in; the two must agree, as FluxPipeline.from_pretrained(torch_dtype)
  runs them). max_sequence_length: the T5 length (None: diffusers' default 512).
  """

  def __init__(
      self,
      folder: str,
      device: str = '',
      dtype: str = '',
      max_sequence_length: Optional[int] = None,
  ):
    import torch  # pylint: disable=g-import-not-at-top

    self.torch = torch
    self.identity = text_cache.encoder_fingerprint(folder, max_sequence_length)
    encoders = self.identity['encoders']
    if not dtype:
      stored = {k: folder_dtype(e['config']) for k, e in encoders.items()}
      if len(set(stored.values())) > 1:
        raise ValueError(
            f'{folder}: the text encoders are stored in different dtypes {stored}; ' 'give --dtype'
        )
      dtype = stored['text_encoder_2']
    self.dtype = _check_dtype(dtype)
    self.identity['compute_dtype'] = self.dtype
    self.device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    self.clip_tokenizer, self.clip = _load(
        folder,
        'text_encoder',
        'tokenizer',
        (encoders['text_encoder']['class'], encoders['text_encoder']['tokenizer_class']),
        self.dtype,
        self.device,
    )
    self.t5_tokenizer, self.t5 = _load(
        folder,
        'text_encoder_2',
        'tokenizer_2',
        (encoders['text_encoder_2']['class'], encoders['text_encoder_2']['tokenizer_class']),
        self.dtype,
        self.device,
    )
    self.clip_length = encoders['text_encoder']['max_length']
    if self.clip_tokenizer.model_max_length != self.clip_length:  # diffusers pads to the former
      raise ValueError(
          f'{folder}/tokenizer loads with model_max_length '
          f'{self.clip_tokenizer.model_max_length}, its tokenizer_config.json says '
          f'{self.clip_length}'
      )
    self.name = f"{encoders['text_encoder_2']['class']} + {encoders['text_encoder']['class']}"
    self.dim = self.identity['dim']
    self.pooled_dim = self.identity['pooled_dim']
    self.max_sequence_length = self.identity['max_sequence_length']

  def tokens(self, prompts: Sequence[str]) -> list[dict[str, int]]:
    """Per prompt {text_encoder: CLIP tokens, text_encoder_2: T5 tokens}, before truncation."""
    clip = self.clip_tokenizer(list(prompts))['input_ids']
    t5 = self.t5_tokenizer(list(prompts))['input_ids']
    return [{'text_encoder': len(c), 'text_encoder_2': len(t)} for c, t in zip(clip, t5)]

  def token_counts(self, prompts: Sequence[str]) -> list[int]:
    """T5 token counts before truncation (every batch is padded to max_sequence_length anyway)."""
    return [n['text_encoder_2'] for n in self.tokens(prompts)]

  def truncated(self, prompts: Sequence[str]) -> list[str]:
    """The prompts that CLIP's 77 or T5's max_sequence_length tokens cut (diffusers truncates)."""
    return [
        p
        for p, n in zip(prompts, self.tokens(prompts))
        if n['text_encoder'] > self.clip_length or n['text_encoder_2'] > self.max_sequence_length
    ]

  def embed(self, prompts: Sequence[str]) -> list[text_cache.Entry]:
    """Per prompt its [max_sequence_length, dim] T5 embeddings (pads included), [pooled_dim] CLIP
    pooled vector and token counts: FluxPipeline's _get_t5_prompt_embeds and
    _get_clip_prompt_embeds (tokenizer padding='max_length', truncation, no attention mask)."""
    torch = self.torch
    prompts = list(prompts)
    clip_ids = self.clip_tokenizer(
        prompts,
        padding='max_length',
        max_length=self.clip_length,
        truncation=True,
        return_tensors='pt',
    ).input_ids
    t5_ids = self.t5_tokenizer(
        prompts,
        padding='max_length',
        max_length=self.max_sequence_length,
        truncation=True,
        return_tensors='pt',
    ).input_ids
    with torch.inference_mode():
      pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
      seq = self.t5(t5_ids.to(self.device), output_hidden_states=False)[0]
      pooled, seq = pooled.float().cpu().numpy(), seq.float().cpu().numpy()
    return [
        text_cache.Entry(p, s, q, n)
        for p, s, q, n in zip(prompts, seq, pooled, self.tokens(prompts))
    ]


class UMT5PromptEncoder:
  """A Wan2.1 pipeline folder's umT5 text encoder and tokenizer, as WanPipeline.encode_prompt runs
  them (_get_t5_prompt_embeds).

  folder, device, dtype: as QwenPromptEncoder's. max_sequence_length: the padded length (None:
  diffusers' 512). diffusers' own prompt_clean cleans the prompts (it applies ftfy when that is
  installed: the identity records which).
  """

  pooled_dim = None  # Wan conditions on the sequence alone

  def __init__(
      self,
      folder: str,
      device: str = '',
      dtype: str = '',
      max_sequence_length: Optional[int] = None,
  ):
    import torch  # pylint: disable=g-import-not-at-top
    from diffusers.pipelines.wan import pipeline_wan  # pylint: disable=g-import-not-at-top
    from diffusers.utils import is_ftfy_available  # pylint: disable=g-import-not-at-top

    self.torch = torch
    self.clean = pipeline_wan.prompt_clean
    self.identity = text_cache.encoder_fingerprint(folder, max_sequence_length)
    encoder = self.identity['encoders']['text_encoder']
    self.dtype = _check_dtype(dtype or folder_dtype(encoder['config']))
    self.identity['compute_dtype'] = self.dtype
    self.identity['prompt_clean'] = (
        'ftfy, html, whitespace' if is_ftfy_available() else 'html, whitespace'
    )
    self.device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    self.tokenizer, self.model = _load(
        folder,
        'text_encoder',
        'tokenizer',
        (encoder['class'], encoder['tokenizer_class']),
        self.dtype,
        self.device,
    )
    self.name = encoder['class']
    self.dim = self.identity['dim']
    self.max_sequence_length = self.identity['max_sequence_length']

  def token_counts(self, prompts: Sequence[str]) -> list[int]:
    """Token counts of the cleaned prompts before truncation (</s> included)."""
    ids = self.tokenizer([self.clean(p) for p in prompts])['input_ids']
    return [len(i) for i in ids]

  def truncated(self, prompts: Sequence[str]) -> list[str]:
    """The prompts with more than max_sequence_length tokens (diffusers cuts them)."""
    counts = self.token_counts(prompts)
    return [p for p, n in zip(prompts, counts) if n > self.max_sequence_length]

  def embed(self, prompts: Sequence[str]) -> list[text_cache.Entry]:
    """Per prompt its [len_i, dim] float32 embeddings (the rows WanPipeline keeps before padding
    with zeros) and its token count."""
    torch = self.torch
    prompts = list(prompts)
    tokens = self.tokenizer(
        [self.clean(p) for p in prompts],
        padding='max_length',
        max_length=self.max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors='pt',
    )
    lengths = tokens.attention_mask.gt(0).sum(dim=1).tolist()
    with torch.inference_mode():
      hidden = self.model(
          tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
      ).last_hidden_state
      hidden = hidden.float().cpu().numpy()
    counts = self.token_counts(prompts)
    return [
        text_cache.Entry(p, h[:n], None, {'text_encoder': c})
        for p, h, n, c in zip(prompts, hidden, lengths, counts)
    ]


PromptEncoder = Union[QwenPromptEncoder, FluxPromptEncoder, UMT5PromptEncoder]


def prompt_encoder(
    folder: str, device: str = '', dtype: str = '', max_sequence_length: Optional[int] = None
) -> PromptEncoder:
  """The encoder of a pipeline folder's class (model_index.json): QwenPromptEncoder,
  FluxPromptEncoder or UMT5PromptEncoder. max_sequence_length: FLUX's T5 length, Wan's umT5
  length; not used by Qwen-Image."""
  pipeline = text_cache.pipeline_class(folder)
  if text_cache.is_flux(pipeline):
    return FluxPromptEncoder(folder, device, dtype, max_sequence_length)
  if text_cache.is_wan(pipeline):
    return UMT5PromptEncoder(folder, device, dtype, max_sequence_length)
  return QwenPromptEncoder(folder, device, dtype)


def gather_prompts(config, prompts: str = '', split: str = '', data_dir: str = '') -> list[str]:
  """The prompts to encode: config.sampler.negative_prompt, '', then the source's (distinct).

  prompts: a text file or tfds dataset name ('' = config.data.prompts). split: comma-separated
  splits of a dataset ('' = config.data.split and config.eval.split, those that exist; a file has
  the one split 'train'). data_dir: tfds data_dir for datasets.
  """
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)
  from digen_jax.data import prompts as prompt_data  # pylint: disable=g-import-not-at-top

  source = prompts or config.data.prompts
  negative = config.sampler.get('negative_prompt', ' ')
  out = [negative, '']
  if os.path.isfile(source):
    if split not in ('', 'train'):
      raise ValueError(f'--split={split!r}: a prompt file ({source}) has only the split train')
    out += [p for _, p in prompt_data.read_prompt_file(source, int(config.data.max_prompt_chars))]
  else:
    if not data_dir:
      raise ValueError('data_dir is required for a tfds prompt dataset')
    wanted = (
        split.split(',') if split else list(dict.fromkeys([config.data.split, config.eval.split]))
    )
    for i, s in enumerate(wanted):
      try:
        seq = prompt_data.load_prompts(source, s, data_dir, int(config.data.max_prompt_chars))
      except ValueError as e:
        if split or i == 0 or 'has no split' not in str(e):
          raise
        logging.info('%s has no split %r (config.eval.split); skipped', source, s)
        continue
      out += seq[:]
  return list(dict.fromkeys(out))


def encode_to_cache(
    encoder: PromptEncoder,
    prompts: Sequence[str],
    out: str,
    batch_size: int = 16,
    shard_bytes: int = 512 << 20,
    max_length: Optional[int] = None,
) -> dict[str, Any]:
  """Adds the prompts `out` lacks; returns {new, cached, total, truncated, too_long, shards}.

  max_length: config.text.max_length, only to warn about prompts a run could not read.
  """
  if batch_size < 1:
    raise ValueError(f'--batch_size={batch_size} must be >= 1')
  with text_cache.CacheWriter(out, encoder.identity, encoder.dim, encoder.pooled_dim) as writer:
    todo = writer.missing(prompts)
    cached = len(dict.fromkeys(prompts)) - len(todo)
    counts = encoder.token_counts(todo) if todo else []
    truncated = encoder.truncated(todo) if todo else []
    if truncated:
      logging.warning(
          '%d prompts exceed a tokenizer limit (%s) and are truncated as diffusers '
          'does, e.g. %r',
          len(truncated),
          _limits(encoder),
          truncated[0][:80],
      )
    order = sorted(range(len(todo)), key=lambda i: counts[i])
    pending, pending_bytes, shards, too_long = [], 0, [], []
    t0 = time.time()
    for start in range(0, len(order), batch_size):
      batch = [todo[i] for i in order[start : start + batch_size]]
      for entry in encoder.embed(batch):
        pending.append(entry)
        pending_bytes += entry.embeddings.nbytes
        if max_length is not None and len(entry.embeddings) > max_length:
          too_long.append(entry.text)
      if pending_bytes >= shard_bytes:
        shards.append(writer.add(pending))
        pending, pending_bytes = [], 0
        logging.info(
            'encoded %d/%d prompts (%.1f/s)',
            start + len(batch),
            len(todo),
            (start + len(batch)) / (time.time() - t0),
        )
    if pending:
      shards.append(writer.add(pending))
    if too_long:
      logging.warning(
          '%d prompts have more than config.text.max_length=%d tokens, e.g. %r; a '
          'run with this config will refuse them',
          len(too_long),
          max_length,
          too_long[0][:80],
      )
    return {
        'new': len(todo),
        'cached': cached,
        'total': len(writer),
        'truncated': len(truncated),
        'too_long': len(too_long),
        'shards': shards,
    }


def _limits(encoder: PromptEncoder) -> str:
  if isinstance(encoder, FluxPromptEncoder):
    return f'CLIP {encoder.clip_length}, T5 {encoder.max_sequence_length} tokens'
  if isinstance(encoder, UMT5PromptEncoder):
    return f'umT5 {encoder.max_sequence_length} tokens'
  return f'{encoder.max_sequence_length} tokens after the template'


def _define_flags():
  from digen_jax.process import cli  # pylint: disable=g-import-not-at-top  (defines --config, --workdir)
  # encode_prompts writes no run directory: --workdir only roots tfds prompt data (as in training).
  flags.FLAGS.set_default('workdir', '')
  flags.DEFINE_string(
      'prompts', '', 'Prompt file or tfds dataset name; default ' 'config.data.prompts.'
  )
  flags.DEFINE_string(
      'split',
      '',
      'Dataset splits, comma-separated; default config.data.split and ' 'config.eval.split.',
  )
  flags.DEFINE_string(
      'data_dir',
      '',
      'tfds data_dir of prompt datasets; default '
      'config.data.data_dir, else $DIGEN_DATA_DIR, else <--workdir>/data, else a temporary '
      'folder.',
  )
  flags.DEFINE_string('out', '', 'Cache folder; default config.text.cache.')
  flags.DEFINE_integer('batch_size', 16, 'Prompts per text-encoder forward.')
  flags.DEFINE_integer('shard_mb', 512, 'Write a shard (and update the index) every this many MB.')
  flags.DEFINE_string('device', '', "Torch device; '' = cuda if available, else cpu.")
  flags.DEFINE_string('dtype', '', f"Compute dtype {DTYPES}; '' = the folder's weights' dtype.")
  return cli


def main(argv, cli):
  if len(argv) > 1:
    cli.fail(f'encode_prompts: unexpected arguments {argv[1:]}')
  logging.set_verbosity(logging.INFO)
  config, workdir = cli.config_and_workdir()
  f = flags.FLAGS
  out = f.out or config.text.get('cache', '')
  if not out:
    cli.fail('encode_prompts: give --out=DIR (or set config.text.cache)')
  if not config.model.checkpoint:
    cli.fail(
        'encode_prompts: config.model.checkpoint is empty; set '
        '--config.model.checkpoint=/path/to/diffusers/pipeline (the folder with '
        'model_index.json)'
    )
  if config.text.encoder == 'word':
    cli.fail("encode_prompts: config.text.encoder='word' is computed in training; no cache needed")
  try:
    with tempfile.TemporaryDirectory() as tmp:
      from digen_jax.data import prompts as prompt_data  # pylint: disable=g-import-not-at-top

      data_dir = f.data_dir or prompt_data.resolve_data_dir(config.data.data_dir, workdir or tmp)
      prompts = gather_prompts(config, f.prompts, f.split, data_dir)
    # FLUX's T5 and Wan's umT5 sequences are padded to config.text.max_length: one length.
    encoder = prompt_encoder(
        config.model.checkpoint,
        device=f.device,
        dtype=f.dtype,
        max_sequence_length=config.text.max_length,
    )
    logging.info(
        'text encoder %s (%s on %s), %d prompts (with the negative and empty prompt)',
        encoder.name,
        encoder.dtype,
        encoder.device,
        len(prompts),
    )
    stats = encode_to_cache(
        encoder,
        prompts,
        out,
        batch_size=f.batch_size,
        shard_bytes=f.shard_mb << 20,
        max_length=config.text.max_length,
    )
  except (ValueError, FileNotFoundError) as e:
    cli.fail(f'encode_prompts: {e}')
  pooled = f', pooled dim {encoder.pooled_dim}' if encoder.pooled_dim else ''
  truncated = f", {stats['truncated']} truncated" if stats['truncated'] else ''
  print(
      f"encode_prompts: {stats['new']} prompts encoded{truncated}, {stats['cached']} already "
      f"cached -> {out} ({stats['total']} prompts, dim {encoder.dim}{pooled}, {encoder.dtype})",
      flush=True,
  )


if __name__ == '__main__':
  _cli = _define_flags()
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__, ('digen_jax.process.cli',))
  app.run(lambda argv: main(argv, _cli), flags_parser=_cli.parse_flags)
