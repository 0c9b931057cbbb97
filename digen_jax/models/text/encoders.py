"""Text encoders: the `TextEncoder` interface, a frozen word-level encoder, and a per-prompt cache.

`TextEncoder.encode(prompts)` returns (embeddings [B, L, D] float32, mask [B, L] int32), with
L = max_length, mask 1 on real tokens and 0 on padding (padded embeddings are exactly 0).
`PooledTextEncoder` adds `encode_pooled(prompts)` -> [B, P] float32: one vector per prompt, for
pipelines that also condition on one (FLUX.1: CLIP's pooled output, added to the timestep
embedding). The embedding cache of models/text/text_cache.py is both; `pooled_dim` None says a cache
has no pooled vectors.

`WordEncoder` is the small frozen encoder for ShapesBench-scale experiments: lowercase, split on
whitespace and punctuation (punctuation is dropped), map words to ids (unknown -> <unk>), prepend
a <bos> token, and look the ids up in a seeded random table plus a sinusoidal position code so
word order is visible ("red circle left of blue square" != "blue square left of red circle").
The <bos> token makes every mask non-empty, so the empty prompt used for classifier-free
guidance encodes to a valid (attendable) sequence. Nothing is trained.

A word encoder's vocabulary comes from the task that owns its prompts: a task registers it by
name (`register_vocabulary('word', words)`, tasks/shapes does for ShapesBench) and config.text.encoder
names it ('word'); `vocabulary(name)` returns it, or raises naming the registered ones.

`CachedEncoder` memoises any encoder per prompt string: frozen encoders are deterministic, so a
prompt seen in an earlier step (prompt groups repeat a prompt G times; epochs repeat prompts)
is encoded once.
"""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

PAD, UNK, BOS = "<pad>", "<unk>", "<bos>"
_SPECIALS = (PAD, UNK, BOS)
_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)  # runs of letters/digits; the rest separates


