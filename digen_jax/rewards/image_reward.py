"""ImageReward v1.0, the learned reward 'image_reward', from a local folder (reward workers only:
imports torch and transformers).

ImageReward (THUDM, ImageReward/ImageReward.py) is BLIP: a ViT-L/16 image encoder whose tokens a
BERT text encoder cross-attends to, and an MLP head on the text encoder's first ([CLS]) token:

    reward = (mlp(text_encoder(prompt tokens, image tokens)[:, 0]) - mean) / std

(ImageReward.score; mean 0.16717362830052426, std 1.0333394966054072). The folder holds what the
ImageReward package downloads: ImageReward.pt (the model's state dict: blip.visual_encoder.*,
blip.text_encoder.*, mlp.layers.*), med_config.json (the text encoder's BertConfig), and the
bert-base-uncased tokenizer's vocab.txt (BLIP's init_tokenizer loads bert-base-uncased). The
weights are loaded into transformers' BLIP modules (BlipVisionModel, BlipTextModel: the port of
BLIP's vit.py and med.py; the vision names renamed as transformers' BLIP conversion script does).

Preprocessing is ImageReward's _transform(224): Resize(224, bicubic) of the PIL image (shorter
side to 224), CenterCrop(224), ToTensor, Normalize (OpenAI CLIP's mean and std); prompts are
tokenized padded to max_length 35 and truncated. Scores are float32.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Sequence

import numpy as np
from PIL import Image
import torch

from digen_jax.rewards import preference

# ImageReward.py: ImageReward.__init__ (self.mean, self.std) and score() (max_length=35).
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
MAX_LENGTH = 35
IMAGE_SIZE = 224  # ImageReward: BLIP_Pretrain(image_size=224), _transform(224)
HEAD_WIDTH = 64  # BLIP create_vit: ViT-B 768 / 12 heads, ViT-L 1024 / 16 heads
VISION_LAYER_NORM_EPS = 1e-6  # BLIP vit.py: norm_layer = partial(nn.LayerNorm, eps=1e-6)
CHECKPOINT = 'ImageReward.pt'
MED_CONFIG = 'med_config.json'
SOURCE = 'THUDM/ImageReward (ImageReward.pt, med_config.json) and bert-base-uncased (vocab.txt)'


def image_reward_formula(head_output: torch.Tensor) -> torch.Tensor:
  """ImageReward.score: (mlp(txt_features) - mean) / std; head_output [B, 1] -> [B]."""
  return ((head_output - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD)[:, 0]


def blip_pixels(images: np.ndarray, size: int = IMAGE_SIZE) -> torch.Tensor:
  """uint8 [B, H, W, 3] -> [B, 3, size, size] float32 as ImageReward's _transform(size) makes
  them of PIL images (torchvision's PIL path written out: Resize's output size, CenterCrop's
  rounding)."""
  out = []
  for x in preference.rgb_batch(images):
    image = Image.fromarray(x)
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    if short != size:  # torchvision Resize(size): shorter side to size, longer int(size * l / s)
      new_short, new_long = size, int(size * long / short)
      new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
      image = image.resize((new_w, new_h), Image.BICUBIC)
    w, h = image.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))  # CenterCrop
    image = image.crop((left, top, left + size, top + size))
    out.append(np.asarray(image.convert('RGB'), np.float32) / 255.0)  # ToTensor
  x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
  mean = torch.tensor(preference.OPENAI_CLIP_MEAN)[:, None, None]
  std = torch.tensor(preference.OPENAI_CLIP_STD)[:, None, None]
  return (x - mean) / std


# ------------------------------------------------------------------------------------------------
# BLIP's names -> transformers' BLIP modules.


def vision_state(state: dict) -> dict:
  """blip.visual_encoder.* (vit.py VisionTransformer) -> BlipVisionModel names, as transformers'
  convert_blip_original_pytorch_to_hf.py renames them."""
  out = {}
  prefix = 'blip.visual_encoder.'
  for key, value in state.items():
    if not key.startswith(prefix):
      continue
    k = key[len(prefix) :]
    k = {
        'cls_token': 'embeddings.class_embedding',
        'pos_embed': 'embeddings.position_embedding',
        'patch_embed.proj.weight': 'embeddings.patch_embedding.weight',
        'patch_embed.proj.bias': 'embeddings.patch_embedding.bias',
        'norm.weight': 'post_layernorm.weight',
        'norm.bias': 'post_layernorm.bias',
    }.get(k, k)
    k = re.sub(r'^blocks\.', 'encoder.layers.', k)
    k = k.replace('.attn.proj.', '.self_attn.projection.').replace('.attn.qkv.', '.self_attn.qkv.')
    k = k.replace('.norm1.', '.layer_norm1.').replace('.norm2.', '.layer_norm2.')
    out[k] = value
  return out


def text_state(state: dict) -> dict:
  """blip.text_encoder.* (med.py BertModel) -> BlipTextModel names: the same (transformers ported
  med.py keeping them); med.py's position_ids buffer dropped."""
  prefix = 'blip.text_encoder.'
  return {
      k[len(prefix) :]: v
      for k, v in state.items()
      if k.startswith(prefix) and not k.endswith('position_ids')
  }


