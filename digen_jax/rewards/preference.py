"""Preference-model rewards from a local weights folder, each scored as its reference code scores
it (run in reward worker processes: this module imports torch and transformers; the training
process never imports it). Nothing is downloaded: every loader reads only `folder`.

  clip_score    max(100 cos(image, prompt), 0), a transformers CLIPModel folder (e.g.
                openai/clip-vit-large-patch14). Formula: torchmetrics'
                functional/multimodal/clip_score.py ("CLIPScore(I, C) = max(100 * cos(E_I, E_C), 0)").
  pickscore     logit_scale.exp() * cos(image, prompt), a CLIPModel folder (yuvalkirstain/PickScore_v1)
                holding CLIP-H's processor files too (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
                preprocessor_config.json and tokenizer; in the folder or its processor/ subfolder).
                Formula and preprocessing: PickScore's README (github.com/yuvalkirstain/PickScore).
  aesthetic     LAION aesthetic predictor v2 (improved-aesthetic-predictor): an MLP on the L2-normalised
                CLIP ViT-L/14 image embedding; a CLIPModel folder (openai/clip-vit-large-patch14) and
                the head's .pth (sac+logos+ava1-l14-linearMSE.pth). Formula: its simple_inference.py;
                preprocessing: the transformers CLIP processor, as the RL scorers run it (DDPO's
                ddpo_pytorch/aesthetic_scorer.py, Flow-GRPO's): simple_inference.py's OpenAI
                transform crops a non-square image's odd excess one pixel later (torchvision
                rounds the offset, transformers floors it); square images are not cropped.

The learned rewards 'hpsv2' (rewards/hps.py) and 'image_reward' (rewards/image_reward.py) reuse
the pieces here (folder checks, checkpoint reading, CLIP's constants).

Each loader is `load_<name>(folder, device) -> fn(uint8 images [B, H, W, 3], prompts) -> [B]
float32`, the contract of rewards/learned.py. Scores are computed in float32.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

import numpy as np
from PIL import Image
import torch

# OpenAI CLIP's normalisation (CLIP's clip.py _transform; open_clip constants.OPENAI_DATASET_*;
# ImageReward.py _transform), used by every model here.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_MAX_LENGTH = 77  # CLIP's text context (PickScore's processor call: max_length=77)


class WeightsError(ValueError):
  """A weights folder lacks a file or holds something else (one line naming the fix)."""


# ------------------------------------------------------------------------------------------------
# Score formulas (torch, [B] from [B, E] features): each cites its reference.


def cosine(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
  """Row-wise cosine similarity of [B, E] features: [B]."""
  image_features = image_features / image_features.norm(dim=-1, keepdim=True)
  text_features = text_features / text_features.norm(dim=-1, keepdim=True)
  return (image_features * text_features).sum(dim=-1)


def clip_score_formula(cos: torch.Tensor) -> torch.Tensor:
  """torchmetrics functional clip_score: max(100 * cos, 0)."""
  return torch.clamp(100.0 * cos, min=0.0)


def pickscore_formula(cos: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
  """PickScore README: model.logit_scale.exp() * (text_embs @ image_embs.T) of normalised
  embeddings (its diagonal for one prompt per image)."""
  return logit_scale.exp() * cos


# ------------------------------------------------------------------------------------------------
# Shared pieces.


def torch_device(device: str) -> torch.device:
  """'cpu' or 'cuda[:N]' (config.reward.worker_devices) -> torch.device."""
  if device.startswith('cuda') and not torch.cuda.is_available():
    raise WeightsError(
        f"reward device {device!r} asks for CUDA, which this worker's torch lacks: set "
        "config.reward.worker_devices=cpu or install a CUDA torch in the workers' environment"
    )
  return torch.device(device or 'cpu')


def need_folder(name: str, folder: str) -> None:
  if not folder or not os.path.isdir(folder):
    raise WeightsError(
        f'{name} weights folder {folder!r} does not exist: give it as '
        f'--config.reward.models={name}=/path/to/folder (docs/rewards.md, "Preference models", '
        'lists what it holds)'
    )


def processor_folder(name: str, folder: str, files: Sequence[str], source: str) -> str:
  """The folder (folder itself or its processor/ subfolder) that holds every one of `files`."""
  for candidate in (folder, os.path.join(folder, 'processor')):
    if all(os.path.isfile(os.path.join(candidate, f)) for f in files):
      return candidate
  raise WeightsError(
      f'{name} weights folder {folder!r} (or its processor/ subfolder) lacks {list(files)}: copy '
      f'them from {source}'
  )


def tokenizer_folder(name: str, folder: str, source: str) -> str:
  for files in (['tokenizer.json'], ['vocab.json', 'merges.txt']):
    try:
      return processor_folder(name, folder, files, source)
    except WeightsError:
      pass
  raise WeightsError(
      f'{name} weights folder {folder!r} (or its processor/ subfolder) has no CLIP tokenizer '
      f'(tokenizer.json, or vocab.json and merges.txt): copy it from {source}'
  )


def pooled(out) -> torch.Tensor:
  """get_image_features / get_text_features: a tensor (transformers 4) or an output whose
  pooler_output is the projected embedding (transformers 5)."""
  return out if isinstance(out, torch.Tensor) else out.pooler_output


def rgb_batch(images: np.ndarray) -> np.ndarray:
  images = np.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
    raise ValueError(f'expected uint8 images [B, H, W, 3]; got {images.dtype} {images.shape}')
  return images


def load_state_dict(path: str) -> dict:
  """A checkpoint file's tensors ({'state_dict': ...} unwrapped), on the CPU, without running
  pickled code (torch.load weights_only)."""
  if path.endswith('.safetensors'):
    from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top

    return load_file(path)
  state = torch.load(path, map_location='cpu', weights_only=True)
  if isinstance(state, dict) and isinstance(state.get('state_dict'), dict):
    state = state['state_dict']
  if not isinstance(state, dict):
    raise WeightsError(f'{path} holds a {type(state).__name__}, not a state dict')
  return {k.removeprefix('module.'): v for k, v in state.items()}


def from_pretrained(name: str, cls, folder: str, **kwargs):
  """cls.from_pretrained(folder) in float32, refusing a folder whose weights do not all fit
  (transformers would initialise the missing or mis-shaped ones at random and go on)."""
  try:
    model, info = cls.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, **kwargs
    )
  except (OSError, RuntimeError) as e:  # no weights file; weights of another shape
    raise WeightsError(
        f'{name} weights folder {folder!r} does not load as {cls.__name__}: '
        f'{" ".join(str(e).split())[:200]}'
    ) from None
  bad = list(info.get('missing_keys') or []) + [
      str(m[0]) for m in info.get('mismatched_keys') or []
  ]
  if bad:
    raise WeightsError(
        f'{name} weights folder {folder!r} does not fit {cls.__name__}: '
        f'{len(bad)} weights missing or mis-shaped, e.g. {sorted(bad)[:3]}'
    )
  return model.eval()


def one_file(name: str, folder: str, patterns: Sequence[str], what: str) -> str:
  found = sorted({p for pattern in patterns for p in glob.glob(os.path.join(folder, pattern))})
  if len(found) != 1:
    raise WeightsError(
        f'{name} weights folder {folder!r} needs exactly one {what} ({", ".join(patterns)}); '
        f'found {[os.path.basename(p) for p in found]}'
    )
  return found[0]


class ClipPair:
  """A transformers CLIPModel with its tokenizer and CLIP's PIL image processor: the projected
  (unnormalised) image and text embeddings [B, E] of uint8 images and prompts."""

  def __init__(self, name: str, model, tokenizer, image_processor, device: torch.device):
    self.name, self.model, self.tokenizer = name, model.eval().to(device), tokenizer
    self.image_processor, self.device = image_processor, device

  @classmethod
  def load(cls, name: str, folder: str, device: str, processor_source: str) -> 'ClipPair':
    from transformers import CLIPImageProcessorPil  # pylint: disable=g-import-not-at-top
    from transformers import CLIPModel  # pylint: disable=g-import-not-at-top
    from transformers import CLIPTokenizer  # pylint: disable=g-import-not-at-top

    need_folder(name, folder)
    if not os.path.isfile(os.path.join(folder, 'config.json')):
      raise WeightsError(
          f'{name} weights folder {folder!r} has no config.json: it must be a transformers '
          f'CLIPModel folder (save_pretrained / a Hugging Face snapshot)'
      )
    # The PIL processor: the preprocessing these models were published with (transformers 4's
    # CLIPImageProcessor; transformers 5's default one resizes with torchvision when installed).
    image_processor = CLIPImageProcessorPil.from_pretrained(
        processor_folder(name, folder, ['preprocessor_config.json'], processor_source)
    )
    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_folder(name, folder, processor_source))
    model = from_pretrained(name, CLIPModel, folder)
    return cls(name, model, tokenizer, image_processor, torch_device(device))

  def pixels(self, images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> pixel_values [B, 3, S, S] as the processor makes them of PIL images."""
    pil = [Image.fromarray(x) for x in rgb_batch(images)]
    return self.image_processor(images=pil, return_tensors='pt')['pixel_values'].to(self.device)

  def tokens(self, prompts: Sequence[str]) -> dict:
    return self.tokenizer(
        list(prompts),
        padding=True,
        truncation=True,
        max_length=CLIP_MAX_LENGTH,
        return_tensors='pt',
    ).to(self.device)

  @torch.inference_mode()
  def features(self, images: np.ndarray, prompts: Sequence[str]):
    """(image [B, E], text [B, E]) projected embeddings, not normalised."""
    image = pooled(self.model.get_image_features(pixel_values=self.pixels(images)))
    text = pooled(self.model.get_text_features(**self.tokens(prompts)))
    return image.float(), text.float()


