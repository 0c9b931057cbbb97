"""The OCR reward (rewards/ocr.py) and the text-rendering task (tasks/text_render):
rapidocr-onnxruntime's PP-OCRv4 (a runtime requirement: it must import here, never skip) reads
text rendered with PIL in the fonts matplotlib ships (the same glyphs on every machine); the
score is Flow-GRPO's 1 - normalised edit distance; the prompt set's splits hold disjoint texts."""

import functools
import os
import time

import matplotlib
import numpy as np
import pytest
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFilter
from PIL import ImageFont

from digen_jax.data import prompts as prompt_data
from digen_jax.rewards import ocr
from digen_jax.tasks.text_render import prompts as text_render

FONTS = os.path.join(matplotlib.get_data_path(), 'fonts', 'ttf')


def _render(text: str, font: str = 'DejaVuSans.ttf', width: int = 256, height: int = 128):
  """Black `text` centred on white, the largest size up to 40 px that fits: uint8 [H, W, 3]."""
  image = Image.new('RGB', (width, height), 'white')
  draw = ImageDraw.Draw(image)
  size = 40
  face = ImageFont.truetype(os.path.join(FONTS, font), size)
  while draw.textlength(text, font=face) > width - 16:
    size -= 2
    face = ImageFont.truetype(os.path.join(FONTS, font), size)
  draw.text((width / 2, height / 2), text, fill='black', font=face, anchor='mm')
  return np.asarray(image)


@functools.lru_cache(maxsize=1)
def _reward():
  return ocr.load('', 'cpu')


def _score(images, texts):
  return _reward()(np.stack(images), [f'a sign that says "{t}"' for t in texts])


# ------------------------------------------------------------------------------------ score


def _reference_distance(a: str, b: str) -> int:
  """Edit distance by its recursive definition (memoised): the check of ocr.levenshtein."""

  @functools.lru_cache(maxsize=None)
  def d(i, j):
    if not i or not j:
      return i + j
    return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

  return d(len(a), len(b))


def test_edit_distance_matches_its_definition():
  assert ocr.levenshtein('kitten', 'sitting') == 3
  assert ocr.levenshtein('', 'abc') == 3 and ocr.levenshtein('abc', 'abc') == 0
  rng = np.random.default_rng(0)
  for _ in range(200):
    a, b = (''.join(rng.choice(list('ab0O '), rng.integers(0, 9))) for _ in range(2))
    assert ocr.levenshtein(a, b) == _reference_distance(a, b), (a, b)


@pytest.mark.parametrize(
    'read, prompt, want',
    [
        ('OPEN 24 HOURS', 'a sign that says "OPEN 24 HOURS"', 1.0),
        ('open24hours', 'a sign that says "OPEN 24 HOURS"', 1.0),  # spaces and case do not count
        ('WELCOME TO THE OPEN24HOURS SHOP', 'a sign "OPEN 24 HOURS"', 1.0),  # contained: 0
        ('OPEN 24 HOUR', 'a sign that says "OPEN 24 HOURS"', 1 - 1 / 11),  # 11 letters
        ('0PEN 24 H0URS', 'a sign that says "OPEN 24 HOURS"', 1 - 2 / 11),
        ('', 'a sign that says "STOP"', 0.0),  # nothing read
        ('SOMETHING MUCH LONGER', 'a sign that says "STOP"', 0.0),  # capped at len(target)
        ('Stop', 'a sign that says "STOP" and "GO"', 1.0),  # the first quoted text
        ('a red sign', 'a red sign', 1.0),  # no quotes: the whole prompt
    ],
)
def test_score_is_one_minus_flow_grpo_normalised_edit_distance(read, prompt, want):
  """Flow-GRPO (flow_grpo/ocr.py): target = the first quoted text; both sides without spaces,
  lower-cased; dist = 0 if the target is in what was read, else min(levenshtein, len(target));
  reward = 1 - dist / len(target)."""
  assert ocr.ocr_score(read, prompt) == pytest.approx(want, abs=1e-9)
  target = ocr.normalise(ocr.target_text(prompt))
  got = ocr.normalise(read)
  dist = 0 if target in got else min(_reference_distance(got, target), len(target))
  assert ocr.ocr_score(read, prompt) == pytest.approx(1 - dist / len(target), abs=1e-9)


# ---------------------------------------------------------------------------- PP-OCRv4 reads


