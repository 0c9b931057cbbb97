"""HPSv2.1 (Human Preference Score v2.1), the learned reward 'hpsv2', from a local folder (reward
workers only: imports torch and transformers).

HPSv2.1 is an open_clip ViT-H-14 fine-tune; its score is the cosine similarity of the image and
prompt embeddings (hpsv2/img_score.py, score(): `image_features @ text_features.T`, diagonal,
of open_clip's normalised features). The folder holds

  - the published checkpoint, HPS_v2.1_compressed.pt (a dict {'state_dict': open_clip keys}; any
    one *.pt / *.bin / *.safetensors of open_clip keys), converted here to a transformers
    CLIPModel (open_clip_to_transformers: the same computation, weights renamed and split); its
    architecture is ViT-H-14 (hpsv2/src/open_clip/model_configs/ViT-H-14.json) unless an
    open_clip_config.json in open_clip's model-config format says otherwise;
    or a CLIPModel folder (config.json + weights) of such a conversion;
  - CLIP's BPE tokenizer (tokenizer.json, or vocab.json + merges.txt: those of
    laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the vocabulary of open_clip's tokenizer).

Preprocessing is HPSv2's (create_model_and_transforms(light_augmentation=True) ->
transform.image_transform(resize_longest_max=True)): ToTensor, ResizeMaxSize (the longer side to
224 by bicubic interpolation of the tensor, antialiased as torchvision >= 0.17 resizes tensors,
then zero padding to a square), Normalize with OpenAI CLIP's mean and std. Scores are float32
(the reference runs under CUDA autocast).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from digen_jax.rewards import preference

# hpsv2/src/open_clip/model_configs/ViT-H-14.json: the architecture of HPSv2.1's checkpoint.
VIT_H_14 = {
    'embed_dim': 1024,
    'vision_cfg': {
        'image_size': 224,
        'layers': 32,
        'width': 1280,
        'head_width': 80,
        'patch_size': 14,
    },
    'text_cfg': {
        'context_length': 77,
        'vocab_size': 49408,
        'width': 1024,
        'heads': 16,
        'layers': 24,
    },
}
OPEN_CLIP_CONFIG = 'open_clip_config.json'
TOKENIZER_SOURCE = 'laion/CLIP-ViT-H-14-laion2B-s32B-b79K (open_clip ViT-H-14 tokenizer)'
# Buffers of open_clip's CLIP that hold no weights (the causal mask; rebuilt by transformers).
IGNORED_KEYS = ('attn_mask',)


def hps_formula(cos: torch.Tensor) -> torch.Tensor:
  """hpsv2/img_score.py score(): the diagonal of image_features @ text_features.T (open_clip
  normalises both): the cosine itself."""
  return cos


def hps_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
  """uint8 [B, H, W, 3] -> [B, 3, size, size] float32, as HPSv2's preprocess_val makes them:
  ToTensor, ResizeMaxSize(size, fill=0) (hpsv2/src/open_clip/transform.py), Normalize."""
  x = images.permute(0, 3, 1, 2).float() / 255.0  # ToTensor
  h, w = x.shape[-2:]
  scale = size / float(max(h, w))
  if scale != 1.0:  # ResizeMaxSize.forward, as written: resize and pad only when scale != 1
    new_h, new_w = round(h * scale), round(w * scale)
    # torchvision F.resize of a float tensor: interpolate(bicubic, align_corners=False,
    # antialias=True), no clamping.
    x = F.interpolate(x, size=(new_h, new_w), mode='bicubic', align_corners=False, antialias=True)
    pad_h, pad_w = size - new_h, size - new_w
    x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
  mean = torch.tensor(preference.OPENAI_CLIP_MEAN, device=x.device)[:, None, None]
  std = torch.tensor(preference.OPENAI_CLIP_STD, device=x.device)[:, None, None]
  return (x - mean) / std


# ------------------------------------------------------------------------------------------------
# open_clip -> transformers CLIPModel.


def _layers(state: dict, prefix: str) -> int:
  found = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r'(\d+)\.', k))}
  return len(found)


def clip_config(state: dict, cfg: dict):
  """The transformers CLIPConfig of an open_clip CLIP state dict; widths, depths and sizes from the
  weights' shapes, heads from `cfg` (open_clip's model config: vision heads = width / head_width,
  text heads = text_cfg.heads)."""
  from transformers import CLIPConfig  # pylint: disable=g-import-not-at-top

  vision_cfg, text_cfg = cfg.get('vision_cfg', {}), cfg.get('text_cfg', {})
  width, _, patch, _ = state['visual.conv1.weight'].shape
  grid = math.isqrt(state['visual.positional_embedding'].shape[0] - 1)
  vocab, text_width = state['token_embedding.weight'].shape
  act = 'quick_gelu' if cfg.get('quick_gelu') else 'gelu'  # open_clip's QuickGELU flag
  return CLIPConfig(
      vision_config=dict(
          hidden_size=width,
          intermediate_size=state['visual.transformer.resblocks.0.mlp.c_fc.weight'].shape[0],
          num_hidden_layers=_layers(state, 'visual.transformer.resblocks.'),
          num_attention_heads=width // int(vision_cfg.get('head_width', 64)),
          image_size=patch * grid,
          patch_size=patch,
          hidden_act=act,
          layer_norm_eps=1e-5,
      ),
      text_config=dict(
          vocab_size=vocab,
          hidden_size=text_width,
          intermediate_size=state['transformer.resblocks.0.mlp.c_fc.weight'].shape[0],
          num_hidden_layers=_layers(state, 'transformer.resblocks.'),
          num_attention_heads=int(text_cfg.get('heads', 8)),
          max_position_embeddings=state['positional_embedding'].shape[0],
          hidden_act=act,
          layer_norm_eps=1e-5,
          # eos_token_id 2 selects transformers' legacy pooling, the token of the largest id:
          # open_clip's encode_text pools x[arange, text.argmax(-1)] (the end token is the
          # vocabulary's last).
          eos_token_id=2,
      ),
      projection_dim=state['text_projection'].shape[1],
  )


def _block(state: dict, used: set, src: str, dst: str) -> dict:
  """One open_clip ResidualAttentionBlock (nn.MultiheadAttention's packed in_proj) as a
  transformers CLIPEncoderLayer."""

  def take(key):
    used.add(src + key)
    return state[src + key]

  q, k, v = take('attn.in_proj_weight').chunk(3, dim=0)
  qb, kb, vb = take('attn.in_proj_bias').chunk(3, dim=0)
  out = {}
  for name, w, b in (('q_proj', q, qb), ('k_proj', k, kb), ('v_proj', v, vb)):
    out[f'{dst}self_attn.{name}.weight'], out[f'{dst}self_attn.{name}.bias'] = w, b
  pairs = {
      'attn.out_proj': 'self_attn.out_proj',
      'ln_1': 'layer_norm1',
      'ln_2': 'layer_norm2',
      'mlp.c_fc': 'mlp.fc1',
      'mlp.c_proj': 'mlp.fc2',
  }
  for a, b in pairs.items():
    for p in ('weight', 'bias'):
      out[f'{dst}{b}.{p}'] = take(f'{a}.{p}')
  return out


def convert_state(state: dict, config, name: str = 'hpsv2') -> dict:
  """open_clip CLIP weights -> transformers CLIPModel weights (`config`: clip_config's).
  WeightsError when the checkpoint has parts this conversion does not know (layer scale,
  attention pooling, a Hugging Face text tower...)."""
  used: set = set()

  def take(key):
    used.add(key)
    return state[key]

  try:
    out = {
        'vision_model.embeddings.patch_embedding.weight': take('visual.conv1.weight'),
        'vision_model.embeddings.class_embedding': take('visual.class_embedding'),
        'vision_model.embeddings.position_embedding.weight': take('visual.positional_embedding'),
        'vision_model.pre_layrnorm.weight': take('visual.ln_pre.weight'),
        'vision_model.pre_layrnorm.bias': take('visual.ln_pre.bias'),
        'vision_model.post_layernorm.weight': take('visual.ln_post.weight'),
        'vision_model.post_layernorm.bias': take('visual.ln_post.bias'),
        'visual_projection.weight': take('visual.proj').T,  # x @ proj == Linear(proj.T)
        'text_model.embeddings.token_embedding.weight': take('token_embedding.weight'),
        'text_model.embeddings.position_embedding.weight': take('positional_embedding'),
        'text_model.final_layer_norm.weight': take('ln_final.weight'),
        'text_model.final_layer_norm.bias': take('ln_final.bias'),
        'text_projection.weight': take('text_projection').T,
        'logit_scale': take('logit_scale'),
    }
    for i in range(config.vision_config.num_hidden_layers):
      out |= _block(
          state, used, f'visual.transformer.resblocks.{i}.', f'vision_model.encoder.layers.{i}.'
      )
    for i in range(config.text_config.num_hidden_layers):
      out |= _block(state, used, f'transformer.resblocks.{i}.', f'text_model.encoder.layers.{i}.')
  except KeyError as e:
    raise preference.WeightsError(
        f'{name}: the checkpoint is not an open_clip CLIP state dict (no {e.args[0]!r})'
    ) from None
  left = sorted(k for k in state if k not in used and k not in IGNORED_KEYS)
  if left:
    raise preference.WeightsError(
        f'{name}: the checkpoint has {len(left)} open_clip weights this conversion does not know, '
        f'e.g. {left[:3]} (only the plain CLIP architecture of ViT-H-14 converts)'
    )
  return out


def open_clip_to_transformers(state: dict, cfg: dict, name: str = 'hpsv2'):
  """open_clip CLIP state dict (+ its model config) -> a transformers CLIPModel computing the
  same embeddings."""
  from transformers import CLIPModel  # pylint: disable=g-import-not-at-top

  try:
    config = clip_config(state, cfg)
  except KeyError as e:
    raise preference.WeightsError(
        f'{name}: the checkpoint is not an open_clip CLIP state dict (no {e.args[0]!r})'
    ) from None
  out = convert_state(state, config, name)
  model = CLIPModel(config)
  try:
    missing, unexpected = model.load_state_dict(out, strict=False)
  except RuntimeError as e:  # a shape the config does not give (e.g. heads)
    raise preference.WeightsError(f'{name}: {" ".join(str(e).split())[:300]}') from None
  missing = [k for k in missing if not k.endswith('position_ids')]
  if missing or unexpected:
    raise preference.WeightsError(f'{name}: conversion left {missing[:3]} / {unexpected[:3]}')
  return model.eval()


# ------------------------------------------------------------------------------------------------
# The loader.


def load_model(folder: str):
  """The CLIPModel of an HPSv2 folder (module docstring): a CLIPModel folder as it is, else the
  one open_clip checkpoint converted."""
  from transformers import CLIPModel  # pylint: disable=g-import-not-at-top

  if os.path.isfile(os.path.join(folder, 'config.json')):
    return preference.from_pretrained('hpsv2', CLIPModel, folder)
  path = preference.one_file(
      'hpsv2', folder, ['*.pt', '*.bin', '*.safetensors'], 'open_clip checkpoint'
  )
  cfg = VIT_H_14
  if os.path.isfile(os.path.join(folder, OPEN_CLIP_CONFIG)):
    with open(os.path.join(folder, OPEN_CLIP_CONFIG)) as f:
      cfg = json.load(f)
  state = {k: v.float() for k, v in preference.load_state_dict(path).items()}
  return open_clip_to_transformers(state, cfg)


def load(folder: str, device: str):
  """'hpsv2': HPSv2.1's score of each image for its prompt (about 0.2-0.35 for real images)."""
  from transformers import CLIPTokenizer  # pylint: disable=g-import-not-at-top

  preference.need_folder('hpsv2', folder)
  tokenizer = CLIPTokenizer.from_pretrained(
      preference.tokenizer_folder('hpsv2', folder, TOKENIZER_SOURCE)
  )
  dev = preference.torch_device(device)
  model = load_model(folder).to(dev)
  size = model.config.vision_config.image_size

  @torch.inference_mode()
  def hpsv2(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    pixels = hps_pixels(torch.tensor(preference.rgb_batch(images), device=dev), size)
    # open_clip's tokenizer: <start> + BPE + <end>, cut to 77 with <end> last, as this one.
    tokens = tokenizer(
        list(prompts),
        padding=True,
        truncation=True,
        max_length=preference.CLIP_MAX_LENGTH,
        return_tensors='pt',
    ).to(dev)
    image = preference.pooled(model.get_image_features(pixel_values=pixels))
    text = preference.pooled(model.get_text_features(**tokens))
    return preference.as_numpy(hps_formula(preference.cosine(image.float(), text.float())))

  return hpsv2
