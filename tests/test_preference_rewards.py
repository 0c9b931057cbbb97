"""Preference-model rewards (rewards/preference.py, issue 44): each loader, given a local folder in
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

import os

import numpy as np
from PIL import Image
import pytest
import torch
from transformers import AutoTokenizer
from transformers import CLIPConfig
from transformers import CLIPImageProcessorPil
from transformers import CLIPModel

from digen_jax.experiment import tiny_pipeline
from digen_jax.rewards import learned
from digen_jax.rewards import preference

PROMPTS = [
    'a red circle left of a blue square',
    'two green triangles',
    'a photo of a cat',
    'an astronaut riding a horse on the moon',
]
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
  # im_emb_arr = normalized(image_features) (numpy L2), prediction = model(torch.from_numpy(...)).
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
