"""Text-embedding cache: a real text encoder's outputs, computed once per prompt, read by training.

The training process never runs (or imports) torch: `python -m digen_jax.encode_prompts` runs a
pipeline folder's text encoder(s) in its own process and writes a cache folder; `EmbeddingCache`
reads it through the `TextEncoder` interface of models/text.py (`PooledTextEncoder` where the
pipeline also conditions on a pooled vector). This module holds the whole format, both sides of
it, with numpy + safetensors + json only.

Cache folder layout:
  index.json           {format, dim, pooled_dim, dtype, identity, shards, prompts, digest}
  shard-NNNNN.safetensors   per prompt, keyed by sha256(prompt utf-8) (hex): one float32 tensor
                       [length, dim], the prompt's sequence embeddings; and, in a cache with
                       pooled_dim set, one float32 [pooled_dim] tensor keyed '<sha256>.pooled'
  .lock                held while a writer appends

Per pipeline (model_index.json's _class_name), as diffusers' encode_prompt computes them:
  QwenImagePipeline   Qwen2.5-VL last hidden state at the prompt's own (unpadded) length; no
                      pooled vector (pooled_dim null).
  FluxPipeline        T5 (text_encoder_2) last hidden state padded to max_sequence_length: FLUX
                      passes no attention mask, so the pad positions are conditioning too and are
                      stored (length = max_sequence_length for every prompt); CLIP (text_encoder)
                      pooler_output as the pooled vector [pooled_dim].

index.json fields: `prompts` lists {text, shard, key, length[, tokens]} per prompt, `tokens` being
{component: token count before truncation} for each tokenizer that can cut a prompt (FLUX's; see
`EmbeddingCache.truncated`); `shards` maps each shard file to {bytes, sha256, count}; `identity`
is the encoder that made the cache (see `encoder_fingerprint`, plus `compute_dtype`); `digest` is
the sha256 of the canonical JSON of every other field, so a hand-edited index or a shard whose
bytes changed is caught on open. Format 1 (Qwen-Image only: no pooled_dim, no tokens) is read as
is and rewritten as format 2 by the next append.

A writer appends one shard at a time: the shard goes to a temp file and is renamed into place,
then index.json is replaced the same way, so an interrupted run leaves the previous cache valid
(and the prompts of every completed shard kept).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import shlex
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

FORMAT = 'digen_jax.embedding_cache/2'
_READABLE_FORMATS = ('digen_jax.embedding_cache/1', FORMAT)  # 1: a subset of 2 (see above)
INDEX = 'index.json'
DTYPE = 'float32'

# diffusers' QwenImagePipeline.__init__ (0.42.1): the chat template every prompt is wrapped in, the
# number of leading template tokens whose hidden states are dropped, and the tokenizer's length
# limit after them (tokenizer_max_length). The embeddings are the last hidden state
# (hidden_states[-1]) at the attention-masked positions.
QWENIMAGE_TEMPLATE = (
    '<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, '
    'quantity, text, spatial relationships of the objects and background:<|im_end|>\n'
    '<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n'
)
QWENIMAGE_DROP_IDX = 34
QWENIMAGE_MAX_SEQUENCE_LENGTH = 1024
# Pipelines whose prompts are encoded this way, by model_index.json's _class_name.
_QWENIMAGE_PIPELINES = ('QwenImagePipeline', 'QwenImageImg2ImgPipeline', 'QwenImageInpaintPipeline')

# diffusers' FluxPipeline (0.42.1): CLIPTextModel's pooler_output of the prompt padded to the CLIP
# tokenizer's model_max_length (77), and T5EncoderModel's last hidden state of the prompt padded
# to max_sequence_length, both truncated to those lengths. encode_prompt's default length is 512
# and check_inputs refuses more; FLUX.1-schnell is run with 256.
FLUX_MAX_SEQUENCE_LENGTH = 512
# The FLUX pipelines whose encode_prompt is a copy of FluxPipeline's.
_FLUX_PIPELINES = ('FluxPipeline', 'FluxImg2ImgPipeline', 'FluxInpaintPipeline')
_FLUX_CLASSES = {
    'text_encoder': 'transformers.CLIPTextModel',
    'text_encoder_2': 'transformers.T5EncoderModel',
}

_FINGERPRINT_CHUNK = 4 << 20  # bytes read from each end of a weights file
_HASH_BLOCK = 16 << 20
_SHARD_RE = re.compile(r'shard-\d{5}\.safetensors')


def prompt_key(text: str) -> str:
  """The safetensors key of a prompt: sha256 of its UTF-8 bytes, hex."""
  return hashlib.sha256(text.encode('utf-8')).hexdigest()


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while block := f.read(_HASH_BLOCK):
      h.update(block)
  return h.hexdigest()


def _weights_digest(path: str) -> str:
  """sha256 over a weights file's size and its first and last 4 MiB: reading a 16 GB encoder
  whole on every open would be too slow, and any re-save or different checkpoint changes these."""
  size = os.path.getsize(path)
  h = hashlib.sha256(str(size).encode() + b'\n')
  with open(path, 'rb') as f:
    h.update(f.read(_FINGERPRINT_CHUNK))
    if size > _FINGERPRINT_CHUNK:
      f.seek(max(_FINGERPRINT_CHUNK, size - _FINGERPRINT_CHUNK))
      h.update(f.read())
  return h.hexdigest()


def _read_json(path: str, what: str) -> Any:
  try:
    with open(path, 'rb') as f:
      return json.loads(f.read().decode('utf-8'))
  except FileNotFoundError:
    raise ValueError(f'{path} not found ({what})') from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f'{path} is not valid JSON ({what}): {e}') from e


def _canonical(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, ensure_ascii=True, separators=(',', ':')).encode()


def text_hidden_size(
    config: Mapping[str, Any], key: str = 'hidden_size', where: str = 'text_encoder/config.json'
) -> int:
  """The text model's hidden size from a text_encoder/config.json (nested text_config in
  transformers >= 5 saves, flat in older ones, e.g. Qwen/Qwen-Image's); key: its name (T5's is
  d_model)."""
  text_config = config.get('text_config') or {}
  dim = text_config.get(key, config.get(key))
  if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
    raise ValueError(f'{where} has no positive int {key} (got {dim!r})')
  return dim


def _model_index(pipeline_folder: str) -> tuple[dict[str, Any], str, str]:
  """(model_index.json, its path, its supported _class_name) of a diffusers pipeline folder."""
  folder = os.fspath(pipeline_folder)
  index_path = os.path.join(folder, 'model_index.json')
  if not os.path.isfile(index_path):
    raise ValueError(
        f'{folder} is not a diffusers pipeline folder: {index_path} not found '
        '(set config.model.checkpoint to the folder holding model_index.json)'
    )
  model_index = _read_json(index_path, 'the pipeline description')
  pipeline = model_index.get('_class_name')
  if pipeline not in _QWENIMAGE_PIPELINES + _FLUX_PIPELINES:
    raise ValueError(
        f'{index_path}: _class_name {pipeline!r} is not a supported pipeline; known: '
        f'{list(_QWENIMAGE_PIPELINES + _FLUX_PIPELINES)}'
    )
  return model_index, index_path, pipeline


def pipeline_class(pipeline_folder: str) -> str:
  """model_index.json's _class_name, one this module can encode for (else ValueError)."""
  return _model_index(pipeline_folder)[2]