@runtime_checkable
class TextEncoder(Protocol):
  max_length: int
  dim: int

  def encode(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """prompts -> (embeddings [B, max_length, dim] float32, mask [B, max_length] int32)."""
    ...


@runtime_checkable
class PooledTextEncoder(TextEncoder, Protocol):
  pooled_dim: Optional[int]  # None: this encoder has no pooled vectors (encode_pooled raises)

  def encode_pooled(self, prompts: list[str]) -> np.ndarray:
    """prompts -> pooled vectors [B, pooled_dim] float32."""
    ...


def tokenize(text: str) -> list[str]:
  """Lowercased words; whitespace and punctuation separate and are dropped."""
  return _WORD_RE.findall(text.lower())


def sinusoidal_positions(length: int, dim: int) -> np.ndarray:
  """[length, dim] float32 transformer position code (sin on even, cos on odd channels)."""
  pos = np.arange(length, dtype=np.float64)[:, None]
  i = np.arange((dim + 1) // 2, dtype=np.float64)[None, :]
  ang = pos / np.power(10000.0, 2.0 * i / dim)
  out = np.empty((length, 2 * ang.shape[1]), np.float64)
  out[:, 0::2], out[:, 1::2] = np.sin(ang), np.cos(ang)
  return out[:, :dim].astype(np.float32)


# Word vocabularies that tasks provide: name -> the words (a list, or a function giving it).
_VOCABULARIES: dict[str, Sequence[str] | Callable[[], Sequence[str]]] = {}


def register_vocabulary(name: str, words: Sequence[str] | Callable[[], Sequence[str]]) -> None:
  """Makes `vocabulary(name)` the words (called on first use when a function). Registering a
  name again replaces it (a module reload)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a vocabulary's name must be a non-empty str; got {name!r}")
  _VOCABULARIES[name] = words


def registered_vocabularies() -> list[str]:
  return sorted(_VOCABULARIES)


def vocabulary(name: str, field: str = "config.text.encoder") -> list[str]:
  """The words registered as `name`; ValueError naming `field` and the registered names."""
  if name not in _VOCABULARIES:
    raise ValueError(
        f"{field}={name!r} names no registered word vocabulary; registered: "
        f"{registered_vocabularies()} (a task registers its own when digen_jax.tasks is imported)"
    )
  words = _VOCABULARIES[name]
  return list(words() if callable(words) else words)


class WordEncoder:
  """Frozen word-level encoder (see module docstring).

  vocab: the known words (each must be a single token under `tokenize`, no duplicates).
  dim: embedding width D. max_length: L, including the leading <bos> token.
  seed: seeds the embedding table; same (vocab, dim, seed) -> same embeddings.
  """

  def __init__(self, vocab: Sequence[str], dim: int = 64, max_length: int = 16, seed: int = 0):
    if isinstance(vocab, str) or not vocab:
      raise ValueError("vocab must be a non-empty list of words")
    if not isinstance(dim, int) or dim < 1:
      raise ValueError(f"dim={dim!r} must be a positive int")
    if not isinstance(max_length, int) or max_length < 2:
      raise ValueError(f"max_length={max_length!r} must be an int >= 2 (<bos> + one word)")
    words = []
    for w in vocab:
      toks = tokenize(w) if isinstance(w, str) else []
      if len(toks) != 1 or toks[0] != w:
        raise ValueError(f"vocab entry {w!r} must be one lowercase word without punctuation")
      if w in _SPECIALS:
        raise ValueError(f"vocab entry {w!r} collides with a special token")
      words.append(w)
    dup = sorted({w for w in words if words.count(w) > 1})
    if dup:
      raise ValueError(f"vocab has duplicate words {dup}")
    self.vocab = list(_SPECIALS) + words
    self.ids = {w: i for i, w in enumerate(self.vocab)}
    self.dim, self.max_length, self.seed = dim, max_length, seed
    self.pooled_dim = dim
    rng = np.random.default_rng(seed)
    # Entries ~ N(0, 1/2): a token vector's norm is ~sqrt(dim/2), the same as a position-code
    # row's (dim/2 sin/cos pairs), so neither term drowns the other.
    table = rng.standard_normal((len(self.vocab), dim)) / np.sqrt(2.0)
    table[self.ids[PAD]] = 0.0
    self.table = table.astype(np.float32)
    self.table.setflags(write=False)
    self.positions = sinusoidal_positions(max_length, dim)
    self.positions.setflags(write=False)

  def token_ids(self, prompt: str) -> list[int]:
    """[<bos>, word ids...]; ValueError naming the prompt if it does not fit max_length."""
    if not isinstance(prompt, str):
      raise ValueError(f"prompt must be a str; got {type(prompt).__name__}: {prompt!r}")
    ids = [self.ids[BOS]] + [self.ids.get(w, self.ids[UNK]) for w in tokenize(prompt)]
    if len(ids) > self.max_length:
      raise ValueError(
          f"prompt {prompt!r} has {len(ids)} tokens (with <bos>) but max_length is "
          f"{self.max_length}; shorten the prompt or raise max_length"
      )
    return ids

  def encode(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, str):
      raise ValueError("prompts must be a list of str, not a single str")
    b, l = len(prompts), self.max_length
    ids = np.zeros((b, l), np.int64)
    mask = np.zeros((b, l), np.int32)
    for i, p in enumerate(prompts):
      t = self.token_ids(p)
      ids[i, : len(t)] = t
      mask[i, : len(t)] = 1
    emb = (self.table[ids] + self.positions[None]) * mask[..., None]
    return emb.astype(np.float32), mask

  def encode_pooled(self, prompts: list[str]) -> np.ndarray:
    """[B, dim] float32: the mean of each prompt's token vectors (the toy stand-in for a CLIP
    pooled vector, so FLUX-family toy configs run without a real encoder)."""
    emb, mask = self.encode(prompts)
    return (emb.sum(1) / np.maximum(mask.sum(1, keepdims=True), 1)).astype(np.float32)


class CachedEncoder:
  """Wraps a TextEncoder; each distinct prompt string is encoded by the inner encoder once
  (`encode_pooled` is passed through uncached: it is small).

  max_entries: optional LRU bound on the cache (None = unbounded).
  """

  def __init__(self, encoder: TextEncoder, max_entries: Optional[int] = None):
    if max_entries is not None and max_entries < 1:
      raise ValueError(f"max_entries={max_entries!r} must be >= 1 or None")
    self.encoder = encoder
    self.max_length, self.dim = encoder.max_length, encoder.dim
    self.pooled_dim = getattr(encoder, "pooled_dim", None)
    self.max_entries = max_entries
    self._cache: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray]] = (
        collections.OrderedDict()
    )

  def __len__(self) -> int:
    return len(self._cache)

  def encode_pooled(self, prompts: list[str]) -> np.ndarray:
    return self.encoder.encode_pooled(prompts)

  def encode(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, str):
      raise ValueError("prompts must be a list of str, not a single str")
    missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
    if missing:
      emb, mask = self.encoder.encode(missing)
      for i, p in enumerate(missing):
        # Copies: the entries must not alias a batch array the caller might mutate.
        self._cache[p] = (np.array(emb[i], np.float32), np.array(mask[i], np.int32))
    out_e = np.empty((len(prompts), self.max_length, self.dim), np.float32)
    out_m = np.empty((len(prompts), self.max_length), np.int32)
    for i, p in enumerate(prompts):
      e, m = self._cache[p]
      self._cache.move_to_end(p)
      out_e[i], out_m[i] = e, m
    if self.max_entries is not None:
      while len(self._cache) > self.max_entries:
        self._cache.popitem(last=False)
    return out_e, out_m


def table_digest(encoder) -> str:
  """sha256 of a word encoder's table + vocab (a CachedEncoder is looked through): a checkpoint
  records it so a later run can check it encodes prompts the same way."""
  inner = getattr(encoder, "encoder", encoder)
  h = hashlib.sha256(np.ascontiguousarray(inner.table).tobytes())
  h.update("\n".join(inner.vocab).encode())
  return h.hexdigest()
