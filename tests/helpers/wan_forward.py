"""The tiny Wan latent grid and one forward of ours and of diffusers' WanTransformer3DModel on it,
for the parity test and the pipeline test that reads a run's adapters back through diffusers."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from digen_jax.models import latents as latents_lib

FRAMES, H, W = 3, 10, 14  # latent grid: odd frame count, odd token grid (3 x 5 x 7)
IMG_SHAPE = (FRAMES, H // 2, W // 2)


def torch_forward(tmodel, latents, sigma, text):
  """As WanPipeline calls the transformer: [B, C, F, H, W] latents, timestep = 1000 sigma;
  latents [B, F, H, W, C] in and out."""
  import torch  # pylint: disable=g-import-not-at-top  (only the diffusers side needs it)

  with torch.no_grad():
    out = tmodel(
        hidden_states=torch.from_numpy(latents).permute(0, 4, 1, 2, 3),
        timestep=torch.from_numpy(np.float32(1000.0) * sigma),
        encoder_hidden_states=torch.from_numpy(text),
        return_dict=False,
    )[0]
  return out.permute(0, 2, 3, 4, 1).numpy()  # back to [B, F, H, W, C]


@nnx.jit(static_argnames='img_shape')
def jit_forward(model, tokens, sigma, text, img_shape):
  return model(tokens, sigma, text, img_shape=img_shape)


def ours_forward(model, latents, sigma, text, dtype=jnp.float32):
  """Our model on latents [B, FRAMES, H, W, C] -> velocity of the same shape."""
  tokens = latents_lib.pack_frames(jnp.asarray(latents, dtype), 2)
  out = jit_forward(model, tokens, jnp.asarray(sigma), jnp.asarray(text, dtype), IMG_SHAPE)
  return np.asarray(latents_lib.unpack_frames(out, FRAMES, H, W, 2))
