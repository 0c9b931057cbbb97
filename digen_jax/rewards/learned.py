"""Learned rewards: models that score in reward worker processes (rewards/workers.py), never in
the training process (which never imports torch or onnxruntime).

Each is a loader `load(folder, device) -> fn(uint8 images [B, H, W, 3], prompts) -> [B] float`,
named by 'module:function' so that the training process knows the names without importing the
model code:

  ocr          1 - normalised edit distance between the prompt's quoted text and the text
               PP-OCRv4 reads (rapidocr-onnxruntime; its wheel ships the ONNX weights; a folder
               may hold other det/rec .onnx files) -- Flow-GRPO's OCR reward (rewards/ocr.py)
  clip_score   CLIP image-text cosine similarity x 100 (rewards/preference.py), from a
               transformers CLIPModel folder
  pickscore    PickScore: CLIP-H logit_scale x cosine similarity, from a CLIPModel folder
  aesthetic    the LAION aesthetic predictor: an MLP on the normalised CLIP image embedding,
               from a folder with a CLIPModel and the head's aesthetic_head.safetensors

`folder` comes from config.reward.models ('name=FOLDER'); nothing is downloaded. A user's own
worker reward: config.reward.callables names it and config.reward.in_workers puts it in the
workers.
"""

from __future__ import annotations

import importlib

LOADERS = {
    "ocr": "digen_jax.rewards.ocr:load",
    "clip_score": "digen_jax.rewards.preference:load_clip_score",
    "pickscore": "digen_jax.rewards.preference:load_pickscore",
    "aesthetic": "digen_jax.rewards.preference:load_aesthetic",
    "hpsv2": "digen_jax.rewards.hps:load",
    "image_reward": "digen_jax.rewards.image_reward:load",
}
# Learned rewards that need a weights folder (config.reward.models); 'ocr' has its wheel's.
NEEDS_FOLDER = frozenset({"clip_score", "pickscore", "aesthetic", "hpsv2", "image_reward"})


def is_learned(name: str) -> bool:
  return name in LOADERS


def load(name: str, folder: str, device: str):
  """The scoring function of learned reward `name` (imports its model code: workers only)."""
  module, _, fn = LOADERS[name].partition(":")
  return getattr(importlib.import_module(module), fn)(folder, device)