def is_flux(pipeline: str) -> bool:
  """Whether a pipeline class encodes prompts as FluxPipeline does (T5 sequence + CLIP pooled)."""
  return pipeline in _FLUX_PIPELINES


def _component_class(model_index: Mapping[str, Any], index_path: str, part: str) -> str:
  entry = model_index.get(part)
  if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
    raise ValueError(f'{index_path}: {part!r} must be [library, class]; got {entry!r}')
  return '.'.join(entry)


def _component_files(folder: str, encoder: str, tokenizer: str) -> dict[str, str]:
  """{path in the folder: digest} of a text encoder's config.json and weights and of every file
  of its tokenizer."""
  files = {f'{encoder}/config.json': _sha256_file(os.path.join(folder, encoder, 'config.json'))}
  tok_dir = os.path.join(folder, tokenizer)
  if not os.path.isdir(tok_dir) or not os.listdir(tok_dir):
    raise ValueError(f'{tok_dir} is missing or empty (the pipeline folder needs its {tokenizer})')
  for name in sorted(os.listdir(tok_dir)):
    if os.path.isfile(os.path.join(tok_dir, name)):
      files[f'{tokenizer}/{name}'] = _sha256_file(os.path.join(tok_dir, name))
  te_dir = os.path.join(folder, encoder)
  weights = sorted(n for n in os.listdir(te_dir) if n.endswith('.safetensors'))
  if not weights:
    raise ValueError(
        f'{te_dir} has no *.safetensors weights (only safetensors are read; convert '
        'pickled .bin weights with save_pretrained(safe_serialization=True))'
    )
  for name in weights:
    files[f'{encoder}/{name}'] = _weights_digest(os.path.join(te_dir, name))
  return files


