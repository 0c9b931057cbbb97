"""The OCR reward of text rendering, as Flow-GRPO defines it (flow_grpo/ocr.py), offline.

Flow-GRPO reads the image with PaddleOCR (PP-OCR detection + recognition, English, no angle
classifier) and scores

    target = the prompt's first quoted text ('a sign that says "OPEN 24 HOURS"' -> OPEN 24 HOURS)
    read   = the recognised lines joined (those with score > 0, after the engine's own
             text_score cut), spaces removed, lower-cased; target likewise
    dist   = 0 if target is a substring of read, else levenshtein(read, target), at most len(target)
    reward = 1 - dist / len(target)                               in [0, 1]

Here the engine is rapidocr-onnxruntime: PaddleOCR's PP-OCRv4 det/rec models as ONNX, shipped
inside its wheel (nothing is downloaded), run by onnxruntime in a reward worker process, with
PaddleOCR's detector sizing (the longer side capped at 960 px). One difference stays: the wheel's
recogniser is PP-OCRv4's Chinese-English one (ch_PP-OCRv4_rec), where PaddleOCR(lang='en') loads
the English one; the wheel's reads the task's capitals and digits (tests/tasks/text_render/test_ocr_reward.py:
139 of its 140 clean renders exactly). A prompt without a quoted text scores against the whole prompt (as GenRL's port does). Where
Flow-GRPO scores an image the engine raises on 0, the exception goes on here: the worker marks
that sample's reward failed and the run masks it out of its group (rewards/workers.py).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def target_text(prompt: str) -> str:
  """The text a prompt asks to render: its first "quoted" part, else the whole prompt."""
  parts = prompt.split('"')
  return parts[1] if len(parts) >= 3 else prompt


def normalise(text: str) -> str:
  return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
  """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
  if len(a) < len(b):
    a, b = b, a
  prev = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    cur = [i]
    for j, cb in enumerate(b, 1):
      cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
    prev = cur
  return prev[-1]


def ocr_score(recognised: str, prompt: str) -> float:
  """Flow-GRPO's reward of one image whose OCR read `recognised`, for `prompt`."""
  target = normalise(target_text(prompt))
  if not target:
    return 1.0
  read = normalise(recognised)
  dist = 0 if target in read else min(levenshtein(read, target), len(target))
  return 1.0 - dist / len(target)


class OcrReader:
  """PP-OCRv4 through rapidocr-onnxruntime. folder: '' for the wheel's models, or a folder with
  det.onnx and rec.onnx; device 'cpu' or 'cuda:N' (onnxruntime-gpu)."""

  def __init__(self, folder: str = "", device: str = "cpu"):
    from rapidocr_onnxruntime import RapidOCR  # pylint: disable=g-import-not-at-top

    kwargs = {
        "use_cls": False,
        "intra_op_num_threads": int(os.environ.get("OMP_NUM_THREADS", 1)),
        # PaddleOCR's detector defaults, as Flow-GRPO runs it: an image's longer side capped
        # at 960 px, never enlarged (rapidocr's own default enlarges the shorter side to 736:
        # a 512 px sample would cost 2x the detection, a 64 px toy one 130x).
        "det_limit_type": "max",
        "det_limit_side_len": 960,
    }
    if folder:
      for part in ("det", "rec"):
        path = os.path.join(folder, f"{part}.onnx")
        if not os.path.isfile(path):
          raise ValueError(f"OCR weights folder {folder!r} has no {part}.onnx")
        kwargs[f"{part}_model_path"] = path
    if device.startswith("cuda"):
      kwargs.update(det_use_cuda=True, rec_use_cuda=True)
    self.engine = RapidOCR(**kwargs)

  def read(self, image: np.ndarray) -> str:
    """The text read in one uint8 [H, W, 3] image ('' when none)."""
    result, _ = self.engine(np.ascontiguousarray(image), use_cls=False)
    return "".join(line[1] for line in (result or []) if float(line[2]) > 0)


def load(folder: str, device: str):
  """The 'ocr' reward: fn(uint8 images [B, H, W, 3], prompts) -> [B] float32."""
  reader = OcrReader(folder, device)

  def ocr(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    out = np.empty((len(prompts),), np.float32)
    for i, (image, prompt) in enumerate(zip(images, prompts)):
      out[i] = ocr_score(reader.read(image), prompt)
    return out

  return ocr