def vision_config(vision: dict):
  from transformers import BlipVisionConfig  # pylint: disable=g-import-not-at-top

  width = vision['embeddings.class_embedding'].shape[-1]
  patch = vision['embeddings.patch_embedding.weight'].shape[-1]
  layers = {int(m.group(1)) for k in vision if (m := re.match(r'encoder\.layers\.(\d+)\.', k))}
  return BlipVisionConfig(
      hidden_size=width,
      intermediate_size=vision['encoder.layers.0.mlp.fc1.weight'].shape[0],
      num_hidden_layers=len(layers),
      num_attention_heads=width // HEAD_WIDTH,
      image_size=patch * math.isqrt(vision['embeddings.position_embedding'].shape[1] - 1),
      patch_size=patch,
      hidden_act='gelu',  # timm Mlp: nn.GELU
      layer_norm_eps=VISION_LAYER_NORM_EPS,
  )


def text_config(med_config: dict, encoder_width: int):
  """med_config.json (a BertConfig) -> BlipTextConfig; BLIP_Pretrain sets encoder_width to the
  vision width."""
  from transformers import BlipTextConfig  # pylint: disable=g-import-not-at-top

  c = med_config
  return BlipTextConfig(
      vocab_size=c['vocab_size'],
      hidden_size=c['hidden_size'],
      encoder_hidden_size=encoder_width,
      intermediate_size=c['intermediate_size'],
      num_hidden_layers=c['num_hidden_layers'],
      num_attention_heads=c['num_attention_heads'],
      max_position_embeddings=c['max_position_embeddings'],
      hidden_act=c.get('hidden_act', 'gelu'),
      layer_norm_eps=c.get('layer_norm_eps', 1e-12),
      pad_token_id=c.get('pad_token_id', 0),
      is_decoder=True,  # builds the cross-attention layers; the forward runs bidirectionally
  )


def _load_into(name: str, model, weights: dict, what: str):
  try:
    missing, unexpected = model.load_state_dict(weights, strict=False)
  except RuntimeError as e:  # a shape that does not fit
    raise preference.WeightsError(f'{name}: {what}: {" ".join(str(e).split())[:300]}') from None
  if missing or unexpected:
    raise preference.WeightsError(
        f'{name}: {what} does not fit: missing {sorted(missing)[:3]}, unexpected '
        f'{sorted(unexpected)[:3]}'
    )
  return model.eval()


def load_model(folder: str):
  """(BlipVisionModel, BlipTextModel, MLP head) of an ImageReward folder (module docstring)."""
  from transformers import BlipTextModel  # pylint: disable=g-import-not-at-top
  from transformers import BlipVisionModel  # pylint: disable=g-import-not-at-top

  name = 'image_reward'
  for f in (CHECKPOINT, MED_CONFIG):
    if not os.path.isfile(os.path.join(folder, f)):
      raise preference.WeightsError(
          f'{name} weights folder {folder!r} has no {f}: copy it from {SOURCE}'
      )
  state = {
      k: v.float() for k, v in preference.load_state_dict(os.path.join(folder, CHECKPOINT)).items()
  }
  with open(os.path.join(folder, MED_CONFIG)) as f:
    med_config = json.load(f)
  vision = vision_state(state)
  if 'embeddings.class_embedding' not in vision or 'mlp.layers.0.weight' not in state:
    raise preference.WeightsError(
        f"{name}: {CHECKPOINT} in {folder!r} is not ImageReward's state dict (no "
        'blip.visual_encoder.cls_token or mlp.layers.0.weight)'
    )
  vision_model = _load_into(
      name, BlipVisionModel(vision_config(vision)), vision, 'the image encoder'
  )
  text_model = BlipTextModel(
      text_config(med_config, vision_model.config.hidden_size), add_pooling_layer=False
  )
  text_model = _load_into(name, text_model, text_state(state), f'the text encoder ({MED_CONFIG})')
  head_state = {k.removeprefix('mlp.'): v for k, v in state.items() if k.startswith('mlp.')}
  head = preference.mlp_head(int(head_state['layers.0.weight'].shape[1]))
  _load_into(name, head, {k.removeprefix('layers.'): v for k, v in head_state.items()}, 'the head')
  return vision_model, text_model, head


def load(folder: str, device: str):
  """'image_reward': ImageReward's score of each image for its prompt (about -2..2)."""
  from transformers import BertTokenizer  # pylint: disable=g-import-not-at-top

  preference.need_folder('image_reward', folder)
  if not os.path.isfile(os.path.join(folder, 'vocab.txt')):
    raise preference.WeightsError(
        f"image_reward weights folder {folder!r} has no vocab.txt: copy bert-base-uncased's "
        f"(BLIP's tokenizer; {SOURCE})"
    )
  # BLIP's init_tokenizer adds [DEC] and [ENC], which a prompt does not contain: plain
  # bert-base-uncased tokens (lower-cased WordPiece, [CLS] ... [SEP]).
  tokenizer = BertTokenizer(os.path.join(folder, 'vocab.txt'), do_lower_case=True)
  dev = preference.torch_device(device)
  vision_model, text_model, head = (m.to(dev) for m in load_model(folder))
  size = vision_model.config.image_size

  @torch.inference_mode()
  def image_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    tokens = tokenizer(
        list(prompts),
        padding='max_length',
        truncation=True,
        max_length=MAX_LENGTH,
        return_tensors='pt',
    ).to(dev)
    image_embeds = vision_model(pixel_values=blip_pixels(images, size).to(dev)).last_hidden_state
    image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=dev)
    text_output = text_model(
        input_ids=tokens['input_ids'],
        attention_mask=tokens['attention_mask'],
        encoder_hidden_states=image_embeds,
        encoder_attention_mask=image_atts,
        is_decoder=False,
    )
    txt_features = text_output.last_hidden_state[:, 0, :].float()
    return preference.as_numpy(image_reward_formula(head(txt_features)))

  return image_reward
