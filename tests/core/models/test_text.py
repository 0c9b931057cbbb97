"""Frozen word-level text encoder and the per-prompt cache."""

import numpy as np
import pytest

from digen_jax.tasks.shapes import grammar as G
from digen_jax.models.text.encoders import (
    BOS,
    UNK,
    CachedEncoder,
    TextEncoder,
    WordEncoder,
    sinusoidal_positions,
    tokenize,
)


@pytest.fixture(scope="module")
def enc():
  return WordEncoder(G.grammar_words(), dim=32, max_length=16, seed=0)


def test_tokenize():
  assert tokenize("A Red-circle, LEFT of: a blue square!") == [
      "a",
      "red",
      "circle",
      "left",
      "of",
      "a",
      "blue",
      "square",
  ]
  assert tokenize("  ") == []


def test_encode_contract(enc):
  assert isinstance(enc, TextEncoder)
  prompts = ["a red circle on a white background", "two blue squares on a black background", ""]
  emb, mask = enc.encode(prompts)
  assert emb.shape == (3, 16, 32) and emb.dtype == np.float32
  assert mask.shape == (3, 16) and mask.dtype == np.int32
  np.testing.assert_array_equal(mask.sum(1), [1 + 7, 1 + 7, 1])  # <bos> + words
  assert np.all(emb[mask == 0] == 0)  # padding is exactly zero
  assert np.all(np.linalg.norm(emb[mask == 1], axis=-1) > 0.1)


def test_deterministic_and_seeded():
  a = WordEncoder(G.grammar_words(), 16, 12, seed=3).encode(["a red circle on a white background"])[
      0
  ]
  b = WordEncoder(G.grammar_words(), 16, 12, seed=3).encode(["a red circle on a white background"])[
      0
  ]
  c = WordEncoder(G.grammar_words(), 16, 12, seed=4).encode(["a red circle on a white background"])[
      0
  ]
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_word_order_is_visible(enc):
  p1 = "a red circle left of a blue square on a white background"
  p2 = "a blue square left of a red circle on a white background"
  e, m = enc.encode([p1, p2])
  assert not np.allclose(e[0], e[1])
  # Same bag of words: removing the position code leaves the same multiset of token vectors.
  tok = e - enc.positions[None] * m[..., None]
  np.testing.assert_allclose(tok[0].sum(0), tok[1].sum(0), rtol=1e-5, atol=1e-5)


def test_position_code():
  pe = sinusoidal_positions(8, 6)
  assert pe.shape == (8, 6)
  np.testing.assert_allclose(pe[3, 0], np.sin(3.0), rtol=1e-6)
  np.testing.assert_allclose(pe[3, 1], np.cos(3.0), rtol=1e-6)
  assert sinusoidal_positions(4, 5).shape == (4, 5)


def test_unknown_words_share_unk(enc):
  e, m = enc.encode(["a zebra", "a giraffe", "a red"])
  assert enc.token_ids("a zebra") == [enc.ids[BOS], enc.ids["a"], enc.ids[UNK]]
  np.testing.assert_array_equal(e[0], e[1])
  assert not np.allclose(e[0], e[2])


def test_too_long_prompt_names_prompt_and_limit():
  small = WordEncoder(G.grammar_words(), 8, max_length=5)
  small.encode(["a red circle on"])  # 4 words + <bos> = 5 fits
  with pytest.raises(ValueError, match=r"'a red circle on a'.*max_length is 5"):
    small.encode(["a red circle on a"])


def test_shapes_vocab_covers_grammar(enc):
  vocab = set(G.grammar_words())
  longest = 0
  for p in G.iter_all_prompts():
    words = tokenize(p.to_text())
    assert set(words) <= vocab
    longest = max(longest, len(words))
  assert longest + 1 <= 16  # the default max_length used above fits every prompt
  ids = enc.token_ids("a yellow triangle left of a purple triangle on a white background")
  assert enc.ids[UNK] not in ids


def test_vocab_validation():
  with pytest.raises(ValueError, match="duplicate"):
    WordEncoder(["red", "red"], 8, 4)
  with pytest.raises(ValueError, match="one lowercase word"):
    WordEncoder(["red circle"], 8, 4)
  with pytest.raises(ValueError, match="one lowercase word"):
    WordEncoder(["Red"], 8, 4)
  with pytest.raises(ValueError, match="max_length"):
    WordEncoder(["red"], 8, 1)


class CountingEncoder:

  def __init__(self, inner):
    self.inner, self.max_length, self.dim = inner, inner.max_length, inner.dim
    self.seen: list[str] = []

  def encode(self, prompts):
    self.seen.extend(prompts)
    return self.inner.encode(prompts)


def test_cached_encoder_encodes_each_prompt_once(enc):
  counter = CountingEncoder(enc)
  cached = CachedEncoder(counter)
  assert isinstance(cached, TextEncoder) and cached.dim == 32 and cached.max_length == 16
  batches = [
      ["a red circle on a white background"] * 4 + ["two blue squares on a black background"],
      ["two blue squares on a black background", "a zebra", "a red circle on a white background"],
      ["a zebra", ""],
  ]
  for batch in batches:
    e, m = cached.encode(batch)
    e_ref, m_ref = enc.encode(batch)
    np.testing.assert_array_equal(e, e_ref)
    np.testing.assert_array_equal(m, m_ref)
  assert sorted(counter.seen) == sorted({p for b in batches for p in b})
  assert len(cached) == 4
  # Mutating a returned batch must not corrupt the cache.
  e, _ = cached.encode(["a zebra"])
  e[:] = 123.0
  np.testing.assert_array_equal(cached.encode(["a zebra"])[0], enc.encode(["a zebra"])[0])


def test_cached_encoder_lru_bound(enc):
  counter = CountingEncoder(enc)
  cached = CachedEncoder(counter, max_entries=2)
  cached.encode(["a", "b"])
  cached.encode(["a"])  # refresh a
  cached.encode(["c"])  # evicts b
  assert len(cached) == 2
  cached.encode(["a", "b"])  # b re-encoded, a cached
  assert counter.seen == ["a", "b", "c", "b"]