def encoder_fingerprint(
    pipeline_folder: str, max_sequence_length: Optional[int] = None
) -> dict[str, Any]:
  """The identity of a diffusers pipeline folder's prompt encoding, computed without torch.

  max_sequence_length: FLUX only, the T5 length every prompt is padded (or truncated) to, as
  FluxPipeline.encode_prompt's argument (None: its default 512; a run passes
  config.text.max_length). Qwen-Image's limit is fixed by its pipeline and this is not used.

  Qwen-Image: {class, tokenizer_class, config (text_encoder/config.json), dim, template,
  drop_idx, max_sequence_length, hidden_state_layer, files, fingerprint}.
  FLUX: {pipeline, encoders {text_encoder (CLIP), text_encoder_2 (T5): {class, tokenizer_class,
  config, dim, max_length (the tokenizer's padded length), output}}, dim (T5's), pooled_dim
  (CLIP's), max_sequence_length, padding: 'max_length', files, fingerprint}.
  `files` covers each text encoder's config.json, every file of its tokenizer folder, and each of
  its weights files by size + first and last 4 MiB; `fingerprint` is the sha256 over `files`.
  """
  folder = os.fspath(pipeline_folder)
  model_index, index_path, pipeline = _model_index(folder)
  if is_flux(pipeline):
    return _flux_fingerprint(folder, model_index, index_path, pipeline, max_sequence_length)
  classes = {
      part: _component_class(model_index, index_path, part)
      for part in ('text_encoder', 'tokenizer')
  }
  config = _read_json(os.path.join(folder, 'text_encoder', 'config.json'), 'the text encoder')
  files = _component_files(folder, 'text_encoder', 'tokenizer')
  return {
      'class': classes['text_encoder'],
      'tokenizer_class': classes['tokenizer'],
      'config': config,
      'dim': text_hidden_size(config),
      'template': QWENIMAGE_TEMPLATE,
      'drop_idx': QWENIMAGE_DROP_IDX,
      'max_sequence_length': QWENIMAGE_MAX_SEQUENCE_LENGTH,
      'hidden_state_layer': -1,
      'files': files,
      'fingerprint': hashlib.sha256(_canonical(files)).hexdigest(),
  }


def _flux_fingerprint(
    folder: str,
    model_index: Mapping[str, Any],
    index_path: str,
    pipeline: str,
    max_sequence_length: Optional[int],
) -> dict[str, Any]:
  if max_sequence_length is None:
    max_sequence_length = FLUX_MAX_SEQUENCE_LENGTH
  if (
      isinstance(max_sequence_length, bool)
      or not isinstance(max_sequence_length, int)
      or not 1 <= max_sequence_length <= FLUX_MAX_SEQUENCE_LENGTH
  ):
    raise ValueError(
        f'max_sequence_length={max_sequence_length!r}: {pipeline} pads T5 prompts to '
        f'1..{FLUX_MAX_SEQUENCE_LENGTH} tokens (FLUX.1-dev is run with 512, -schnell '
        'with 256); a run sets it with config.text.max_length'
    )
  encoders, files = {}, {}
  # (encoder, tokenizer, its config's width field, what FluxPipeline takes from its output)
  for part, tok, width, output in (
      ('text_encoder', 'tokenizer', 'hidden_size', 'pooler_output'),
      ('text_encoder_2', 'tokenizer_2', 'd_model', 'last_hidden_state'),
  ):
    cls = _component_class(model_index, index_path, part)
    if cls != _FLUX_CLASSES[part]:
      raise ValueError(
          f'{index_path}: {part} is {cls}; {pipeline} encodes prompts with '
          f'{_FLUX_CLASSES[part]} there'
      )
    config = _read_json(os.path.join(folder, part, 'config.json'), f'the {part}')
    files.update(_component_files(folder, part, tok))
    if part == 'text_encoder':
      # FluxPipeline pads CLIP prompts to the tokenizer's own model_max_length.
      limit = _read_json(os.path.join(folder, tok, 'tokenizer_config.json'), f'the {tok}').get(
          'model_max_length'
      )
      # (transformers writes 1e30 when a tokenizer was saved without a limit)
      if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1 << 20:
        raise ValueError(
            f'{tok}/tokenizer_config.json has no usable model_max_length (got '
            f'{limit!r}); {pipeline} pads CLIP prompts to it (77 for CLIP)'
        )
    else:
      limit = max_sequence_length
    encoders[part] = {
        'class': cls,
        'tokenizer_class': _component_class(model_index, index_path, tok),
        'config': config,
        'dim': text_hidden_size(config, width, f'{part}/config.json'),
        'max_length': limit,
        'output': output,
    }
  return {
      'pipeline': pipeline,
      'encoders': encoders,
      'dim': encoders['text_encoder_2']['dim'],
      'pooled_dim': encoders['text_encoder']['dim'],
      'max_sequence_length': max_sequence_length,
      'padding': 'max_length',  # every prompt padded to max_sequence_length, pads attended
      'files': files,
      'fingerprint': hashlib.sha256(_canonical(files)).hexdigest(),
  }


