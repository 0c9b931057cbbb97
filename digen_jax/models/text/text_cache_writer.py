"""Writing an embedding cache (the format: models/text/text_cache.py): `CacheWriter` appends prompts'
embeddings to a cache folder, one shard per `add`, under an exclusive lock.

Each append writes the shard to a temp file and renames it into place, then replaces index.json
the same way, so an interrupted run leaves the previous cache valid (and the prompts of every
completed shard kept). `python -m digen_jax.encode_prompts` is its user.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np
from safetensors.numpy import save_file

from digen_jax.models.text.text_cache_format import (
    DTYPE,
    FORMAT,
    INDEX,
    canonical_json,
    prompt_key,
    read_index,
    sha256_file,
    valid_tokens,
)
from digen_jax.models.text.text_identity import identity_difference


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
      index = read_index(self.folder, verify=True)
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
    limit = identity.get('padding') == 'zeros' and identity['max_sequence_length']
    tensors, entries = {}, []
    for item in items:
      text, arr, pooled, tokens = Entry(*item)
      if not isinstance(text, str):
        raise ValueError(f'prompt must be a str; got {type(text).__name__}')
      arr = np.ascontiguousarray(arr, dtype=np.float32)
      if (
          arr.ndim != 2
          or arr.shape[1] != dim
          or arr.shape[0] != (padded or arr.shape[0])
          or arr.shape[0] > (limit or arr.shape[0])
      ):
        length = padded or (f'len <= {limit}' if limit else 'len')
        raise ValueError(
            f'embeddings of prompt {text!r} have shape {arr.shape}; expected [{length}, {dim}]'
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
      if not valid_tokens(tokens, identity.get('encoders') or {}):
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
        'sha256': sha256_file(path),
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
    index['digest'] = hashlib.sha256(canonical_json(index)).hexdigest()
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
