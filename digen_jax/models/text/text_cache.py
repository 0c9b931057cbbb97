"""Text-embedding cache: a real text encoder's outputs, computed once per prompt, read by training.

The training process never runs (or imports) torch: `python -m digen_jax.encode_prompts` runs a
pipeline folder's text encoder(s) in its own process and writes a cache folder; `EmbeddingCache`
reads it through the `TextEncoder` interface of models/text/encoders.py (`PooledTextEncoder` where the
pipeline also conditions on a pooled vector). numpy + safetensors + json only, in four modules:
this one (the reader, and the names of the others that callers use), text_cache_format.py (the
index and its checks), text_identity.py (which encoder made a cache) and text_cache_writer.py.

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
  WanPipeline         umT5 last hidden state at the (cleaned) prompt's own length, no pooled
                      vector. The pipeline pads it with zero rows to max_sequence_length (512) and
                      the transformer attends all of them, so the reader pads with zeros to
                      exactly that length (config.text.max_length must equal it).

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
import os
import re
import shlex
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
from safetensors import safe_open

from digen_jax.models.text.text_cache_format import (
    FORMAT as FORMAT,  # re-exported, as the other names callers take from this module
    INDEX,
    prompt_key as prompt_key,
    read_index,
    sha256_file,
)
from digen_jax.models.text.text_cache_writer import CacheWriter as CacheWriter
from digen_jax.models.text.text_cache_writer import Entry as Entry
from digen_jax.models.text.text_identity import (
    FLUX_MAX_SEQUENCE_LENGTH as FLUX_MAX_SEQUENCE_LENGTH,
    WAN_MAX_SEQUENCE_LENGTH as WAN_MAX_SEQUENCE_LENGTH,
    QWENIMAGE_DROP_IDX as QWENIMAGE_DROP_IDX,
    QWENIMAGE_MAX_SEQUENCE_LENGTH as QWENIMAGE_MAX_SEQUENCE_LENGTH,
    QWENIMAGE_TEMPLATE as QWENIMAGE_TEMPLATE,
    encoder_fingerprint as encoder_fingerprint,
    identity_difference,
    is_flux as is_flux,
    is_wan as is_wan,
    pipeline_class as pipeline_class,
    text_hidden_size as text_hidden_size,
)


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


class EmbeddingCache:
  """A cache folder read as a `TextEncoder`: encode(prompts) -> (emb [B, L, D], mask [B, L]); and
  as a `PooledTextEncoder` where it holds pooled vectors (FLUX): encode_pooled(prompts) -> [B, P].

  folder: written by encode_prompts. max_length: L, the padded length (each prompt's [len, D]
  embeddings fill the first len rows, mask 1 there; the rest are zeros with mask 0). A FLUX cache
  holds T5 sequences padded to max_sequence_length with every position attended, so L must be
  exactly that (and every mask is all ones); a Wan cache's zero rows are attended too, so L must
  be its max_sequence_length as well.
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
    index = read_index(self.folder, verify)
    self.dim: int = index['dim']
    self.pooled_dim: Optional[int] = index.get('pooled_dim')  # None: no pooled vectors
    self.identity: dict[str, Any] = index['identity']
    padding = self.identity.get('padding')
    padded = padding in ('max_length', 'zeros') and self.identity['max_sequence_length']
    if padded and max_length != padded:
      what = (
          'T5 embeddings padded to'
          if padding == 'max_length'
          else 'umT5 embeddings that the pipeline zero-pads to'
      )
      raise ValueError(
          f'embedding cache {self.folder} holds {self.identity.get("pipeline")} {what} '
          f'{padded} positions, every one attended (the pipeline passes no mask), but '
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
        if sha256_file(path) != self._shards[shard]['sha256']:
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
