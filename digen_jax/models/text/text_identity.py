"""Which text encoder made an embedding cache: the identity of a diffusers pipeline folder's prompt
encoding, computed without torch (`encoder_fingerprint`), and the comparison of two identities
(`identity_difference`). A cache records the identity of the encoder that wrote it
(text_cache_writer) and a run checks it against its own pipeline folder (text_cache).

Per pipeline (model_index.json's _class_name), as diffusers' encode_prompt computes them:
  QwenImagePipeline   Qwen2.5-VL last hidden state at the prompt's own (unpadded) length.
  FluxPipeline        T5 (text_encoder_2) last hidden state padded to max_sequence_length, and
                      CLIP (text_encoder) pooler_output as the pooled vector.
  WanPipeline         umT5 last hidden state at the prompt's own length (after prompt_clean); the
                      pipeline pads it with zero embeddings to max_sequence_length, all attended.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Optional

from digen_jax.models.text.text_cache_format import canonical_json, read_json, sha256_file

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

# diffusers' WanPipeline (0.42.1): UMT5EncoderModel's last hidden state of the cleaned prompt
# (prompt_clean: ftfy when installed, HTML unescaping, whitespace), tokenized with padding to
# max_sequence_length (512 in __call__) and the attention mask; the rows past the prompt's tokens
# are then replaced by zeros, and the transformer attends every row.
WAN_MAX_SEQUENCE_LENGTH = 512
_WAN_PIPELINES = ('WanPipeline',)
_WAN_CLASS = 'transformers.UMT5EncoderModel'

_FINGERPRINT_CHUNK = 4 << 20  # bytes read from each end of a weights file


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
  model_index = read_json(index_path, 'the pipeline description')
  pipeline = model_index.get('_class_name')
  known = _QWENIMAGE_PIPELINES + _FLUX_PIPELINES + _WAN_PIPELINES
  if pipeline not in known:
    raise ValueError(
        f'{index_path}: _class_name {pipeline!r} is not a supported pipeline; known: {list(known)}'
    )
  return model_index, index_path, pipeline


def pipeline_class(pipeline_folder: str) -> str:
  """model_index.json's _class_name, one this module can encode for (else ValueError)."""
  return _model_index(pipeline_folder)[2]


def is_flux(pipeline: str) -> bool:
  """Whether a pipeline class encodes prompts as FluxPipeline does (T5 sequence + CLIP pooled)."""
  return pipeline in _FLUX_PIPELINES


def is_wan(pipeline: str) -> bool:
  """Whether a pipeline class encodes prompts as WanPipeline does (umT5, zero-padded)."""
  return pipeline in _WAN_PIPELINES


def _component_class(model_index: Mapping[str, Any], index_path: str, part: str) -> str:
  entry = model_index.get(part)
  if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
    raise ValueError(f'{index_path}: {part!r} must be [library, class]; got {entry!r}')
  return '.'.join(entry)