def _flat(obj: Any, prefix: str) -> dict[str, Any]:
  if isinstance(obj, dict):
    out = {}
    for k, v in obj.items():
      out.update(_flat(v, f'{prefix}.{k}'))
    return out or {prefix: {}}
  return {prefix: obj}


def identity_difference(cached: Mapping[str, Any], expected: Mapping[str, Any]) -> Optional[str]:
  """None if `cached` agrees with `expected` on every field `expected` has; else which differs."""
  for field in expected:
    if field == 'fingerprint':
      continue  # reported through `files`, which names the file
    want, got = expected[field], cached.get(field)
    if _canonical(want) == _canonical(got):
      continue
    if isinstance(want, dict) and isinstance(got, dict):
      fw, fg = _flat(want, field), _flat(got, field)
      diffs = [
          k for k in sorted(set(fw) | set(fg)) if _canonical(fw.get(k)) != _canonical(fg.get(k))
      ]
      shown = ', '.join(
          f'{k}: cache {fg.get(k, "<absent>")!r} vs {fw.get(k, "<absent>")!r}' for k in diffs[:3]
      )
      return f'{shown}{" ..." if len(diffs) > 3 else ""}'
    return f'{field}: cache {got!r} vs {want!r}'
  return None


def encode_command(argv: Sequence[str], out: str) -> str:
  """The encode_prompts command for a run started with argv: its --config and --config.* flags
  (both '--flag=value' and '--flag value' forms) and --out."""
  kept, i = [], 0
  while i < len(argv):
    arg = argv[i]
    if re.match(r'--config(\.[\w.]+)?=', arg):
      kept.append(arg)
    elif re.fullmatch(r'--config(\.[\w.]+)?', arg) and i + 1 < len(argv):
      kept.append(f'{arg}={argv[i + 1]}')
      i += 1
    i += 1
  return shlex.join(['python', '-m', 'digen_jax.encode_prompts', *kept, f'--out={out}'])


def _validate_index(folder: str, index: Any) -> None:
  """Structure and digest of a parsed index.json; ValueError naming the file."""
  path = os.path.join(folder, INDEX)
  bad = lambda why: ValueError(
      f'{path}: corrupt embedding cache index ({why}); delete the '
      'folder and re-run python -m digen_jax.encode_prompts'
  )
  if not isinstance(index, dict) or index.get('format') not in _READABLE_FORMATS:
    got = index.get('format') if isinstance(index, dict) else type(index).__name__
    raise bad(f'format {got!r}, expected one of {list(_READABLE_FORMATS)}')
  for field, kind in (
      ('dim', int),
      ('dtype', str),
      ('identity', dict),
      ('shards', dict),
      ('prompts', list),
      ('digest', str),
  ):
    if not isinstance(index.get(field), kind):
      raise bad(f'field {field!r} missing or not a {kind.__name__}')
  if index['dtype'] != DTYPE or index['dim'] < 1:
    raise bad(f"dtype {index['dtype']!r} / dim {index['dim']!r}")
  pooled_dim = index.get('pooled_dim')
  if (index['format'] == FORMAT and 'pooled_dim' not in index) or not (
      pooled_dim is None or (isinstance(pooled_dim, int) and pooled_dim >= 1)
  ):
    raise bad(f'pooled_dim {pooled_dim!r} (absent, or not null / a positive int)')
  identity = index['identity']
  encoders = identity.get('encoders') or {}
  padded = None
  if identity.get('padding') == 'max_length':
    padded = identity.get('max_sequence_length')
    if not (
        isinstance(padded, int)
        and padded >= 1
        and pooled_dim
        and isinstance(encoders, dict)
        and all(
            isinstance((encoders.get(k) or {}).get('max_length'), int)
            for k in ('text_encoder', 'text_encoder_2')
        )
    ):
      raise bad(f'a padded (FLUX) identity without its lengths or pooled_dim: {identity!r}')
  body = {k: v for k, v in index.items() if k != 'digest'}
  if hashlib.sha256(_canonical(body)).hexdigest() != index['digest']:
    raise bad('its digest does not match its content: it was edited or partly written')
  for name, info in index['shards'].items():
    if (
        not _SHARD_RE.fullmatch(name)
        or not isinstance(info, dict)
        or not all(
            isinstance(info.get(k), t) for k, t in (('bytes', int), ('sha256', str), ('count', int))
        )
    ):
      raise bad(f'shard entry {name!r}: {info!r}')
  seen = set()
  for entry in index['prompts']:
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get('text'), str)
        and isinstance(entry.get('shard'), str)
        and entry['shard'] in index['shards']
        and entry.get('key') == prompt_key(entry['text'])
        and isinstance(entry.get('length'), int)
        and entry['length'] >= 0
        and _valid_tokens(entry.get('tokens', {}), encoders)
        and entry['length'] == (padded or entry['length'])
    ):
      raise bad(f'prompt entry {entry!r}')
    if entry['text'] in seen:
      raise bad(f"prompt {entry['text']!r} listed twice")
    seen.add(entry['text'])