def as_numpy(x: torch.Tensor) -> np.ndarray:
  return x.detach().float().cpu().numpy().astype(np.float32)


# ------------------------------------------------------------------------------------------------
# CLIP score and PickScore: transformers CLIPModel folders.

OPENAI_CLIP_SOURCE = 'openai/clip-vit-large-patch14 (its preprocessor_config.json and tokenizer)'
CLIP_H_SOURCE = (
    'laion/CLIP-ViT-H-14-laion2B-s32B-b79K (preprocessor_config.json and the tokenizer files), '
    "PickScore's processor"
)


def load_clip_score(folder: str, device: str):
  """'clip_score': max(100 cos, 0) per image and prompt (module docstring)."""
  pair = ClipPair.load('clip_score', folder, device, OPENAI_CLIP_SOURCE)

  def clip_score(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    return as_numpy(clip_score_formula(cosine(*pair.features(images, prompts))))

  return clip_score


def load_pickscore(folder: str, device: str):
  """'pickscore': logit_scale.exp() * cos (about 18-23 for real images; Flow-GRPO divides by 26:
  a reward weight of 1/26 does the same)."""
  pair = ClipPair.load('pickscore', folder, device, CLIP_H_SOURCE)

  def pickscore(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    cos = cosine(*pair.features(images, prompts))
    return as_numpy(pickscore_formula(cos, pair.model.logit_scale.detach().float()))

  return pickscore


# ------------------------------------------------------------------------------------------------
# The LAION aesthetic predictor v2: an MLP head on CLIP ViT-L/14's normalised image embedding.


def mlp_head(input_size: int) -> torch.nn.Sequential:
  """improved-aesthetic-predictor's MLP (simple_inference.py; no activations, as published), which
  ImageReward's MLP copies: its state dict keys are layers.{0,2,4,6,7}.{weight,bias} (here without
  'layers.'); [B, input_size] -> [B, 1]."""
  return torch.nn.Sequential(
      torch.nn.Linear(input_size, 1024),
      torch.nn.Dropout(0.2),
      torch.nn.Linear(1024, 128),
      torch.nn.Dropout(0.2),
      torch.nn.Linear(128, 64),
      torch.nn.Dropout(0.1),
      torch.nn.Linear(64, 16),
      torch.nn.Linear(16, 1),
  )


def load_aesthetic_head(name: str, path: str) -> torch.nn.Sequential:
  state = load_state_dict(path)
  state = {k.removeprefix('layers.'): v for k, v in state.items()}
  if '0.weight' not in state:
    raise WeightsError(
        f'{path} is not an aesthetic predictor head (no layers.0.weight): use '
        "improved-aesthetic-predictor's sac+logos+ava1-l14-linearMSE.pth"
    )
  head = mlp_head(int(state['0.weight'].shape[1]))
  try:
    head.load_state_dict(state)
  except RuntimeError as e:
    raise WeightsError(f'{name} head {path}: {" ".join(str(e).split())[:300]}') from None
  return head


def load_aesthetic(folder: str, device: str):
  """'aesthetic': the predicted aesthetic rating (about 1-10) of each image; prompts unused."""
  from transformers import CLIPConfig  # pylint: disable=g-import-not-at-top
  from transformers import CLIPImageProcessorPil  # pylint: disable=g-import-not-at-top
  from transformers import CLIPVisionModelWithProjection  # pylint: disable=g-import-not-at-top

  need_folder('aesthetic', folder)
  head_path = one_file('aesthetic', folder, ['*.pth', 'aesthetic_head.safetensors'], 'head file')
  image_processor = CLIPImageProcessorPil.from_pretrained(
      processor_folder('aesthetic', folder, ['preprocessor_config.json'], OPENAI_CLIP_SOURCE)
  )
  dev = torch_device(device)
  # The image tower of the CLIPModel folder alone; its projection width is the CLIPConfig's.
  config = CLIPConfig.from_pretrained(folder)
  vision_config = config.vision_config
  vision_config.projection_dim = config.projection_dim
  vision = from_pretrained(
      'aesthetic', CLIPVisionModelWithProjection, folder, config=vision_config
  ).to(dev)
  head = load_aesthetic_head('aesthetic', head_path).eval().to(dev)
  if head[0].in_features != vision.config.projection_dim:
    raise WeightsError(
        f'aesthetic head {head_path} takes {head[0].in_features}-d embeddings; the CLIP model in '
        f'{folder!r} makes {vision.config.projection_dim}-d ones (the head needs CLIP ViT-L/14)'
    )

  @torch.inference_mode()
  def aesthetic(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    del prompts
    pil = [Image.fromarray(x) for x in rgb_batch(images)]
    pixels = image_processor(images=pil, return_tensors='pt')['pixel_values'].to(dev)
    embeds = vision(pixel_values=pixels).image_embeds.float()
    embeds = embeds / embeds.norm(dim=-1, keepdim=True)  # simple_inference.py: normalized()
    return as_numpy(head(embeds)[:, 0])

  return aesthetic