def test_the_reward_reads_rendered_words_and_scores_blank_and_distorted_images_low():
  texts = ['OPEN 24 HOURS', 'FRESH BREAD', 'EXIT', 'HELLO WORLD', 'ROOM 101', 'PHARMACY']
  clean = [_render(t) for t in texts]
  assert list(_score(clean, texts)) == [1.0] * len(texts)
  rng = np.random.default_rng(0)
  blank = np.full((128, 256, 3), 255, np.uint8)
  noise = rng.integers(0, 256, (128, 256, 3), dtype=np.uint8)
  blurred = np.asarray(Image.fromarray(clean[0]).filter(ImageFilter.GaussianBlur(8)))
  tiny = np.asarray(Image.fromarray(clean[3]).resize((24, 12)).resize((256, 128)))
  low = _score([blank, noise, blurred, tiny], [texts[0], texts[1], texts[0], texts[3]])
  assert low[0] == 0.0 and low[1] == 0.0, low  # nothing to read: the full distance
  assert np.all(low <= 0.35), low
  # Another text than the prompt's scores by the edit distance of what was read.
  assert _score([_render('OPEN 24 HOUR')], ['OPEN 24 HOURS'])[0] == pytest.approx(1 - 1 / 11)


def test_extra_missing_and_repeated_text_score_as_flow_grpo_scores_them():
  """Rendered images against Flow-GRPO's rule (flow_grpo/ocr.py, kept by veRL-Omni's
  genrm_ocr): the asked text inside a longer one scores 1 (extra text is not penalised, the
  classic way RL games this reward: docs/rewards.md), a repeat scores 1, missing letters cost
  their edit distance."""
  images = [_render('BEST PIZZA IN TOWN'), _render('PIZZA PIZZA'), _render('PIZ'), _render('PIZZA')]
  got = _score(images, ['PIZZA'] * 4)
  reads = [_reward_reader().read(im) for im in images]
  want = [ocr.ocr_score(r, 'a sign that says "PIZZA"') for r in reads]
  assert list(got) == pytest.approx(want)
  assert ocr.normalise(reads[0]) == 'bestpizzaintown' and got[0] == 1.0  # extra text
  assert ocr.normalise(reads[1]) == 'pizzapizza' and got[1] == 1.0  # repeated
  assert ocr.normalise(reads[2]) == 'piz' and got[2] == pytest.approx(1 - 2 / 5)  # missing
  assert got[3] == 1.0


@functools.lru_cache(maxsize=1)
def _reward_reader():
  return ocr.OcrReader()


@pytest.mark.slow
def test_clean_rendered_words_are_read_exactly_at_least_95_percent():
  """Every text of the task (70) in two fonts: >= 95 % read exactly (score 1)."""
  fonts = ('DejaVuSans.ttf', 'DejaVuSerif-Bold.ttf')
  texts = list(text_render.TEXTS)
  renders = {f: [_render(t, f) for t in texts] for f in fonts}
  _reward()  # loaded before the clock starts
  t = time.perf_counter()
  scores = {f: _score(renders[f], texts) for f in fonts}
  per_image = (time.perf_counter() - t) / (len(texts) * len(fonts))
  exact = np.mean(np.concatenate([s == 1.0 for s in scores.values()]))
  misses = {f: [t for t, s in zip(texts, scores[f]) if s < 1] for f in fonts}
  print(
      f'OCR exact on clean renders: {exact:.1%} of {len(texts) * len(fonts)}; misses {misses}; '
      f'{per_image:.3f} s an image (256x128; onnxruntime threads: '
      f'{os.environ.get("OMP_NUM_THREADS", 1)})'
  )
  assert exact >= 0.95, misses
  assert min(np.min(s) for s in scores.values()) > 0.5  # a miss is a character or two


def test_an_ocr_weights_folder_without_its_models_is_one_line(tmp_path):
  with pytest.raises(ValueError, match=r"OCR weights folder '.*' has no det.onnx"):
    ocr.load(str(tmp_path), 'cpu')


# ------------------------------------------------------------------------------ the prompts


def test_text_render_splits_hold_disjoint_texts(tmp_path):
  data_dir = str(tmp_path / 'data')
  splits = {
      s: list(prompt_data.load_prompts('text_render', s, data_dir))
      for s in ('train', 'val', 'eval')
  }
  texts = {s: {ocr.target_text(p) for p in ps} for s, ps in splits.items()}
  assert texts['train'].isdisjoint(texts['val']) and texts['train'].isdisjoint(texts['eval'])
  assert texts['val'].isdisjoint(texts['eval'])
  assert texts['train'] | texts['val'] | texts['eval'] == set(text_render.TEXTS)
  n_scenes = len(text_render.SCENES)
  for s, ps in splits.items():
    assert len(ps) == len(texts[s]) * n_scenes and len(set(ps)) == len(ps), s
    assert all(p.count('"') == 2 for p in ps)  # one quoted text each
  assert len(texts['eval']) >= 8 and len(texts['val']) >= 8
  assert 'a sign that says "OPEN 24 HOURS"' in splits['train']
  # Built once: a second load reads the same records.
  assert list(prompt_data.load_prompts('text', 'eval', data_dir)) == splits['eval']
