"""Learned rewards: models that score in reward worker processes (rewards/workers.py), never in
the training process (which never imports torch or onnxruntime).

Each is a loader `load(folder, device) -> fn(uint8 images [B, H, W, 3], prompts) -> [B] float`,
named by 'module:function' so that the training process knows the names without importing the
model code:

  ocr          1 - normalised edit distance between the prompt's quoted text and the text
               PP-OCRv4 reads (rapidocr-onnxruntime; its wheel ships the ONNX weights; a folder
               may hold other det/rec .onnx files) -- Flow-GRPO's OCR reward (rewards/ocr.py)
  clip_score   max(100 x CLIP cosine similarity, 0) (torchmetrics' CLIPScore), from a
               transformers CLIPModel folder (rewards/preference.py)
  pickscore    PickScore: CLIP-H logit_scale.exp() x cosine similarity, from PickScore_v1's
               CLIPModel folder with CLIP-H's processor files (rewards/preference.py)
  aesthetic    the LAION aesthetic predictor v2: its MLP head (.pth) on the normalised CLIP
               ViT-L/14 image embedding, from a CLIPModel folder (rewards/preference.py)
  hpsv2        HPSv2.1: cosine similarity of an open_clip ViT-H-14 fine-tune, from the published
               HPS_v2.1_compressed.pt and CLIP's tokenizer (rewards/hps.py)
  image_reward ImageReward v1.0: BLIP ViT-L + BERT cross-encoder + MLP head, from ImageReward.pt,
               med_config.json and bert-base-uncased's vocab.txt (rewards/image_reward.py)

`folder` comes from config.reward.models ('name=FOLDER'); nothing is downloaded. A user's own
worker reward: config.reward.callables names it and config.reward.in_workers puts it in the
workers.
"""

from __future__ import annotations

import importlib

import numpy as np

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
  """The scoring function of learned reward `name` (imports its model code: workers only), of
  uint8 images [B, H, W, 3] or videos [B, F, H, W, 3] (per_frame)."""
  module, _, fn = LOADERS[name].partition(":")
  return per_frame(getattr(importlib.import_module(module), fn)(folder, device))


def per_frame(fn):
  """An image reward that scores videos too: every frame of each uint8 video [B, F, H, W, 3]
  with the video's prompt, the frames' scores averaged (the registry's rule for image rewards,
  rewards/registry.py); images [B, H, W, 3] as they are."""

  def scored(images, prompts):
    images = np.asarray(images)
    if images.ndim != 5:
      return fn(images, prompts)
    b, f = images.shape[:2]
    frames = images.reshape(b * f, *images.shape[2:])
    per = np.asarray(fn(frames, [p for p in prompts for _ in range(f)]), np.float32)
    if per.shape != (b * f,):  # the worker's shape check names the reward
      return per
    return per.reshape(b, f).mean(axis=1)

  return scored