def _valid_tokens(tokens: Any, encoders: Mapping[str, Any]) -> bool:
  """A prompt's {component: token count}, each component one of the identity's encoders."""
  return isinstance(tokens, dict) and all(
      k in encoders and isinstance(n, int) and n >= 0 for k, n in tokens.items()
  )


def _read_index(folder: str, verify: bool) -> dict[str, Any]:
  """The validated index of a cache folder; verify: also hash every shard's bytes."""
  path = os.path.join(folder, INDEX)
  if not os.path.isfile(path):
    raise ValueError(
        f'no embedding cache at {folder} ({INDEX} not found); create it with '
        f'python -m digen_jax.encode_prompts --config=... --out={folder}'
    )
  index = _read_json(path, 'the embedding cache index')
  _validate_index(folder, index)
  for name, info in index['shards'].items():
    shard = os.path.join(folder, name)
    if not os.path.isfile(shard):
      raise ValueError(
          f'{shard} is missing (listed in {path}); the cache is incomplete: '
          're-run python -m digen_jax.encode_prompts into a new folder'
      )
    size = os.path.getsize(shard)
    if size != info['bytes'] or (verify and _sha256_file(shard) != info['sha256']):
      raise ValueError(
          f'{shard} is corrupt (its {"size" if size != info["bytes"] else "sha256"} '
          f'differs from {path}); re-run python -m digen_jax.encode_prompts into a '
          'new folder'
      )
  return index


