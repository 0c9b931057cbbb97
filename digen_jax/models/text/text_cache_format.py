"""The embedding cache's on-disk format (models/text/text_cache.py describes it): its constants, the
per-prompt key, the canonical JSON its digests are taken over, and the checked reading of a cache
folder's index.json. Shared by the reader (text_cache.EmbeddingCache) and the writer
(text_cache_writer.CacheWriter); numpy-free, json + hashlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Mapping

FORMAT = 'digen_jax.embedding_cache/2'
_READABLE_FORMATS = ('digen_jax.embedding_cache/1', FORMAT)  # 1: a subset of 2 (text_cache.py)
INDEX = 'index.json'
DTYPE = 'float32'
_SHARD_RE = re.compile(r'shard-\d{5}\.safetensors')

_HASH_BLOCK = 16 << 20


def prompt_key(text: str) -> str:
  """The safetensors key of a prompt: sha256 of its UTF-8 bytes, hex."""
  return hashlib.sha256(text.encode('utf-8')).hexdigest()


def sha256_file(path: str) -> str:
  """sha256 of a file's bytes, hex (read in 16 MiB blocks)."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while block := f.read(_HASH_BLOCK):
      h.update(block)
  return h.hexdigest()


def read_json(path: str, what: str) -> Any:
  """A JSON file's content; ValueError naming the path and `what` it is when absent or invalid."""
  try:
    with open(path, 'rb') as f:
      return json.loads(f.read().decode('utf-8'))
  except FileNotFoundError:
    raise ValueError(f'{path} not found ({what})') from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f'{path} is not valid JSON ({what}): {e}') from e


def canonical_json(obj: Any) -> bytes:
  """The bytes the cache's digests are taken over: sorted keys, ASCII, no spaces."""
  return json.dumps(obj, sort_keys=True, ensure_ascii=True, separators=(',', ':')).encode()


def _sequence_lengths(identity: Mapping[str, Any], pooled_dim: Any, bad) -> tuple[Any, Any]:
  """(padded, limit) of a cache's identity: every prompt's stored length in a padded (FLUX)
  cache, the longest a prompt may have in a zero-padded (Wan) one; None where there is none.
  bad(why) makes the corrupt-index error."""
  encoders = identity.get('encoders') or {}
  padded = limit = None
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
  if identity.get('padding') == 'zeros':
    limit = identity.get('max_sequence_length')
    text_encoder = encoders.get('text_encoder') if isinstance(encoders, dict) else None
    if not (
        isinstance(limit, int)
        and limit >= 1
        and isinstance((text_encoder or {}).get('max_length'), int)
    ):
      raise bad(f'a zero-padded (Wan) identity without its lengths: {identity!r}')
  return padded, limit


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
  padded, limit = _sequence_lengths(identity, pooled_dim, bad)
  body = {k: v for k, v in index.items() if k != 'digest'}
  if hashlib.sha256(canonical_json(body)).hexdigest() != index['digest']:
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
        and valid_tokens(entry.get('tokens', {}), encoders)
        and entry['length'] == (padded or entry['length'])
        and entry['length'] <= (limit or entry['length'])
    ):
      raise bad(f'prompt entry {entry!r}')
    if entry['text'] in seen:
      raise bad(f"prompt {entry['text']!r} listed twice")
    seen.add(entry['text'])


def valid_tokens(tokens: Any, encoders: Mapping[str, Any]) -> bool:
  """A prompt's {component: token count}, each component one of the identity's encoders."""
  return isinstance(tokens, dict) and all(
      k in encoders and isinstance(n, int) and n >= 0 for k, n in tokens.items()
  )


def read_index(folder: str, verify: bool) -> dict[str, Any]:
  """The validated index of a cache folder; verify: also hash every shard's bytes."""
  path = os.path.join(folder, INDEX)
  if not os.path.isfile(path):
    raise ValueError(
        f'no embedding cache at {folder} ({INDEX} not found); create it with '
        f'python -m digen_jax.encode_prompts --config=... --out={folder}'
    )
  index = read_json(path, 'the embedding cache index')
  _validate_index(folder, index)
  for name, info in index['shards'].items():
    shard = os.path.join(folder, name)
    if not os.path.isfile(shard):
      raise ValueError(
          f'{shard} is missing (listed in {path}); the cache is incomplete: '
          're-run python -m digen_jax.encode_prompts into a new folder'
      )
    size = os.path.getsize(shard)
    if size != info['bytes'] or (verify and sha256_file(shard) != info['sha256']):
      raise ValueError(
          f'{shard} is corrupt (its {"size" if size != info["bytes"] else "sha256"} '
          f'differs from {path}); re-run python -m digen_jax.encode_prompts into a '
          'new folder'
      )
  return index
