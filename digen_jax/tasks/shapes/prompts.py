"""ShapesBench as a tfds prompt set ('shapes_bench', alias 'shapes'): the train / eval / val / rl
splits of grammar.py as an array_record dataset built on first use (data/prompts.py's plumbing).

Features: prompt, kind ('single' | 'relation'), color_a, shape_a, count_a, color_b, shape_b,
relation ('' where absent), background. The dataset records a sha256 of each split's prompts
in its metadata, so a dataset built from another grammar is detected instead of silently reused.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import numpy as np
import tensorflow_datasets as tfds

from digen_jax.data import prompts as prompt_data
from digen_jax.tasks.shapes.grammar import ShapesPrompt, split_prompts

SHAPES_BENCH = "shapes_bench"


def shapes_record(p: ShapesPrompt) -> dict[str, Any]:
  """The ShapesBench feature dict of one prompt."""
  a = p.objects[0]
  b = p.objects[1] if p.is_relation else None
  return {
      "prompt": p.to_text(),
      "kind": "relation" if p.is_relation else "single",
      "color_a": a.color,
      "shape_a": a.shape,
      "count_a": np.int32(a.count),
      "color_b": b.color if b else "",
      "shape_b": b.shape if b else "",
      "relation": p.relation or "",
      "background": p.background,
  }


class ShapesBench(tfds.core.GeneratorBasedBuilder):
  """ShapesBench prompts: compositional train/eval/val/rl split (digen_jax.tasks.shapes.grammar)."""

  VERSION = tfds.core.Version("1.2.0")
  RELEASE_NOTES = {
      "1.0.0": "Initial release.",
      "1.1.0": "A 'val' split of held-out relation prompts, disjoint from 'eval'.",
      "1.2.0": "An 'rl' split: train plus the held-out relation prompts outside eval and val.",
  }
  code_path = tfds.core.utils.classproperty(classmethod(prompt_data.module_code_path))

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self,
        # Keep generation order on disk (grammar / file line order); PromptIterator shuffles.
        disable_shuffling=True,
        description="ShapesBench: coloured shapes with counts and spatial relations "
        "(offline GenEval stand-in).",
        features=tfds.features.FeaturesDict(
            {
                "prompt": text,
                "kind": text,
                "color_a": text,
                "shape_a": text,
                "count_a": np.int32,
                "color_b": text,
                "shape_b": text,
                "relation": text,
                "background": text,
            }
        ),
        metadata=tfds.core.MetadataDict(grammar_digests(split_prompts)),
    )

  def _split_generators(self, dl_manager):
    return {k: self._generate_examples(v) for k, v in split_prompts().items()}

  def _generate_examples(self, prompts: Sequence[ShapesPrompt]):
    for p in prompts:
      yield p.to_text(), shapes_record(p)


def prepare_shapes_bench(data_dir: str) -> str:
  """Builds ShapesBench under data_dir if absent (and checks a present one is current).

  Returns the dataset directory. ValueError if the stored prompts differ from the current
  grammar (bump ShapesBench.VERSION after changing the grammar).
  """
  data_dir = os.fspath(data_dir)
  path = os.path.join(data_dir, SHAPES_BENCH, str(ShapesBench.VERSION))  # the builder's data_path
  if not prompt_data.is_prepared(path):
    with prompt_data.exclusive(data_dir):
      if not prompt_data.is_prepared(path):  # else another process built it while this one waited
        prompt_data.prepare_builder(
            ShapesBench(data_dir=data_dir, file_format=prompt_data.FILE_FORMAT)
        )
  expected = grammar_digests(split_prompts)
  stamps = tuple(os.stat(os.path.join(path, f)).st_mtime_ns for f in _CHECKED_FILES)
  checked = (path, stamps, str(expected))
  if checked in _CURRENT_SHAPES_BENCH:
    return path
  stored = tfds.builder_from_directory(path).info.metadata or {}
  for key, val in expected.items():
    if stored.get(key) != val:
      raise ValueError(
          f"ShapesBench at {path} was built from a different grammar "
          f"({key} differs); bump ShapesBench.VERSION or delete that directory"
      )
  _CURRENT_SHAPES_BENCH.add(checked)
  return path


@functools.lru_cache(maxsize=4)
def grammar_digests(prompts_of_splits) -> dict[str, str]:
  """{'sha256_<split>': digest} of the prompts `prompts_of_splits()` (grammar.split_prompts) makes:
  the metadata a current ShapesBench holds. Cached per function: the grammar is code."""
  return {
      f"sha256_{k}": prompt_data.sha256_texts([p.to_text() for p in v])
      for k, v in prompts_of_splits().items()
  }


# (dataset directory, the mtimes of its _CHECKED_FILES, the grammar's digests) found current in
# this process: a run loads its prompts several times (train and eval splits, the evaluator).
_CURRENT_SHAPES_BENCH: set[tuple[str, tuple[int, ...], str]] = set()
_CHECKED_FILES = ("dataset_info.json", "metadata.json")


prompt_data.register_prompt_set(SHAPES_BENCH, prepare_shapes_bench, aliases=("shapes",))
