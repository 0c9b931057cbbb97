"""The text-rendering task as a tfds prompt set ('text_render'): prompts such as
`a sign that says "OPEN 24 HOURS"`, scored by the OCR reward (rewards/ocr.py: the quoted text
against what PP-OCRv4 reads), the task Flow-GRPO and veRL-Omni report OCR gains on.

Each prompt is a scene template around one text. The texts are split three ways, disjoint:
'train' (most texts, every template), 'val' and 'eval' (held-out texts, every template), so an
eval measures rendering texts the policy never trained on. Built on first use under the run's
data_dir (data/prompts.py's plumbing); features: prompt, text, scene.
"""

from __future__ import annotations

import os
from typing import Sequence

import tensorflow_datasets as tfds

from digen_jax.data import prompts as prompt_data

TEXT_RENDER = 'text_render'

# Scenes with one quoted text each ({} is replaced by the text).
SCENES = (
    'a sign that says "{}"',
    'a storefront with a neon sign reading "{}"',
    'a chalkboard with the words "{}" written on it',
    'a coffee mug printed with "{}"',
    'a poster with the title "{}" in bold letters',
    'a street banner that reads "{}"',
    'a wooden plank carved with the word "{}"',
    'a book cover titled "{}"',
    'a t-shirt with "{}" printed across the chest',
    'a road sign showing "{}"',
)

# Short texts of signs and labels: letters, digits and spaces (what PP-OCRv4's English set
# reads), 2-18 characters.
TEXTS = (
    'OPEN 24 HOURS',
    'NO PARKING',
    'EXIT',
    'FRESH BREAD',
    'HELLO WORLD',
    'SALE 50 OFF',
    'WELCOME',
    'STOP',
    'CAFE',
    'LIBRARY',
    'PIZZA',
    'HOTEL',
    'BOOKS',
    'GARDEN',
    'MUSEUM',
    'SUMMER SALE',
    'GOOD MORNING',
    'THANK YOU',
    'DANGER',
    'KEEP OUT',
    'ONE WAY',
    'BAKERY',
    'FLOWERS',
    'MARKET',
    'CINEMA',
    'ROOM 101',
    'GATE 7',
    'PLATFORM 9',
    'DINER',
    'TAXI',
    'POLICE',
    'PHARMACY',
    'BUS STOP',
    'HAPPY BIRTHDAY',
    'LOVE',
    'DREAM BIG',
    'NEW YORK',
    'PARIS',
    'TOKYO',
    'LONDON',
    'ROME',
    'BERLIN',
    'SEOUL',
    'CAIRO',
    'MOSCOW',
    'SYDNEY',
    'ICE CREAM',
    'TEA HOUSE',
    'JAZZ CLUB',
    'BEACH',
    'FARM',
    'ZOO',
    'PARK',
    'SCHOOL',
    'BANK',
    'POST OFFICE',
    'GYM',
    'SPA',
    'BAR',
    'FIRE EXIT',
    'PUSH',
    'PULL',
    'CLOSED',
    'QUIET PLEASE',
    'WET PAINT',
    'FREE WIFI',
    'LIVE MUSIC',
    'GAME OVER',
    'YES',
    'NO',
)

# Held-out texts (every 7th text from the 3rd for eval, from the 6th for val): disjoint from
# train and from each other.
EVAL_TEXTS = TEXTS[2::7]
VAL_TEXTS = TEXTS[5::7]


def split_texts() -> dict[str, tuple[str, ...]]:
  held = set(EVAL_TEXTS) | set(VAL_TEXTS)
  return {
      'train': tuple(t for t in TEXTS if t not in held),
      'val': VAL_TEXTS,
      'eval': EVAL_TEXTS,
  }


def split_prompts() -> dict[str, list[dict]]:
  """{split: [{'prompt', 'text', 'scene'}]}: every scene around every text of the split."""
  return {
      split: [
          {'prompt': scene.format(text), 'text': text, 'scene': scene}
          for text in texts
          for scene in SCENES
      ]
      for split, texts in split_texts().items()
  }


def digests() -> dict[str, str]:
  return {
      f'sha256_{k}': prompt_data.sha256_texts([r['prompt'] for r in v])
      for k, v in split_prompts().items()
  }


class TextRender(tfds.core.GeneratorBasedBuilder):
  """Text-rendering prompts: a quoted text in a scene, texts held out for val and eval."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  code_path = tfds.core.utils.classproperty(classmethod(prompt_data.module_code_path))

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self,
        disable_shuffling=True,  # generation order on disk; PromptIterator shuffles
        description='Text rendering: a quoted text in a scene, scored by OCR.',
        features=tfds.features.FeaturesDict({'prompt': text, 'text': text, 'scene': text}),
        metadata=tfds.core.MetadataDict(digests()),
    )

  def _split_generators(self, dl_manager):
    return {k: self._generate_examples(v) for k, v in split_prompts().items()}

  def _generate_examples(self, records: Sequence[dict]):
    for r in records:
      yield r['prompt'], r


def prepare_text_render(data_dir: str) -> str:
  """Builds 'text_render' under data_dir if absent; a stored one from other texts is a
  ValueError (bump TextRender.VERSION after changing them). Returns its directory."""
  data_dir = os.fspath(data_dir)
  path = os.path.join(data_dir, TEXT_RENDER, str(TextRender.VERSION))
  if not prompt_data.is_prepared(path):
    with prompt_data.exclusive(data_dir):
      if not prompt_data.is_prepared(path):
        prompt_data.prepare_builder(
            TextRender(data_dir=data_dir, file_format=prompt_data.FILE_FORMAT)
        )
  stored = tfds.builder_from_directory(path).info.metadata or {}
  for key, val in digests().items():
    if stored.get(key) != val:
      raise ValueError(
          f'text_render at {path} was built from other texts ({key} differs); bump '
          'TextRender.VERSION or delete that directory'
      )
  return path


prompt_data.register_prompt_set(TEXT_RENDER, prepare_text_render, aliases=('text',))
