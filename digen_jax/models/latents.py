"""Latent packing (2x2 patches -> tokens, exactly diffusers' QwenImage _pack_latents; video frames
one after another) and decoders."""

from __future__ import annotations

import jax.numpy as jnp


def pack(latents, patch: int):
  """[B, H, W, C] -> [B, (H/p)*(W/p), C*p*p], channel-major inside a token like diffusers."""
  b, h, w, c = latents.shape
  x = latents.reshape(b, h // patch, patch, w // patch, patch, c)
  x = x.transpose(0, 1, 3, 5, 2, 4)  # b, h/p, w/p, c, p, p
  return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens, height: int, width: int, patch: int):
  """Inverse of `pack`: [B, N, C*p*p] -> [B, H, W, C]."""
  b, n, cpp = tokens.shape
  c = cpp // (patch * patch)
  x = tokens.reshape(b, height // patch, width // patch, c, patch, patch)
  x = x.transpose(0, 1, 4, 2, 5, 3)  # b, h/p, p, w/p, p, c
  return x.reshape(b, height, width, c)


def pack_frames(latents, patch: int):
  """Video [B, F, H, W, C] -> [B, F*(H/p)*(W/p), C*p*p]: every frame packed as `pack`, frames one
  after another (the token order of diffusers' Wan patch embedding: frame, row, column)."""
  b, f, h, w, c = latents.shape
  tokens = pack(latents.reshape(b * f, h, w, c), patch)
  return tokens.reshape(b, -1, tokens.shape[-1])


def unpack_frames(tokens, frames: int, height: int, width: int, patch: int):
  """Inverse of `pack_frames`: [B, F*N, C*p*p] -> [B, F, H, W, C]."""
  b, n, cpp = tokens.shape
  x = unpack(tokens.reshape(b * frames, n // frames, cpp), height, width, patch)
  return x.reshape(b, frames, *x.shape[1:])


def decode_pixels(tokens, height: int, width: int, patch: int):
  """Identity decoder of pixel-space configs: packed tokens -> images [B, H, W, C] in [-1, 1]."""
  return jnp.clip(unpack(tokens, height, width, patch), -1.0, 1.0)