class EmbeddingCache:
  """A cache folder read as a `TextEncoder`: encode(prompts) -> (emb [B, L, D], mask [B, L]); and
  as a `PooledTextEncoder` where it holds pooled vectors (FLUX): encode_pooled(prompts) -> [B, P].

  folder: written by encode_prompts. max_length: L, the padded length (each prompt's [len, D]
  embeddings fill the first len rows, mask 1 there; the rest are zeros with mask 0). A FLUX cache
  holds T5 sequences padded to max_sequence_length with every position attended, so L must be
  exactly that (and every mask is all ones).
  verify: hash every shard on open (False: sizes only, hashes on first read of each shard).
  cache_bytes: bound of the in-memory LRU of decoded per-prompt arrays.
  """

  def __init__(
      self, folder: str, max_length: int, *, verify: bool = True, cache_bytes: int = 1 << 30
  ):
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
      raise ValueError(f'max_length={max_length!r} must be a positive int')
    self.folder = os.fspath(folder)
    self.max_length = max_length
    index = _read_index(self.folder, verify)
    self.dim: int = index['dim']
    self.pooled_dim: Optional[int] = index.get('pooled_dim')  # None: no pooled vectors
    self.identity: dict[str, Any] = index['identity']
    padded = self.identity.get('padding') == 'max_length' and self.identity['max_sequence_length']
    if padded and max_length != padded:
      raise ValueError(
          f'embedding cache {self.folder} holds {self.identity.get("pipeline")} T5 embeddings '
          f'padded to {padded} positions, every one attended (FLUX passes no mask), but '
          f'config.text.max_length is {max_length}; set config.text.max_length={padded}, or '
          f'encode into a new folder with --config.text.max_length={max_length}'
      )
    self._shards = index['shards']
    self._verified = set(self._shards) if verify else set()
    self._entries = {e['text']: e for e in index['prompts']}
    self._handles: dict[str, Any] = {}
    self._lru: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
    self._lru_bytes, self._cache_bytes = 0, cache_bytes

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, prompt: str) -> bool:
    return prompt in self._entries

  @property
  def prompts(self) -> list[str]:
    return list(self._entries)

  def length(self, prompt: str) -> int:
    """The prompt's cached sequence length (KeyError if absent): its true token count, or
    max_sequence_length for a FLUX cache (see `tokens`)."""
    return self._entries[prompt]['length']

  def tokens(self, prompt: str) -> dict[str, int]:
    """{component: the prompt's token count before truncation} for the tokenizers that can cut
    it (FLUX: text_encoder = CLIP, text_encoder_2 = T5; {} for Qwen-Image). KeyError if absent."""
    return dict(self._entries[prompt].get('tokens', {}))

  def truncated(self, prompt: str) -> list[str]:
    """The components whose tokenizer cut the prompt, as diffusers does (CLIP beyond 77 tokens,
    T5 beyond max_sequence_length): their embeddings saw only its beginning. KeyError if absent."""
    encoders = self.identity.get('encoders', {})
    return [k for k, n in self.tokens(prompt).items() if n > encoders[k]['max_length']]

  def missing(self, prompts: Iterable[str]) -> list[str]:
    """The prompts (distinct, in order) that the cache lacks."""
    return [p for p in dict.fromkeys(prompts) if p not in self._entries]

  def check(
      self,
      prompts: Iterable[str],
      expected_identity: Optional[Mapping[str, Any]] = None,
      command: Optional[str] = None,
  ) -> None:
    """One ValueError, before anything compiles, if the cache cannot serve `prompts`.

    expected_identity: `encoder_fingerprint(pipeline folder)` of the run; every field it has must
    match. command: the exact encode_prompts command that adds missing prompts (see
    `encode_command`); a generic one is shown if None.
    """
    if expected_identity is not None:
      diff = identity_difference(self.identity, expected_identity)
      if diff:
        raise ValueError(
            f'embedding cache {self.folder} was made by a different text encoder than the '
            f'pipeline folder this run uses ({diff}); encode into a new folder with '
            f'python -m digen_jax.encode_prompts --config=... --out=NEW_FOLDER and set '
            'config.text.cache to it'
        )
    prompts = list(dict.fromkeys(prompts))
    missing = self.missing(prompts)
    if missing:
      cmd = command or (
          "python -m digen_jax.encode_prompts --config=<this run's config> "
          f'[its --config.* overrides] --out={self.folder}'
      )
      raise ValueError(
          f'embedding cache {self.folder} lacks {len(missing)} of the {len(prompts)} prompts this '
          f'run needs, e.g. {", ".join(repr(p) for p in missing[:3])}; add them with\n  {cmd}'
      )
    too_long = [p for p in prompts if self._entries[p]['length'] > self.max_length]
    if too_long:
      raise self._too_long(too_long[0], len(too_long))

  def _too_long(self, prompt: str, count: int = 1) -> ValueError:
    n = self._entries[prompt]['length']
    longest = max(e['length'] for e in self._entries.values())
    return ValueError(
        f'prompt {prompt!r} has {n} text tokens but config.text.max_length is '
        f'{self.max_length}{f" ({count} prompts are longer)" if count > 1 else ""}; raise '
        f'config.text.max_length (the longest cached prompt has {longest}) or shorten the prompt'
    )

  def _handle(self, shard: str):
    if shard not in self._handles:
      path = os.path.join(self.folder, shard)
      if shard not in self._verified:
        if _sha256_file(path) != self._shards[shard]['sha256']:
          raise ValueError(
              f'{path} is corrupt (its sha256 differs from '
              f'{os.path.join(self.folder, INDEX)}); re-run python -m '
              'digen_jax.encode_prompts into a new folder'
          )
        self._verified.add(shard)
      try:
        self._handles[shard] = safe_open(path, framework='np')
      except Exception as e:  # safetensors raises its own error types for a bad header
        raise ValueError(f'{path}: unreadable safetensors shard ({e})') from e
    return self._handles[shard]

  def _read(self, prompt: str, pooled: bool) -> np.ndarray:
    """A cached prompt's [length, dim] embeddings or [pooled_dim] pooled vector (float32,
    read-only; LRU-cached by tensor name)."""
    entry = self._entries.get(prompt)
    if entry is None:
      raise ValueError(
          f'prompt {prompt!r} is not in embedding cache {self.folder}; add it with '
          f'python -m digen_jax.encode_prompts --config=... --out={self.folder}'
      )
    name = entry['key'] + ('.pooled' if pooled else '')
    if name in self._lru:
      self._lru.move_to_end(name)
      return self._lru[name]
    path = os.path.join(self.folder, entry['shard'])
    try:
      arr = self._handle(entry['shard']).get_tensor(name)
    except ValueError:
      raise
    except Exception as e:
      raise ValueError(f'{path}: cannot read prompt {prompt!r} (key {name}): {e}') from e
    shape = (self.pooled_dim,) if pooled else (entry['length'], self.dim)
    if arr.dtype != np.float32 or arr.shape != shape:
      raise ValueError(
          f'{path}: prompt {prompt!r} has {arr.dtype} {arr.shape} at {name}, '
          f'expected float32 {shape}'
      )
    arr.setflags(write=False)
    self._lru[name] = arr
    self._lru_bytes += arr.nbytes
    while self._lru_bytes > self._cache_bytes and len(self._lru) > 1:
      _, old = self._lru.popitem(last=False)
      self._lru_bytes -= old.nbytes
    return arr

  def embedding(self, prompt: str) -> np.ndarray:
    """[length, dim] float32 embeddings of a cached prompt (read-only; LRU-cached)."""
    return self._read(prompt, pooled=False)

  def pooled(self, prompt: str) -> np.ndarray:
    """[pooled_dim] float32 pooled vector of a cached prompt (read-only; LRU-cached)."""
    if self.pooled_dim is None:
      raise self._no_pooled()
    return self._read(prompt, pooled=True)

  def _no_pooled(self) -> ValueError:
    return ValueError(
        f'embedding cache {self.folder} has no pooled vectors: its text encoder '
        f'({self.identity.get("class")}) conditions by its sequence alone'
    )

  def encode(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, str):
      raise ValueError('prompts must be a list of str, not a single str')
    emb = np.zeros((len(prompts), self.max_length, self.dim), np.float32)
    mask = np.zeros((len(prompts), self.max_length), np.int32)
    for i, p in enumerate(prompts):
      if p in self._entries and self._entries[p]['length'] > self.max_length:
        raise self._too_long(p)
      e = self.embedding(p)
      emb[i, : len(e)] = e
      mask[i, : len(e)] = 1
    return emb, mask

  def encode_pooled(self, prompts: list[str]) -> np.ndarray:
    """prompts -> [B, pooled_dim] float32 pooled vectors (FLUX's CLIP pooler_output)."""
    if isinstance(prompts, str):
      raise ValueError('prompts must be a list of str, not a single str')
    if self.pooled_dim is None:
      raise self._no_pooled()
    out = np.empty((len(prompts), self.pooled_dim), np.float32)
    for i, p in enumerate(prompts):
      out[i] = self.pooled(p)
    return out

  def close(self) -> None:
    self._handles.clear()
    self._lru.clear()
    self._lru_bytes = 0


