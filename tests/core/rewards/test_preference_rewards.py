"""Preference-model rewards (rewards/preference.py): each loader, given a local folder in
its published layout, must score as the reference code scores on the same weights.

The weights are tiny random models saved here (transformers CLIPModel / BLIP modules with
save_pretrained, checkpoints in the published formats); nothing is downloaded. The reference
packages (hpsv2, image-reward, open_clip_torch, torchmetrics, simple-aesthetics-predictor) do
not run in this environment: their image transforms need torchvision, whose registry wheels are
CUDA builds that cannot load with the CPU torch (and image-reward and simple-aesthetics-predictor
need transformers < 5, torchmetrics' clip_score breaks on transformers 5's get_image_features).
So each reference below is the published code path transcribed onto transformers' model classes
and plain torch, its source cited at each step.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest
import torch
from torch.nn import functional as F
from transformers import AutoTokenizer
from transformers import CLIPConfig
from transformers import CLIPImageProcessorPil
from transformers import CLIPModel

from digen_jax.experiment import tiny_pipeline
from digen_jax.rewards import hps
from digen_jax.rewards import image_reward
from digen_jax.rewards import learned
from digen_jax.rewards import preference
from digen_jax.rewards import registry
from tests.helpers.paths import REPO

PROMPTS = [
    'a red circle left of a blue square',
    'two green triangles',
    'a photo of a cat',
    'an astronaut riding a horse on the moon',
]
# Past CLIP's 77 tokens and ImageReward's 35: each cuts it as its reference does.
LONG_PROMPTS = PROMPTS[:3] + [' '.join(['a red circle left of a blue square'] * 12)]
IMAGE_SIZE = 30  # the tiny CLIP's input (CLIP-L and CLIP-H: 224)
PATCH = 6


def random_images(n: int, h: int, w: int, seed: int) -> np.ndarray:
  """uint8 [n, h, w, 3] with structure (smooth gradients + noise), not only noise."""
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
  base = np.stack([yy, xx, (yy + xx) / 2], -1)[None] * rng.uniform(0, 255, (n, 1, 1, 3))
  return np.clip(base + rng.normal(0, 30, (n, h, w, 3)), 0, 255).astype(np.uint8)


def tiny_clip(seed: int, projection_dim: int = 16) -> tuple[CLIPModel, object]:
  """A random tiny CLIPModel and the toy CLIP tokenizer (CLIP's BPE scheme, toy vocabulary)."""
  tok = tiny_pipeline.clip_tokenizer()
  ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
  cfg = CLIPConfig(
      text_config=dict(
          hidden_size=32,
          intermediate_size=48,
          num_attention_heads=4,
          num_hidden_layers=2,
          max_position_embeddings=preference.CLIP_MAX_LENGTH,
          vocab_size=len(tok),
          pad_token_id=tok.pad_token_id,
          **ids,
      ),
      vision_config=dict(
          hidden_size=32,
          intermediate_size=48,
          num_attention_heads=4,
          num_hidden_layers=2,
          image_size=IMAGE_SIZE,
          patch_size=PATCH,
      ),
      projection_dim=projection_dim,
      logit_scale_init_value=2.3,
  )
  torch.manual_seed(seed)
  model = CLIPModel(cfg).eval()
  with torch.no_grad():  # larger than the init's 0.02 std, so that scores spread
    for p in model.parameters():
      if p.ndim >= 2:
        p.normal_(0, 0.3)
  return model, tok


def save_clip_folder(folder: str, seed: int, projection_dim: int = 16) -> CLIPModel:
  """A CLIPModel folder with CLIP's processor files, as a Hugging Face snapshot holds them."""
  model, tok = tiny_clip(seed, projection_dim)
  model.save_pretrained(folder)
  tok.save_pretrained(folder)
  clip_image_processor().save_pretrained(folder)
  return model


def clip_image_processor() -> CLIPImageProcessorPil:
  """openai/clip-vit-large-patch14's preprocessor_config.json at the tiny size: shortest edge
  resized (bicubic), center crop, rescale, OpenAI mean/std."""
  return CLIPImageProcessorPil(
      size={'shortest_edge': IMAGE_SIZE},
      crop_size={'height': IMAGE_SIZE, 'width': IMAGE_SIZE},
      resample=Image.BICUBIC,
      image_mean=list(preference.OPENAI_CLIP_MEAN),
      image_std=list(preference.OPENAI_CLIP_STD),
  )


def features_of(out) -> torch.Tensor:
  return out if isinstance(out, torch.Tensor) else out.pooler_output


@pytest.fixture(scope='module')
def images():
  # Not square (the resize and center crop act) and of two sizes across tests.
  return random_images(len(PROMPTS), 40, 52, seed=1)


# ------------------------------------------------------------------------------------------------
# CLIP score


def test_clip_score_matches_torchmetrics_formula(tmp_path, images):
  folder = str(tmp_path / 'clip')
  save_clip_folder(folder, seed=0)
  score = learned.load('clip_score', folder, 'cpu')
  got = score(images, PROMPTS)
  # torchmetrics functional/multimodal/clip_score.py: CLIPModel + CLIPProcessor from the folder,
  # processor(images=..., padding=True) / processor(text=..., padding=True), features normalised,
  # score = 100 * (img * txt).sum(-1), then max(score, 0), one image-caption pair at a time.
  model = CLIPModel.from_pretrained(folder).eval()
  processor = CLIPImageProcessorPil.from_pretrained(folder)
  tok = AutoTokenizer.from_pretrained(folder)
  want = []
  with torch.no_grad():
    for image, prompt in zip(images, PROMPTS):
      pixels = processor(images=[Image.fromarray(image)], return_tensors='pt')['pixel_values']
      text = tok([prompt], padding=True, return_tensors='pt')
      img = features_of(model.get_image_features(pixel_values=pixels))
      txt = features_of(model.get_text_features(**text))
      img = img / img.norm(p=2, dim=-1, keepdim=True)
      txt = txt / txt.norm(p=2, dim=-1, keepdim=True)
      want.append(max(float(100 * (img * txt).sum(axis=-1)), 0.0))
  assert got.dtype == np.float32 and got.shape == (len(PROMPTS),)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  assert any(w > 0 for w in want) and len(set(np.round(want, 3))) > 1, want


# ------------------------------------------------------------------------------------------------
# PickScore


def test_pickscore_matches_its_readme_code(tmp_path, images):
  folder = str(tmp_path / 'pickscore')
  save_clip_folder(folder, seed=1)
  score = learned.load('pickscore', folder, 'cpu')
  got = score(images, PROMPTS)
  # PickScore's README (calc_probs): processor(images=..., padding=True, truncation=True,
  # max_length=77), processor(text=prompt, ...same), embeddings normalised,
  # scores = model.logit_scale.exp() * (text_embs @ image_embs.T)[0]; here one prompt per image.
  model = CLIPModel.from_pretrained(folder).eval()
  processor = CLIPImageProcessorPil.from_pretrained(folder)
  tok = AutoTokenizer.from_pretrained(folder)
  want = []
  with torch.no_grad():
    for image, prompt in zip(images, PROMPTS):
      image_inputs = processor(images=[Image.fromarray(image)], return_tensors='pt')
      text_inputs = tok(prompt, padding=True, truncation=True, max_length=77, return_tensors='pt')
      image_embs = features_of(model.get_image_features(**image_inputs))
      image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
      text_embs = features_of(model.get_text_features(**text_inputs))
      text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
      want.append(float((model.logit_scale.exp() * (text_embs @ image_embs.T)[0])[0]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  assert len(set(np.round(want, 3))) == len(want), want


def test_pickscore_processor_subfolder_and_missing_files(tmp_path, images):
  """PickScore_v1's snapshot has no processor: its files (CLIP-H's) may sit in processor/."""
  folder = tmp_path / 'pickscore'
  model, tok = tiny_clip(seed=1)
  model.save_pretrained(str(folder))
  with pytest.raises(preference.WeightsError, match=r'preprocessor_config.json.*CLIP-ViT-H-14'):
    learned.load('pickscore', str(folder), 'cpu')
  tok.save_pretrained(str(folder / 'processor'))
  clip_image_processor().save_pretrained(str(folder / 'processor'))
  assert learned.load('pickscore', str(folder), 'cpu')(images, PROMPTS).shape == (len(PROMPTS),)
  with pytest.raises(preference.WeightsError, match=r'pickscore=/path/to/folder'):
    learned.load('pickscore', str(tmp_path / 'absent'), 'cpu')
  # Weights of another shape than config.json says: refused, never re-initialised at random.
  config = json.loads((folder / 'config.json').read_text())
  config['projection_dim'] = 8
  (folder / 'config.json').write_text(json.dumps(config))
  with pytest.raises(preference.WeightsError, match=r'does not (load as|fit) CLIPModel'):
    learned.load('pickscore', str(folder), 'cpu')
  os.remove(folder / 'model.safetensors')
  with pytest.raises(preference.WeightsError, match=r'does not load as CLIPModel'):
    learned.load('pickscore', str(folder), 'cpu')


def test_a_video_is_scored_per_frame_and_averaged(tmp_path):
  """A Wan run's uint8 videos [B, F, H, W, 3]: each frame scored with its video's prompt, the
  frames' scores averaged (as the registry scores videos with image rewards)."""
  folder = str(tmp_path / 'pickscore')
  save_clip_folder(folder, seed=1)
  score = learned.load('pickscore', folder, 'cpu')
  videos = random_images(2 * 3, 40, 52, seed=8).reshape(2, 3, 40, 52, 3)
  prompts = PROMPTS[:2]
  frames = score(videos.reshape(6, 40, 52, 3), [p for p in prompts for _ in range(3)])
  np.testing.assert_allclose(score(videos, prompts), frames.reshape(2, 3).mean(1), rtol=1e-6)
  assert np.ptp(frames.reshape(2, 3), axis=1).min() > 0  # the frames' scores differ


# ------------------------------------------------------------------------------------------------
# LAION aesthetic predictor v2


class ReferenceAestheticMLP(torch.nn.Module):
  """improved-aesthetic-predictor simple_inference.py's MLP, as published (its state dict keys
  layers.{0,2,4,6,7})."""

  def __init__(self, input_size):
    super().__init__()
    self.input_size = input_size
    self.layers = torch.nn.Sequential(
        torch.nn.Linear(self.input_size, 1024),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1),
    )

  def forward(self, x):
    return self.layers(x)


def test_aesthetic_matches_simple_inference(tmp_path, images):
  folder = str(tmp_path / 'aesthetic')
  model = save_clip_folder(folder, seed=2, projection_dim=24)
  torch.manual_seed(3)
  mlp = ReferenceAestheticMLP(24).eval()  # simple_inference.py: model.eval()
  with torch.no_grad():
    for p in mlp.parameters():
      p.normal_(0, 0.5)
  head = os.path.join(folder, 'sac+logos+ava1-l14-linearMSE.pth')
  torch.save(mlp.state_dict(), head)
  got = learned.load('aesthetic', folder, 'cpu')(images, PROMPTS)
  # simple_inference.py: image_features = clip_model.encode_image(preprocess(pil_image)),
  # im_emb_arr = normalized(image_features) (numpy L2), prediction = model(torch.from_numpy(...));
  # the image preprocessed by the transformers CLIP processor as DDPO's aesthetic_scorer.py does.
  processor = CLIPImageProcessorPil.from_pretrained(folder)

  def normalized(a, axis=-1, order=2):
    l2 = np.atleast_1d(np.linalg.norm(a, order, axis))
    l2[l2 == 0] = 1
    return a / np.expand_dims(l2, axis)

  want = []
  with torch.no_grad():
    for image in images:
      pixels = processor(images=[Image.fromarray(image)], return_tensors='pt')['pixel_values']
      image_features = features_of(model.get_image_features(pixel_values=pixels))
      im_emb_arr = normalized(image_features.cpu().detach().numpy())
      want.append(float(mlp(torch.from_numpy(im_emb_arr).float())[0, 0]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert len(set(np.round(want, 4))) == len(want), want
  # A head for another CLIP width is refused with the reason.
  torch.save(ReferenceAestheticMLP(16).state_dict(), head)
  with pytest.raises(preference.WeightsError, match=r'takes 16-d embeddings.*24-d'):
    learned.load('aesthetic', folder, 'cpu')


# ------------------------------------------------------------------------------------------------
# HPSv2.1: an open_clip checkpoint, converted to transformers' CLIPModel by the loader; the
# reference computes open_clip's forward straight from the open_clip weights.

OPEN_CLIP_TINY = {  # open_clip's model-config format (model_configs/ViT-H-14.json), tiny
    'embed_dim': 20,
    'vision_cfg': {'image_size': 28, 'layers': 2, 'width': 48, 'head_width': 16, 'patch_size': 7},
    'text_cfg': {'context_length': 77, 'vocab_size': 0, 'width': 32, 'heads': 4, 'layers': 2},
}


def open_clip_state(cfg: dict, vocab: int, seed: int, meta: bool = False) -> dict:
  """Random weights under open_clip's CLIP names and shapes (open_clip/model.py CLIP,
  transformer.py VisionTransformer / ResidualAttentionBlock with nn.MultiheadAttention); meta:
  shapes only (no memory)."""
  g = torch.Generator().manual_seed(seed)
  v, t, e = cfg['vision_cfg'], cfg['text_cfg'], cfg['embed_dim']
  vw, tw, grid = v['width'], t['width'], v['image_size'] // v['patch_size']

  def r(*shape, std=0.3):
    if meta:
      return torch.empty(shape, device='meta')
    return torch.randn(shape, generator=g) * std

  def block(prefix, w):
    return {
        f'{prefix}ln_1.weight': 1 + r(w, std=0.1),
        f'{prefix}ln_1.bias': r(w, std=0.1),
        f'{prefix}attn.in_proj_weight': r(3 * w, w),
        f'{prefix}attn.in_proj_bias': r(3 * w, std=0.1),
        f'{prefix}attn.out_proj.weight': r(w, w),
        f'{prefix}attn.out_proj.bias': r(w, std=0.1),
        f'{prefix}ln_2.weight': 1 + r(w, std=0.1),
        f'{prefix}ln_2.bias': r(w, std=0.1),
        f'{prefix}mlp.c_fc.weight': r(4 * w, w),
        f'{prefix}mlp.c_fc.bias': r(4 * w, std=0.1),
        f'{prefix}mlp.c_proj.weight': r(w, 4 * w),
        f'{prefix}mlp.c_proj.bias': r(w, std=0.1),
    }

  state = {
      'positional_embedding': r(t['context_length'], tw),
      'text_projection': r(tw, e),
      'logit_scale': r(std=0) + 4.6052,
      'visual.class_embedding': r(vw),
      'visual.positional_embedding': r(grid * grid + 1, vw),
      'visual.proj': r(vw, e),
      'visual.conv1.weight': r(vw, 3, v['patch_size'], v['patch_size']),
      'visual.ln_pre.weight': 1 + r(vw, std=0.1),
      'visual.ln_pre.bias': r(vw, std=0.1),
      'visual.ln_post.weight': 1 + r(vw, std=0.1),
      'visual.ln_post.bias': r(vw, std=0.1),
      'token_embedding.weight': r(vocab, tw),
      'ln_final.weight': 1 + r(tw, std=0.1),
      'ln_final.bias': r(tw, std=0.1),
  }
  for i in range(v['layers']):
    state |= block(f'visual.transformer.resblocks.{i}.', vw)
  for i in range(t['layers']):
    state |= block(f'transformer.resblocks.{i}.', tw)
  return state


def open_clip_blocks(x, state, prefix, layers, heads, attn_mask=None):
  """open_clip Transformer: x + attn(ln_1(x)), x + mlp(ln_2(x)) per block, attention by
  torch.nn.MultiheadAttention (batch_first) as ResidualAttentionBlock runs it."""
  width = x.shape[-1]
  for i in range(layers):
    p = f'{prefix}{i}.'
    attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
    attn.in_proj_weight.data = state[p + 'attn.in_proj_weight']
    attn.in_proj_bias.data = state[p + 'attn.in_proj_bias']
    attn.out_proj.weight.data = state[p + 'attn.out_proj.weight']
    attn.out_proj.bias.data = state[p + 'attn.out_proj.bias']
    y = F.layer_norm(x, (width,), state[p + 'ln_1.weight'], state[p + 'ln_1.bias'])
    x = x + attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
    y = F.layer_norm(x, (width,), state[p + 'ln_2.weight'], state[p + 'ln_2.bias'])
    y = F.gelu(F.linear(y, state[p + 'mlp.c_fc.weight'], state[p + 'mlp.c_fc.bias']))
    x = x + F.linear(y, state[p + 'mlp.c_proj.weight'], state[p + 'mlp.c_proj.bias'])
  return x


def open_clip_encode_image(state, cfg, pixels):
  """open_clip VisionTransformer.forward (pool_type 'tok', ln_post before pooling) @ proj."""
  v = cfg['vision_cfg']
  x = F.conv2d(pixels, state['visual.conv1.weight'], stride=v['patch_size'])
  x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
  cls = state['visual.class_embedding'].expand(x.shape[0], 1, -1)
  x = torch.cat([cls, x], dim=1) + state['visual.positional_embedding']
  x = F.layer_norm(x, (v['width'],), state['visual.ln_pre.weight'], state['visual.ln_pre.bias'])
  heads = v['width'] // v['head_width']
  x = open_clip_blocks(x, state, 'visual.transformer.resblocks.', v['layers'], heads)
  x = F.layer_norm(x, (v['width'],), state['visual.ln_post.weight'], state['visual.ln_post.bias'])
  return x[:, 0] @ state['visual.proj']


def open_clip_encode_text(state, cfg, text):
  """open_clip CLIP.encode_text: causal mask, ln_final, the argmax token @ text_projection."""
  t = cfg['text_cfg']
  n = text.shape[1]
  x = state['token_embedding.weight'][text] + state['positional_embedding'][:n]
  mask = torch.full((n, n), float('-inf')).triu_(1)  # open_clip build_causal_mask
  x = open_clip_blocks(x, state, 'transformer.resblocks.', t['layers'], t['heads'], mask)
  x = F.layer_norm(x, (t['width'],), state['ln_final.weight'], state['ln_final.bias'])
  return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ state['text_projection']


def hps_preprocess_val(pil_image, size):
  """hpsv2/src/open_clip/transform.py image_transform(is_train=False, resize_longest_max=True):
  _convert_to_rgb_or_rgba, ToTensor, ResizeMaxSize(size, fill=0), MaskAwareNormalize; the
  torchvision tensor ops written out (torchvision is not installable with the CPU torch)."""
  x = torch.from_numpy(np.array(pil_image.convert('RGB'))).permute(2, 0, 1).float() / 255
  height, width = x.shape[1:]
  scale = size / float(max(height, width))
  if scale != 1.0:
    new_size = tuple(round(dim * scale) for dim in (height, width))
    x = F.interpolate(x[None], new_size, mode='bicubic', align_corners=False, antialias=True)[0]
    pad_h, pad_w = size - new_size[0], size - new_size[1]
    # F.pad(padding=[left, top, right, bottom]) of torchvision; torch's pad lists (l, r, t, b).
    padding = [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2]
    x = F.pad(x, (padding[0], padding[2], padding[1], padding[3]), value=0)
  mean = torch.tensor(preference.OPENAI_CLIP_MEAN)[:, None, None]
  std = torch.tensor(preference.OPENAI_CLIP_STD)[:, None, None]
  return (x - mean) / std


def save_hps_folder(folder, seed, *, tokenizer=True):
  tok = tiny_pipeline.clip_tokenizer()
  cfg = dict(OPEN_CLIP_TINY, text_cfg=dict(OPEN_CLIP_TINY['text_cfg'], vocab_size=len(tok)))
  state = open_clip_state(cfg, len(tok), seed)
  os.makedirs(folder, exist_ok=True)
  # HPS_v2.1_compressed.pt's layout: {'state_dict': ...} (img_score.py: checkpoint['state_dict']).
  torch.save({'state_dict': state}, os.path.join(folder, 'HPS_v2.1_compressed.pt'))
  with open(os.path.join(folder, hps.OPEN_CLIP_CONFIG), 'w') as f:
    json.dump(cfg, f)
  if tokenizer:
    tok.save_pretrained(folder)
  return state, cfg, tok


def test_hpsv2_checkpoint_shapes_convert_to_clip_h():
  """HPS_v2.1_compressed.pt's shapes (open_clip ViT-H-14, hpsv2's model config) give
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K's CLIPConfig and fill every weight of that model with
  the right shape (meta tensors: no memory)."""
  from transformers import CLIPModel  # pylint: disable=g-import-not-at-top

  state = open_clip_state(hps.VIT_H_14, 49408, seed=0, meta=True)
  config = hps.clip_config(state, hps.VIT_H_14)
  v, t = config.vision_config, config.text_config
  assert (v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads) == (
      1280,
      5120,
      32,
      16,
  )
  assert (v.image_size, v.patch_size, v.hidden_act, config.projection_dim) == (
      224,
      14,
      'gelu',
      1024,
  )
  assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads) == (
      1024,
      4096,
      24,
      16,
  )
  assert (t.vocab_size, t.max_position_embeddings, t.hidden_act) == (49408, 77, 'gelu')
  converted = hps.convert_state(state, config)
  with torch.device('meta'):
    model = CLIPModel(config)
  want = {k: tuple(p.shape) for k, p in model.state_dict().items() if 'position_ids' not in k}
  assert {k: tuple(p.shape) for k, p in converted.items()} == want


@pytest.mark.parametrize('shape', [(40, 52), (28, 28), (33, 21)])
def test_hpsv2_matches_open_clip_forward_and_hps_preprocessing(tmp_path, shape):
  folder = str(tmp_path / 'hps')
  state, cfg, tok = save_hps_folder(folder, seed=4)
  images = random_images(len(PROMPTS), *shape, seed=5)
  got = learned.load('hpsv2', folder, 'cpu')(images, LONG_PROMPTS)
  # hpsv2/img_score.py score(), one image and prompt at a time: preprocess_val(image),
  # tokenizer([prompt]) (open_clip pads with 0 to 77), outputs = model(image, text) with
  # normalised features, hps = diagonal(image_features @ text_features.T).
  want = []
  with torch.no_grad():
    for image, prompt in zip(images, LONG_PROMPTS):
      pixels = hps_preprocess_val(Image.fromarray(image), cfg['vision_cfg']['image_size'])[None]
      ids = tok(prompt)['input_ids']
      if len(ids) > 77:  # open_clip tokenize: tokens[:context_length], the last one <end>
        ids = ids[:77]
        ids[-1] = tok.eos_token_id
      text = torch.tensor([ids + [0] * (77 - len(ids))])
      image_features = F.normalize(open_clip_encode_image(state, cfg, pixels), dim=-1)
      text_features = F.normalize(open_clip_encode_text(state, cfg, text), dim=-1)
      want.append(float(torch.diagonal(image_features @ text_features.T)[0]))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert len(set(np.round(want, 4))) == len(want), want


def test_hpsv2_folder_errors_and_converted_folder(tmp_path, images):
  folder = str(tmp_path / 'hps')
  state, cfg, tok = save_hps_folder(folder, seed=4, tokenizer=False)
  with pytest.raises(preference.WeightsError, match=r'no CLIP tokenizer.*CLIP-ViT-H-14'):
    learned.load('hpsv2', folder, 'cpu')
  tok.save_pretrained(folder)
  want = learned.load('hpsv2', folder, 'cpu')(images, PROMPTS)
  # A CLIPModel folder of the conversion scores the same.
  converted = str(tmp_path / 'converted')
  hps.open_clip_to_transformers(state, cfg).save_pretrained(converted)
  tok.save_pretrained(converted)
  np.testing.assert_allclose(learned.load('hpsv2', converted, 'cpu')(images, PROMPTS), want, 1e-6)
  # A checkpoint with parts the plain CLIP conversion does not know is refused, not half-used.
  torch.save(
      {'state_dict': state | {'visual.transformer.resblocks.0.ls_1.gamma': torch.ones(48)}},
      os.path.join(folder, 'HPS_v2.1_compressed.pt'),
  )
  with pytest.raises(preference.WeightsError, match=r'does not know.*ls_1'):
    learned.load('hpsv2', folder, 'cpu')
  torch.save({'state_dict': state}, os.path.join(folder, 'other.pt'))
  with pytest.raises(preference.WeightsError, match=r'exactly one open_clip checkpoint'):
    learned.load('hpsv2', folder, 'cpu')


# ------------------------------------------------------------------------------------------------
# ImageReward: BLIP's own names in ImageReward.pt, loaded into transformers' BLIP modules by the
# loader; the reference runs BLIP's vit.py and med.py computations straight from those weights.

BLIP_VISION = dict(width=128, layers=2, patch=8, image_size=32)  # 128 / 64 = 2 heads
MED_CONFIG = {  # med_config.json's fields (a BertConfig), tiny
    'architectures': ['BertModel'],
    'attention_probs_dropout_prob': 0.1,
    'hidden_act': 'gelu',
    'hidden_dropout_prob': 0.1,
    'hidden_size': 32,
    'initializer_range': 0.02,
    'intermediate_size': 48,
    'layer_norm_eps': 1e-12,
    'max_position_embeddings': 40,
    'model_type': 'bert',
    'num_attention_heads': 4,
    'num_hidden_layers': 2,
    'pad_token_id': 0,
    'type_vocab_size': 2,
    'vocab_size': 0,
    'encoder_width': 768,
    'add_cross_attention': True,
}


def bert_vocab() -> list[str]:
  """A WordPiece vocabulary (bert-base-uncased's special tokens first) covering PROMPTS."""
  words = sorted({w for p in PROMPTS for w in p.lower().split()})
  return ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words + list('abcdefghijklmnopqrstuvwxyz')


def image_reward_state(vocab: int, seed: int) -> dict:
  """Random weights under ImageReward.pt's names (blip.visual_encoder.* of BLIP vit.py,
  blip.text_encoder.* of med.py BertModel(add_pooling_layer=False), mlp.layers.*)."""
  g = torch.Generator().manual_seed(seed)
  v, c = BLIP_VISION, MED_CONFIG
  vw, tw, ti = v['width'], c['hidden_size'], c['intermediate_size']

  def r(*shape, std=0.2):
    return torch.randn(*shape, generator=g) * std

  def ln(prefix, w):
    return {f'{prefix}.weight': 1 + r(w, std=0.1), f'{prefix}.bias': r(w, std=0.1)}

  def linear(prefix, n_out, n_in, std=0.2):
    return {f'{prefix}.weight': r(n_out, n_in, std=std), f'{prefix}.bias': r(n_out, std=0.1)}

  grid = v['image_size'] // v['patch']
  state = {
      'blip.visual_encoder.cls_token': r(1, 1, vw),
      'blip.visual_encoder.pos_embed': r(1, grid * grid + 1, vw),
      **linear('blip.visual_encoder.patch_embed.proj', vw, 1),
      **ln('blip.visual_encoder.norm', vw),
      'blip.text_encoder.embeddings.word_embeddings.weight': r(vocab, tw, std=0.5),
      'blip.text_encoder.embeddings.position_embeddings.weight': r(
          c['max_position_embeddings'], tw
      ),
      'blip.text_encoder.embeddings.position_ids': torch.arange(c['max_position_embeddings'])[None],
      **ln('blip.text_encoder.embeddings.LayerNorm', tw),
      **linear('blip.vision_proj', 16, vw),  # BLIP_Pretrain's, unused by ImageReward.score
      **linear('blip.text_proj', 16, tw),
  }
  state['blip.visual_encoder.patch_embed.proj.weight'] = r(vw, 3, v['patch'], v['patch'])
  for i in range(v['layers']):
    p = f'blip.visual_encoder.blocks.{i}'
    state |= ln(f'{p}.norm1', vw) | ln(f'{p}.norm2', vw)
    state |= linear(f'{p}.attn.qkv', 3 * vw, vw) | linear(f'{p}.attn.proj', vw, vw)
    state |= linear(f'{p}.mlp.fc1', 4 * vw, vw) | linear(f'{p}.mlp.fc2', vw, 4 * vw)
  for i in range(c['num_hidden_layers']):
    p = f'blip.text_encoder.encoder.layer.{i}'
    for attn, kv_width in (('attention', tw), ('crossattention', vw)):
      state |= linear(f'{p}.{attn}.self.query', tw, tw)
      state |= linear(f'{p}.{attn}.self.key', tw, kv_width)
      state |= linear(f'{p}.{attn}.self.value', tw, kv_width)
      state |= linear(f'{p}.{attn}.output.dense', tw, tw) | ln(f'{p}.{attn}.output.LayerNorm', tw)
    state |= linear(f'{p}.intermediate.dense', ti, tw)
    state |= linear(f'{p}.output.dense', tw, ti) | ln(f'{p}.output.LayerNorm', tw)
  for j, (n_out, n_in) in zip(
      (0, 2, 4, 6, 7), ((1024, tw), (128, 1024), (64, 128), (16, 64), (1, 16))
  ):
    state |= linear(f'mlp.layers.{j}', n_out, n_in, std=1.0 / math.sqrt(n_in))
  return state


def blip_vit(state, pixels):
  """BLIP vit.py VisionTransformer.forward (Attention: qkv reshaped to (3, B, heads, N, d))."""
  v = BLIP_VISION
  heads, p = v['width'] // 64, 'blip.visual_encoder.'
  x = F.conv2d(
      pixels,
      state[p + 'patch_embed.proj.weight'],
      state[p + 'patch_embed.proj.bias'],
      stride=v['patch'],
  )
  x = x.flatten(2).transpose(1, 2)  # timm PatchEmbed
  x = torch.cat([state[p + 'cls_token'].expand(x.shape[0], -1, -1), x], dim=1)
  x = x + state[p + 'pos_embed'][:, : x.size(1), :]

  def norm(x, name):
    return F.layer_norm(x, (x.shape[-1],), state[name + '.weight'], state[name + '.bias'], eps=1e-6)

  def lin(x, name):
    return F.linear(x, state[name + '.weight'], state[name + '.bias'])

  for i in range(v['layers']):
    b = f'{p}blocks.{i}.'
    y = norm(x, b + 'norm1')
    B, N, C = y.shape
    qkv = lin(y, b + 'attn.qkv').reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, vv = qkv[0], qkv[1], qkv[2]
    attn = ((q @ k.transpose(-2, -1)) * (C // heads) ** -0.5).softmax(dim=-1)
    x = x + lin((attn @ vv).transpose(1, 2).reshape(B, N, C), b + 'attn.proj')
    x = x + lin(F.gelu(lin(norm(x, b + 'norm2'), b + 'mlp.fc1')), b + 'mlp.fc2')
  return norm(x, p + 'norm')


def med_bert(state, input_ids, attention_mask, image_embeds):
  """BLIP med.py BertModel.forward (mode 'multimodal'): embeddings (word + absolute position,
  LayerNorm), per layer self-attention with the extended mask (1 - mask) * -10000, cross-attention
  to the image tokens, feed-forward; post-LN residuals, eps from med_config."""
  c, p = MED_CONFIG, 'blip.text_encoder.'
  heads, eps = c['num_attention_heads'], c['layer_norm_eps']

  def lin(x, name):
    return F.linear(x, state[name + '.weight'], state[name + '.bias'])

  def norm(x, name):
    return F.layer_norm(x, (x.shape[-1],), state[name + '.weight'], state[name + '.bias'], eps=eps)

  def attention(x, kv, mask, name):
    B, N, C = x.shape
    split = lambda t: t.view(B, -1, heads, C // heads).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = (
        split(lin(t, f'{name}.self.{n}')) for t, n in ((x, 'query'), (kv, 'key'), (kv, 'value'))
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // heads) + mask
    ctx = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, N, C)
    return norm(lin(ctx, f'{name}.output.dense') + x, f'{name}.output.LayerNorm')

  n = input_ids.shape[1]
  x = state[p + 'embeddings.word_embeddings.weight'][input_ids]
  x = norm(x + state[p + 'embeddings.position_embeddings.weight'][:n], p + 'embeddings.LayerNorm')
  self_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
  cross_mask = torch.zeros(1, 1, 1, image_embeds.shape[1])  # image_atts: all ones
  for i in range(c['num_hidden_layers']):
    b = f'{p}encoder.layer.{i}.'
    x = attention(x, x, self_mask, b + 'attention')
    x = attention(x, image_embeds, cross_mask, b + 'crossattention')
    x = norm(
        lin(F.gelu(lin(x, b + 'intermediate.dense')), b + 'output.dense') + x,
        b + 'output.LayerNorm',
    )
  return x


def image_reward_transform(pil_image, n_px):
  """ImageReward.py _transform(n_px): Resize(n_px, BICUBIC), CenterCrop(n_px), RGB, ToTensor,
  Normalize; torchvision's PIL path written out (torchvision is not installable here)."""
  w, h = pil_image.size
  if min(w, h) != n_px:  # transforms.functional.resize: shorter side to n_px, longer truncated
    if w <= h:
      pil_image = pil_image.resize((n_px, int(n_px * h / w)), Image.BICUBIC)
    else:
      pil_image = pil_image.resize((int(n_px * w / h), n_px), Image.BICUBIC)
  w, h = pil_image.size
  top, left = int(round((h - n_px) / 2.0)), int(round((w - n_px) / 2.0))  # F.center_crop
  pil_image = pil_image.crop((left, top, left + n_px, top + n_px)).convert('RGB')
  x = torch.from_numpy(np.array(pil_image)).permute(2, 0, 1).float() / 255
  mean = torch.tensor((0.48145466, 0.4578275, 0.40821073))[:, None, None]
  std = torch.tensor((0.26862954, 0.26130258, 0.27577711))[:, None, None]
  return (x - mean) / std


def save_image_reward_folder(folder, seed):
  vocab = bert_vocab()
  state = image_reward_state(len(vocab), seed)
  os.makedirs(folder, exist_ok=True)
  torch.save(state, os.path.join(folder, 'ImageReward.pt'))
  with open(os.path.join(folder, 'med_config.json'), 'w') as f:
    json.dump(dict(MED_CONFIG, vocab_size=len(vocab)), f)
  with open(os.path.join(folder, 'vocab.txt'), 'w') as f:
    f.write('\n'.join(vocab) + '\n')
  return state, vocab


def test_image_reward_checkpoint_shapes_give_blip_large():
  """ImageReward.pt's shapes (BLIP create_vit('large', 224)) and its med_config.json give
  transformers' BLIP modules of ViT-L/16 (16 heads, eps 1e-6) and BERT-base with cross-attention
  to 1024-d image tokens, every weight of the right shape (meta tensors: no memory)."""
  from transformers import BlipTextModel  # pylint: disable=g-import-not-at-top
  from transformers import BlipVisionModel  # pylint: disable=g-import-not-at-top

  meta = lambda *shape: torch.empty(*shape, device='meta')  # noqa: E731
  state = {
      'blip.visual_encoder.cls_token': meta(1, 1, 1024),
      'blip.visual_encoder.pos_embed': meta(1, 14 * 14 + 1, 1024),
      'blip.visual_encoder.patch_embed.proj.weight': meta(1024, 3, 16, 16),
      'blip.visual_encoder.patch_embed.proj.bias': meta(1024),
      'blip.visual_encoder.norm.weight': meta(1024),
      'blip.visual_encoder.norm.bias': meta(1024),
  }
  for i in range(24):
    p = f'blip.visual_encoder.blocks.{i}.'
    for name, shape in (
        ('norm1', (1024,)),
        ('norm2', (1024,)),
        ('attn.qkv', (3072, 1024)),
        ('attn.proj', (1024, 1024)),
        ('mlp.fc1', (4096, 1024)),
        ('mlp.fc2', (1024, 4096)),
    ):
      state[p + name + '.weight'] = meta(*shape)
      state[p + name + '.bias'] = meta(shape[0])
  vision = image_reward.vision_state(state)
  config = image_reward.vision_config(vision)
  assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
      1024,
      24,
      16,
  )
  assert (config.image_size, config.patch_size, config.layer_norm_eps) == (224, 16, 1e-6)
  with torch.device('meta'):
    model = BlipVisionModel(config)
  assert {k: tuple(v.shape) for k, v in vision.items()} == {
      k: tuple(v.shape) for k, v in model.state_dict().items()
  }
  # BLIP's configs/med_config.json, as ImageReward ships it.
  med = dict(
      MED_CONFIG,
      hidden_size=768,
      intermediate_size=3072,
      max_position_embeddings=512,
      num_attention_heads=12,
      num_hidden_layers=12,
      vocab_size=30524,
  )
  text_config = image_reward.text_config(med, config.hidden_size)
  with torch.device('meta'):
    text = BlipTextModel(text_config, add_pooling_layer=False)
  shapes = {k: tuple(v.shape) for k, v in text.state_dict().items()}
  assert shapes['encoder.layer.11.crossattention.self.key.weight'] == (768, 1024)
  assert shapes['embeddings.word_embeddings.weight'] == (30524, 768)
  assert (
      'pooler.dense.weight' not in shapes and 'encoder.layer.12.output.dense.weight' not in shapes
  )


@pytest.mark.parametrize('shape', [(40, 52), (32, 32), (44, 40)])  # (44, 40): crop offset 1.5
def test_image_reward_matches_blip_forward_and_transform(tmp_path, shape):
  folder = str(tmp_path / 'image_reward')
  state, vocab = save_image_reward_folder(folder, seed=6)
  images = random_images(len(PROMPTS), *shape, seed=7)
  got = learned.load('image_reward', folder, 'cpu')(images, LONG_PROMPTS)
  # ImageReward.score(prompt, image), one at a time: tokenizer(prompt, padding='max_length',
  # truncation=True, max_length=35), image_embeds = visual_encoder(preprocess(image)),
  # text_encoder(ids, mask, encoder_hidden_states=image_embeds, encoder_attention_mask=ones),
  # rewards = (mlp(last_hidden_state[:, 0]) - mean) / std.
  ids = {w: i for i, w in enumerate(vocab)}
  want = []
  with torch.no_grad():
    for image, prompt in zip(images, LONG_PROMPTS):
      words = [ids[w] for w in prompt.lower().split()][:33]  # truncation=True: 35 with both
      tokens = [ids['[CLS]']] + words + [ids['[SEP]']]
      input_ids = torch.tensor([tokens + [0] * (35 - len(tokens))])
      mask = (input_ids != 0).long()
      pixels = image_reward_transform(Image.fromarray(image), BLIP_VISION['image_size'])[None]
      image_embeds = blip_vit(state, pixels)
      txt_features = med_bert(state, input_ids, mask, image_embeds)[:, 0, :]
      x = txt_features
      for j in (0, 2, 4, 6, 7):  # MLP: Linear / Dropout (eval: identity) ..., no activations
        x = F.linear(x, state[f'mlp.layers.{j}.weight'], state[f'mlp.layers.{j}.bias'])
      want.append(float((x[0, 0] - 0.16717362830052426) / 1.0333394966054072))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert len(set(np.round(want, 3))) == len(want), want


def test_image_reward_folder_errors(tmp_path, images):
  folder = str(tmp_path / 'image_reward')
  state, _ = save_image_reward_folder(folder, seed=6)
  os.remove(os.path.join(folder, 'med_config.json'))
  with pytest.raises(preference.WeightsError, match=r'no med_config.json.*THUDM/ImageReward'):
    learned.load('image_reward', folder, 'cpu')
  with open(os.path.join(folder, 'med_config.json'), 'w') as f:  # a text encoder too wide
    json.dump(dict(MED_CONFIG, vocab_size=len(bert_vocab()), hidden_size=64), f)
  with pytest.raises(preference.WeightsError, match=r'text encoder'):
    learned.load('image_reward', folder, 'cpu')
  torch.save(
      {k: v for k, v in state.items() if not k.startswith('mlp.')},
      os.path.join(folder, 'ImageReward.pt'),
  )
  with pytest.raises(preference.WeightsError, match=r"not ImageReward's state dict"):
    learned.load('image_reward', folder, 'cpu')


# ------------------------------------------------------------------------------------------------
# Through the run's reward interface: config.reward names them, a worker process loads them.


@pytest.mark.slow
def test_all_five_in_a_reward_worker_as_a_config_declares_them(tmp_path, images):
  """reward.weights names the five, reward.models their folders; one worker process (torch and
  transformers there, not here) scores them; its parts equal the loaders' own scores."""
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top
  from digen_jax.rewards import scoring  # pylint: disable=g-import-not-at-top

  folders = {n: str(tmp_path / n) for n in ('clip_score', 'pickscore', 'aesthetic')}
  save_clip_folder(folders['clip_score'], seed=0)
  save_clip_folder(folders['pickscore'], seed=1)
  save_clip_folder(folders['aesthetic'], seed=2, projection_dim=24)
  torch.save(ReferenceAestheticMLP(24).state_dict(), os.path.join(folders['aesthetic'], 'head.pth'))
  folders['hpsv2'] = str(tmp_path / 'hpsv2')
  save_hps_folder(folders['hpsv2'], seed=4)
  folders['image_reward'] = str(tmp_path / 'image_reward')
  save_image_reward_folder(folders['image_reward'], seed=6)
  r = configlib.base_config().reward
  r.weights = 'clip_score:0.01,pickscore:0.05,hpsv2:1,image_reward:0.5,aesthetic:0.1'
  r.models = ','.join(f'{n}={f}' for n, f in folders.items())
  r.start_timeout_s = 300.0
  assert set(scoring.where_each(r, registry.parse_weights(r.weights)).values()) == {'workers'}
  rewards = scoring.build(r, registry.parse_weights(r.weights))
  try:
    scores = rewards.submit(images, PROMPTS).result()
  finally:
    rewards.close()
  assert scores.failed == 0 and not scores.faults
  for k, name in enumerate(rewards.names):
    want = learned.load(name, folders[name], 'cpu')(images, PROMPTS)
    np.testing.assert_allclose(scores.parts[k], want, rtol=1e-5, atol=1e-5, err_msg=name)
  weights = np.asarray([rewards.weights[n] for n in rewards.names], np.float32)
  np.testing.assert_allclose(scores.total, weights @ scores.parts, rtol=1e-5, atol=1e-5)


def test_a_learned_reward_without_its_folder_is_one_line_at_config_load():
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top
  from digen_jax.rewards import scoring  # pylint: disable=g-import-not-at-top

  for name in sorted(learned.NEEDS_FOLDER):
    r = configlib.base_config().reward
    r.weights = name
    with pytest.raises(ValueError, match=rf'--config.reward.models={name}=/path/to/folder'):
      scoring.where_each(r, {name: 1.0})


def test_declaring_them_imports_no_torch_in_the_training_process(tmp_path):
  """The training process resolves reward.weights (rewards/scoring.py) without importing torch,
  transformers or the loaders' modules (rewards/preference.py, hps.py, image_reward.py)."""
  code = (
      'import sys\n'
      'from digen_jax.experiment import config as configlib\n'
      'from digen_jax.rewards import registry, scoring\n'
      'r = configlib.base_config().reward\n'
      "r.weights = 'clip_score,pickscore,hpsv2,image_reward,aesthetic'\n"
      f"r.models = ','.join(n + '={tmp_path}' for n in r.weights.split(','))\n"
      'print(sorted(set(scoring.where_each(r, registry.parse_weights(r.weights)).values())))\n'
      "print([m for m in ('torch', 'transformers', 'digen_jax.rewards.preference',\n"
      "    'digen_jax.rewards.hps', 'digen_jax.rewards.image_reward') if m in sys.modules])\n"
  )
  out = subprocess.run(
      [sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split('\n')[:2] == ["['workers']", '[]'], out.stdout
