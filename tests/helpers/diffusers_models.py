"""Tiny diffusers reference models with every tensor randomised, shared by the parity tests."""

import math

import diffusers
import torch


def randomized_transformer(model_cls=diffusers.QwenImageTransformer2DModel, **config):
  """A model_cls(**config) (a diffusers transformer; QwenImage by default) in eval mode whose every
  tensor is random (norm scales ~1 +- 0.3, biases ~0.2, weights ~1/sqrt(fan_in)), so a mis-mapped
  tensor shows."""
  torch.manual_seed(0)
  model = model_cls(**config).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim == 1 and 'norm' in name:
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith('.bias'):
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))
  return model


def randomize_vae(model: torch.nn.Module, seed: int) -> None:
  """Every parameter of a diffusers VAE random, in place: norm scales (RMS `gamma`s, 1-D norm
  `weight`s) ~1 +- 0.3, biases ~0.1, weights ~1/sqrt(fan_in); the decoder's conv_out a quarter of
  that, so activations stay O(1) and the decoded pixels mostly inside (-1, 1), where the final
  clamp does not hide differences."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith('gamma') or (p.ndim == 1 and name.endswith('weight')):
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith('bias'):
        p.copy_(0.1 * noise)
      else:
        fan_in = p[0].numel() if p.ndim > 1 else 1
        p.copy_(noise / math.sqrt(fan_in))
    model.decoder.conv_out.weight.mul_(0.25)
