"""ShapesBench prompt grammar: structured prompts, text round trip, enumeration and splits.

ShapesBench is an offline stand-in for GenEval. A prompt is one of two forms:

  single   : "<a|two|three> <colour> <shape|shapes> on a <background> background"
             e.g. "two red circles on a white background"
  relation : "a <colour> <shape> <relation> a <colour> <shape> on a <background> background"
             e.g. "a red circle left of a blue square on a black background"

Rules (enforced by `ShapesPrompt.__post_init__`, so `parse` rejects anything outside them):
  * object colours come from `COLORS` (chosen far apart in RGB), backgrounds from
    `BACKGROUNDS`; the two sets are disjoint, so a background never equals an object colour;
  * counts are 1..3 for single-object prompts and exactly 1 per object in relation prompts;
  * the two objects of a relation prompt have different colours (colour identifies each
    object, which keeps the checker unambiguous).

Train/eval split (compositional hold-out): `HELD_OUT_PAIRS` holds one (colour, shape) pair
per colour, arranged as a Latin pattern so that each shape is held out for two colours and
training still sees every colour (with two shapes) and every shape (with four colours).
  * train = every prompt that contains no held-out pair;
  * eval  = every single-object prompt of a held-out pair (6 pairs x 3 counts x 3 backgrounds
    = 54) plus a fixed-seed sample of `NUM_EVAL_RELATIONS` relation prompts that contain at
    least one held-out pair (so the eval split is ~100 prompts, half counting/attribute and
    half spatial);
  * val   = a second fixed-seed sample of `NUM_VAL_RELATIONS` held-out relation prompts, disjoint
    from eval's: settings (pretraining caption noise, RL hyper-parameters) are chosen on val, and
    eval is kept for the reported figure. (Every held-out single-object prompt is in eval, so val
    holds relations only.)
  * rl    = the prompts RL post-training draws: train plus every held-out relation prompt that is
    in neither eval nor val. Pretraining uses train alone, so the base has never seen e.g.
    "red circle" in any caption; RL then meets the held-out pairs inside relation prompts (as
    GenEval-style RL prompt sets share their objects and colours with the benchmark), while
    every eval prompt, and every held-out single-object or counting prompt, stays unseen.
A model trained on the train split has therefore never seen e.g. "red circle" in any prompt.

`miscaption` makes a training caption wrong in one attribute (a count, the relation, or which
object has which shape): pretraining on a share of such pairs gives a base that can draw every
concept but binds them to the prompt unreliably, the regime RL post-training works in.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Optional, Sequence

import numpy as np

# Object colours as RGB in [0, 1]: every object colour is >= 0.55 (Euclidean) from every other
# object colour and every background, so nearest-colour segmentation has a wide margin.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.10, 0.20, 0.90),
    "yellow": (0.95, 0.90, 0.10),
    "purple": (0.70, 0.10, 0.85),
    "cyan": (0.10, 0.80, 0.85),
}
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURALS: dict[str, str] = {s: s + "s" for s in SHAPES}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
MAX_COUNT = 3

# One held-out shape per colour (Latin pattern over the colour order); see module docstring.
HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    (c, SHAPES[i % len(SHAPES)]) for i, c in enumerate(COLORS)
)
NUM_EVAL_RELATIONS = 46
NUM_VAL_RELATIONS = 100
EVAL_SAMPLE_SEED = 0
MISCAPTION_KINDS: tuple[str, ...] = ("count", "relation", "binding")

_COLOR_NAMES = tuple(COLORS)
_BG_NAMES = tuple(BACKGROUNDS)


@dataclasses.dataclass(frozen=True)
class ShapeObject:
  """One object phrase: `count` copies of a `color` `shape`."""

  color: str
  shape: str
  count: int = 1

  def __post_init__(self):
    if self.color not in COLORS:
      raise ValueError(f"color={self.color!r} is not an object colour; use one of {_COLOR_NAMES}")
    if self.shape not in SHAPES:
      raise ValueError(f"shape={self.shape!r} is not a shape; use one of {SHAPES}")
    if not isinstance(self.count, (int, np.integer)) or not 1 <= self.count <= MAX_COUNT:
      raise ValueError(f"count={self.count!r} must be an int in 1..{MAX_COUNT}")

  def phrase(self) -> str:
    noun = self.shape if self.count == 1 else PLURALS[self.shape]
    return f"{COUNT_WORDS[int(self.count)]} {self.color} {noun}"


@dataclasses.dataclass(frozen=True)
class ShapesPrompt:
  """A structured ShapesBench prompt.

  objects: one object (any count) or two objects (count 1 each, different colours).
  relation: None for one object, else one of RELATIONS ("objects[0] <relation> objects[1]").
  background: one of BACKGROUNDS.
  """

  objects: tuple[ShapeObject, ...]
  relation: Optional[str]
  background: str

  def __post_init__(self):
    objs = tuple(self.objects)
    object.__setattr__(self, "objects", objs)
    if self.background not in BACKGROUNDS:
      raise ValueError(f"background={self.background!r} must be one of {_BG_NAMES}")
    if len(objs) == 1:
      if self.relation is not None:
        raise ValueError(f"relation={self.relation!r} needs two objects; got one")
    elif len(objs) == 2:
      if self.relation not in RELATIONS:
        raise ValueError(f"relation={self.relation!r} must be one of {RELATIONS}")
      if any(o.count != 1 for o in objs):
        raise ValueError(
            "relation prompts need count 1 for both objects; got " f"{[o.count for o in objs]}"
        )
      if objs[0].color == objs[1].color:
        raise ValueError(f"relation objects must differ in colour; both are {objs[0].color!r}")
    else:
      raise ValueError(f"objects must hold 1 or 2 ShapeObject; got {len(objs)}")

  @property
  def is_relation(self) -> bool:
    return self.relation is not None

  def pairs(self) -> frozenset[tuple[str, str]]:
    """The (colour, shape) pairs this prompt mentions."""
    return frozenset((o.color, o.shape) for o in self.objects)

  def to_text(self) -> str:
    tail = f"on a {self.background} background"
    if self.relation is None:
      return f"{self.objects[0].phrase()} {tail}"
    a, b = self.objects
    return f"{a.phrase()} {self.relation} {b.phrase()} {tail}"

  @staticmethod
  def parse(text: str) -> "ShapesPrompt":
    """Inverse of `to_text` (case and outer whitespace are ignored); ValueError if not in the grammar."""
    return parse(text)


def _alt(words: Sequence[str]) -> str:
  return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_COLOR_RE = _alt(_COLOR_NAMES)
_SHAPE_RE = _alt(SHAPES)
_TAIL_RE = rf" on a (?P<bg>{_alt(_BG_NAMES)}) background"
_SINGLE_RE = re.compile(
    rf"(?P<n>{_alt(COUNT_WORDS.values())}) (?P<c>{_COLOR_RE}) (?P<s>{_SHAPE_RE})(?P<pl>s?){_TAIL_RE}"
)
_REL_RE = re.compile(
    rf"a (?P<c1>{_COLOR_RE}) (?P<s1>{_SHAPE_RE}) (?P<rel>{_alt(RELATIONS)}) "
    rf"a (?P<c2>{_COLOR_RE}) (?P<s2>{_SHAPE_RE}){_TAIL_RE}"
)
_WORD_TO_COUNT = {w: n for n, w in COUNT_WORDS.items()}


def parse(text: str) -> ShapesPrompt:
  """Parses a ShapesBench prompt; raises ValueError naming the text if it is not in the grammar."""
  if not isinstance(text, str):
    raise ValueError(f"prompt must be a str; got {type(text).__name__}")
  norm = text.strip().lower()
  m = _REL_RE.fullmatch(norm)
  if m:
    return ShapesPrompt(
        objects=(ShapeObject(m["c1"], m["s1"]), ShapeObject(m["c2"], m["s2"])),
        relation=m["rel"],
        background=m["bg"],
    )
  m = _SINGLE_RE.fullmatch(norm)
  if m:
    count = _WORD_TO_COUNT[m["n"]]
    if (count == 1) == bool(m["pl"]):
      raise ValueError(f"prompt {text!r}: count word {m['n']!r} disagrees with noun number")
    return ShapesPrompt(
        objects=(ShapeObject(m["c"], m["s"], count),), relation=None, background=m["bg"]
    )
  raise ValueError(
      f"prompt {text!r} is not a ShapesBench prompt (e.g. "
      f"'two red circles on a white background' or "
      f"'a red circle left of a blue square on a black background')"
  )


def grammar_words() -> list[str]:
  """Every word `to_text` can emit, sorted."""
  words = {
      "a",
      "on",
      "background",
      *COUNT_WORDS.values(),
      *COLORS,
      *BACKGROUNDS,
      *SHAPES,
      *PLURALS.values(),
  }
  for rel in RELATIONS:
    words.update(rel.split())
  return sorted(words)


def iter_all_prompts() -> Iterator[ShapesPrompt]:
  """Every prompt of the grammar in a fixed canonical order (singles first, then relations)."""
  for bg in BACKGROUNDS:
    for c in COLORS:
      for s in SHAPES:
        for n in range(1, MAX_COUNT + 1):
          yield ShapesPrompt((ShapeObject(c, s, n),), None, bg)
  for bg in BACKGROUNDS:
    for c1 in COLORS:
      for s1 in SHAPES:
        for rel in RELATIONS:
          for c2 in COLORS:
            if c2 == c1:
              continue
            for s2 in SHAPES:
              yield ShapesPrompt((ShapeObject(c1, s1), ShapeObject(c2, s2)), rel, bg)


def all_prompts() -> list[ShapesPrompt]:
  return list(iter_all_prompts())


def is_held_out(prompt: ShapesPrompt) -> bool:
  """True iff the prompt mentions a held-out (colour, shape) pair."""
  return bool(prompt.pairs() & HELD_OUT_PAIRS)


def split_prompts(
    num_eval_relations: int = NUM_EVAL_RELATIONS,
    seed: int = EVAL_SAMPLE_SEED,
    num_val_relations: int = NUM_VAL_RELATIONS,
) -> dict[str, list[ShapesPrompt]]:
  """The train/eval/val split described in the module docstring (deterministic)."""
  train, eval_single, eval_rel = [], [], []
  for p in iter_all_prompts():
    if not is_held_out(p):
      train.append(p)
    elif p.is_relation:
      eval_rel.append(p)
    else:
      eval_single.append(p)
  if not 0 <= num_eval_relations <= len(eval_rel):
    raise ValueError(f"num_eval_relations={num_eval_relations} must be in 0..{len(eval_rel)}")
  idx = np.sort(
      np.random.default_rng(seed).choice(len(eval_rel), num_eval_relations, replace=False)
  )
  rest = np.setdiff1d(np.arange(len(eval_rel)), idx)
  if not 0 <= num_val_relations <= len(rest):
    raise ValueError(f"num_val_relations={num_val_relations} must be in 0..{len(rest)}")
  val_idx = np.sort(np.random.default_rng(seed + 1).choice(rest, num_val_relations, replace=False))
  rl_relations = np.setdiff1d(rest, val_idx)
  return {
      "train": train,
      "eval": eval_single + [eval_rel[i] for i in idx],
      "val": [eval_rel[i] for i in val_idx],
      "rl": train + [eval_rel[i] for i in rl_relations],
  }


def miscaption(prompt: ShapesPrompt, kind: str, rng: np.random.Generator) -> Optional[ShapesPrompt]:
  """`prompt` made wrong in one attribute, or None where `kind` does not apply to it.

  kind 'count': a count of 2 or 3 becomes the other (one object is never miscounted, so
    single-object captions stay exact); 'relation': the relation becomes another one;
    'binding': the two objects swap shapes (relation prompts whose shapes differ).
  """
  if kind not in MISCAPTION_KINDS:
    raise ValueError(f"kind={kind!r} must be one of {MISCAPTION_KINDS}")
  objs = prompt.objects
  if kind == "count":
    if prompt.is_relation or objs[0].count < 2:
      return None
    other = [n for n in range(2, MAX_COUNT + 1) if n != objs[0].count]
    obj = dataclasses.replace(objs[0], count=int(other[rng.integers(len(other))]))
    return dataclasses.replace(prompt, objects=(obj,))
  if not prompt.is_relation:
    return None
  if kind == "relation":
    other = [r for r in RELATIONS if r != prompt.relation]
    return dataclasses.replace(prompt, relation=other[rng.integers(len(other))])
  a, b = objs
  if a.shape == b.shape:
    return None
  return dataclasses.replace(
      prompt, objects=(dataclasses.replace(a, shape=b.shape), dataclasses.replace(b, shape=a.shape))
  )


def sample_prompts(n: int, seed: int, split: str = "train") -> list[ShapesPrompt]:
  """n prompts drawn uniformly (with replacement) from `split`, deterministic in `seed`."""
  splits = split_prompts()
  if split not in splits:
    raise ValueError(f"split={split!r} must be one of {sorted(splits)}")
  pool = splits[split]
  idx = np.random.default_rng(seed).integers(0, len(pool), size=n)
  return [pool[i] for i in idx]