def _component_files(folder: str, encoder: str, tokenizer: str) -> dict[str, str]:
  """{path in the folder: digest} of a text encoder's config.json and weights and of every file
  of its tokenizer."""
  files = {f'{encoder}/config.json': sha256_file(os.path.join(folder, encoder, 'config.json'))}
  tok_dir = os.path.join(folder, tokenizer)
  if not os.path.isdir(tok_dir) or not os.listdir(tok_dir):
    raise ValueError(f'{tok_dir} is missing or empty (the pipeline folder needs its {tokenizer})')
  for name in sorted(os.listdir(tok_dir)):
    if os.path.isfile(os.path.join(tok_dir, name)):
      files[f'{tokenizer}/{name}'] = sha256_file(os.path.join(tok_dir, name))
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

  max_sequence_length: FLUX and Wan, the length every prompt is padded (or truncated) to, as
  their pipelines' argument (None: the default 512 of both; a run passes config.text.max_length).
  Qwen-Image's limit is fixed by its pipeline and this is not used.

  Qwen-Image: {class, tokenizer_class, config (text_encoder/config.json), dim, template,
  drop_idx, max_sequence_length, hidden_state_layer, files, fingerprint}.
  FLUX: {pipeline, encoders {text_encoder (CLIP), text_encoder_2 (T5): {class, tokenizer_class,
  config, dim, max_length (the tokenizer's padded length), output}}, dim (T5's), pooled_dim
  (CLIP's), max_sequence_length, padding: 'max_length', files, fingerprint}.
  Wan: {pipeline, encoders {text_encoder (umT5): as FLUX's}, dim, max_sequence_length, padding:
  'zeros', files, fingerprint}.
  `files` covers each text encoder's config.json, every file of its tokenizer folder, and each of
  its weights files by size + first and last 4 MiB; `fingerprint` is the sha256 over `files`.
  """
  folder = os.fspath(pipeline_folder)
  model_index, index_path, pipeline = _model_index(folder)
  if is_flux(pipeline):
    return _flux_fingerprint(folder, model_index, index_path, pipeline, max_sequence_length)
  if is_wan(pipeline):
    return _wan_fingerprint(folder, model_index, index_path, pipeline, max_sequence_length)
  classes = {
      part: _component_class(model_index, index_path, part)
      for part in ('text_encoder', 'tokenizer')
  }
  config = read_json(os.path.join(folder, 'text_encoder', 'config.json'), 'the text encoder')
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
      'fingerprint': hashlib.sha256(canonical_json(files)).hexdigest(),
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
    config = read_json(os.path.join(folder, part, 'config.json'), f'the {part}')
    files.update(_component_files(folder, part, tok))
    if part == 'text_encoder':
      # FluxPipeline pads CLIP prompts to the tokenizer's own model_max_length.
      limit = read_json(os.path.join(folder, tok, 'tokenizer_config.json'), f'the {tok}').get(
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
      'fingerprint': hashlib.sha256(canonical_json(files)).hexdigest(),
  }


def _wan_fingerprint(
    folder: str,
    model_index: Mapping[str, Any],
    index_path: str,
    pipeline: str,
    max_sequence_length: Optional[int],
) -> dict[str, Any]:
  if max_sequence_length is None:
    max_sequence_length = WAN_MAX_SEQUENCE_LENGTH
  if (
      isinstance(max_sequence_length, bool)
      or not isinstance(max_sequence_length, int)
      or max_sequence_length < 1
  ):
    raise ValueError(
        f'max_sequence_length={max_sequence_length!r}: {pipeline} pads umT5 prompts to a '
        f'positive number of tokens ({WAN_MAX_SEQUENCE_LENGTH} in diffusers); a run sets it '
        'with config.text.max_length'
    )
  cls = _component_class(model_index, index_path, 'text_encoder')
  if cls != _WAN_CLASS:
    raise ValueError(
        f'{index_path}: text_encoder is {cls}; {pipeline} encodes prompts with {_WAN_CLASS}'
    )
  config = read_json(os.path.join(folder, 'text_encoder', 'config.json'), 'the text_encoder')
  files = _component_files(folder, 'text_encoder', 'tokenizer')
  encoder = {
      'class': cls,
      'tokenizer_class': _component_class(model_index, index_path, 'tokenizer'),
      'config': config,
      'dim': text_hidden_size(config, 'd_model', 'text_encoder/config.json'),
      'max_length': max_sequence_length,
      'output': 'last_hidden_state',
  }
  return {
      'pipeline': pipeline,
      'encoders': {'text_encoder': encoder},
      'dim': encoder['dim'],
      'max_sequence_length': max_sequence_length,
      # Stored at each prompt's length; the pipeline pads with zero rows to max_sequence_length
      # and attends all of them, so a reader must pad to exactly that length.
      'padding': 'zeros',
      'files': files,
      'fingerprint': hashlib.sha256(canonical_json(files)).hexdigest(),
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
    if canonical_json(want) == canonical_json(got):
      continue
    if isinstance(want, dict) and isinstance(got, dict):
      fw, fg = _flat(want, field), _flat(got, field)
      diffs = [
          k
          for k in sorted(set(fw) | set(fg))
          if canonical_json(fw.get(k)) != canonical_json(fg.get(k))
      ]
      shown = ', '.join(
          f'{k}: cache {fg.get(k, "<absent>")!r} vs {fw.get(k, "<absent>")!r}' for k in diffs[:3]
      )
      return f'{shown}{" ..." if len(diffs) > 3 else ""}'
    return f'{field}: cache {got!r} vs {want!r}'
  return None