class Entry(NamedTuple):
  """One prompt's encoding, as `CacheWriter.add` takes it (a plain (text, embeddings) tuple is one).

  embeddings: [length, dim]. pooled: [pooled_dim], in a cache with pooled vectors only.
  tokens: {component: token count before truncation} for tokenizers that can cut the prompt.
  """

  text: str
  embeddings: np.ndarray
  pooled: Optional[np.ndarray] = None
  tokens: Optional[Mapping[str, int]] = None


class CacheWriter:
  """Appends prompts' embeddings to a cache folder (created if absent), one shard per `add`.

  identity: the encoder's (`encoder_fingerprint(...)` plus compute_dtype); an existing cache made
  by a different one is a ValueError. dim: the sequence width; pooled_dim: the pooled vectors'
  (None: the cache has none). Holds an exclusive lock on the folder until `close`.
  """

  def __init__(
      self, folder: str, identity: Mapping[str, Any], dim: int, pooled_dim: Optional[int] = None
  ):
    self.folder = os.fspath(folder)
    os.makedirs(self.folder, exist_ok=True)
    self._lock = open(os.path.join(self.folder, '.lock'), 'a+')
    try:
      fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._lock.close()
      raise ValueError(f'{self.folder} is being written by another process') from None
    try:
      self._open(identity, dim, pooled_dim)
    except BaseException:
      self.close()
      raise

  def _open(self, identity, dim, pooled_dim):
    for name in os.listdir(self.folder):
      if name.startswith('.tmp-'):  # left by an interrupted writer; never listed in an index
        os.remove(os.path.join(self.folder, name))
    if os.path.exists(os.path.join(self.folder, INDEX)):
      index = _read_index(self.folder, verify=True)
      diff = identity_difference(index['identity'], identity) or identity_difference(
          identity, index['identity']
      )
      if not diff and index['dim'] != dim:
        diff = f"dim: cache {index['dim']} vs {dim}"
      if not diff and index.get('pooled_dim') != pooled_dim:
        diff = f"pooled_dim: cache {index.get('pooled_dim')} vs {pooled_dim}"
      if diff:
        raise ValueError(
            f'embedding cache {self.folder} was made by a different text encoder '
            f'({diff}); write to a new --out folder'
        )
    else:
      if os.listdir(self.folder) != ['.lock']:
        raise ValueError(
            f'{self.folder} is not empty and has no {INDEX}: not an embedding cache; '
            'choose an empty or new --out folder'
        )
      index = {
          'format': FORMAT,
          'dim': dim,
          'pooled_dim': pooled_dim,
          'dtype': DTYPE,
          'identity': dict(identity),
          'shards': {},
          'prompts': [],
      }
    index.pop('digest', None)
    index.update(format=FORMAT, pooled_dim=index.get('pooled_dim'))  # format 1 -> 2 on append
    self._index = index
    self._texts = {e['text'] for e in index['prompts']}

  def missing(self, prompts: Iterable[str]) -> list[str]:
    """The prompts (distinct, in order) not yet in the cache."""
    return [p for p in dict.fromkeys(prompts) if p not in self._texts]

  def __len__(self) -> int:
    return len(self._texts)

  def add(self, items: Sequence[Entry | tuple]) -> Optional[str]:
    """Writes one shard with the new items' tensors (each an `Entry`, or (text, [length, dim]
    array) for a cache without pooled vectors); replaces index.json. Prompts already cached are
    skipped. Returns the shard's name (None if nothing was new)."""
    dim, pooled_dim = self._index['dim'], self._index['pooled_dim']
    identity = self._index['identity']
    padded = identity.get('padding') == 'max_length' and identity['max_sequence_length']
    tensors, entries = {}, []
    for item in items:
      text, arr, pooled, tokens = Entry(*item)
      if not isinstance(text, str):
        raise ValueError(f'prompt must be a str; got {type(text).__name__}')
      arr = np.ascontiguousarray(arr, dtype=np.float32)
      if arr.ndim != 2 or arr.shape[1] != dim or arr.shape[0] != (padded or arr.shape[0]):
        raise ValueError(
            f'embeddings of prompt {text!r} have shape {arr.shape}; expected '
            f'[{padded or "len"}, {dim}]'
        )
      if (pooled is None) != (pooled_dim is None):
        raise ValueError(
            f'prompt {text!r}: a pooled vector is required exactly when the cache has '
            f'pooled_dim (it has {pooled_dim})'
        )
      if pooled is not None:
        pooled = np.ascontiguousarray(pooled, dtype=np.float32)
        if pooled.shape != (pooled_dim,):
          raise ValueError(
              f'pooled vector of prompt {text!r} has shape {pooled.shape}; expected '
              f'[{pooled_dim}]'
          )
      tokens = {k: int(n) for k, n in (tokens or {}).items()}
      if not _valid_tokens(tokens, identity.get('encoders') or {}):
        raise ValueError(
            f"token counts of prompt {text!r} ({tokens}) must name the identity's " 'encoders'
        )
      key = prompt_key(text)
      if text in self._texts or key in tensors:
        continue
      tensors[key] = arr
      entry = {'text': text, 'key': key, 'length': int(arr.shape[0])}
      if pooled is not None:
        tensors[f'{key}.pooled'] = pooled
      if tokens:
        entry['tokens'] = tokens
      entries.append(entry)
    if not entries:
      return None
    name = f'shard-{len(self._index["shards"]):05d}.safetensors'
    path = os.path.join(self.folder, name)
    tmp = os.path.join(self.folder, f'.tmp-{os.getpid()}-{name}')
    save_file(tensors, tmp, metadata={'format': FORMAT})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600; readers may be other users
    _fsync(tmp)
    os.replace(tmp, path)  # a stale shard of that name was never in the index
    self._index['shards'][name] = {
        'bytes': os.path.getsize(path),
        'sha256': _sha256_file(path),
        'count': len(entries),
    }
    for e in entries:
      e['shard'] = name
    self._index['prompts'].extend(entries)
    self._texts.update(e['text'] for e in entries)
    self._write_index()
    return name

  def _write_index(self) -> None:
    index = dict(self._index)
    index['digest'] = hashlib.sha256(_canonical(index)).hexdigest()
    tmp = os.path.join(self.folder, f'.tmp-{os.getpid()}-{INDEX}')
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(index, f, indent=1, ensure_ascii=False)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(self.folder, INDEX))
    _fsync_dir(self.folder)

  def close(self) -> None:
    if not self._lock.closed:
      fcntl.flock(self._lock, fcntl.LOCK_UN)
      self._lock.close()

  def __enter__(self) -> 'CacheWriter':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _fsync(path: str) -> None:
  with open(path, 'rb') as f:
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
