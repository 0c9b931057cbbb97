"""Parity of digen_jax.models.transformers.mmdit.MMDiT with diffusers' QwenImageTransformer2DModel (tiny, CPU, float32)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from digen_jax.models.io.convert import config_from_diffusers, load_diffusers_state
from digen_jax.models.transformers.mmdit import MMDiT, MMDiTConfig, count_params, flops_per_forward, rope_positions
from tests.helpers.parity import dot_flops, subjaxprs

import torch  # noqa: E402  (a missing test dependency must fail, not skip)
import diffusers  # noqa: E402

TINY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12),
)
IMG_SHAPE = (1, 4, 6)  # non-square on purpose: h and w centring differ
B, L = 2, 7


def make_torch_model(seed: int = 0):
  """Tiny diffusers model with every tensor (weights, biases, norm scales) randomised."""
  torch.manual_seed(seed)
  model = diffusers.QwenImageTransformer2DModel(**TINY).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if (
          name.endswith("norm_q.weight")
          or name.endswith("norm_k.weight")
          or "norm_added" in name
          or name == "txt_norm.weight"
      ):
        p.copy_(
            1.0 + 0.3 * noise
        )  # norm scales: around 1, far from it enough to catch a missed map
      elif name.endswith(".bias"):
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))
  return model


def make_inputs(seed: int = 1):
  rng = np.random.default_rng(seed)
  n_img = int(np.prod(IMG_SHAPE))
  latents = rng.standard_normal((B, n_img, TINY["in_channels"]), dtype=np.float32)
  sigma = np.array([0.3, 0.85], np.float32)
  text = rng.standard_normal((B, L, TINY["joint_attention_dim"]), dtype=np.float32)
  mask = np.ones((B, L), np.int64)
  mask[1, 4:] = 0  # second prompt padded: 4 real tokens, 3 padding
  return latents, sigma, text, mask


def torch_forward(model, latents, sigma, text, mask):
  # Exactly how QwenImagePipeline (diffusers 0.42.1) calls the transformer.
  with torch.no_grad():
    out = model(
        hidden_states=torch.from_numpy(latents),
        timestep=torch.from_numpy(sigma),
        guidance=None,
        encoder_hidden_states_mask=torch.from_numpy(mask),
        encoder_hidden_states=torch.from_numpy(text),
        img_shapes=[[IMG_SHAPE]] * latents.shape[0],
        return_dict=False,
    )[0]
  return out.numpy()


def ours_from_torch(tmodel, param_dtype=jnp.float32):
  cfg = config_from_diffusers(dict(tmodel.config))
  model = MMDiT(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype)
  sd = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
  return load_diffusers_state(model, sd)


@nnx.jit(static_argnames="img_shape")
def jit_forward(model, latents, sigma, text, mask, img_shape):
  return model(latents, sigma, text, mask, img_shape=img_shape)


@pytest.fixture(scope="module")
def pair():
  tmodel = make_torch_model()
  return tmodel, ours_from_torch(tmodel)


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def test_forward_matches_diffusers(pair):
  tmodel, model = pair
  latents, sigma, text, mask = make_inputs()
  ref = torch_forward(tmodel, latents, sigma, text, mask)
  out = jit_forward(
      model,
      jnp.asarray(latents),
      jnp.asarray(sigma),
      jnp.asarray(text),
      jnp.asarray(mask),
      IMG_SHAPE,
  )
  assert (
      out.shape
      == ref.shape
      == (B, int(np.prod(IMG_SHAPE)), TINY["patch_size"] ** 2 * TINY["out_channels"])
  )
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) <= 1e-4
  # No mask (diffusers: encoder_hidden_states_mask=None) also matches.
  with torch.no_grad():
    ref_nomask = tmodel(
        hidden_states=torch.from_numpy(latents),
        timestep=torch.from_numpy(sigma),
        encoder_hidden_states=torch.from_numpy(text),
        img_shapes=[[IMG_SHAPE]] * B,
        return_dict=False,
    )[0].numpy()
  out_nomask = model(
      jnp.asarray(latents), jnp.asarray(sigma), jnp.asarray(text), None, img_shape=IMG_SHAPE
  )
  assert rel_err(out_nomask, ref_nomask) <= 1e-4
  # The mask actually matters in this setup (else the padded-row check above proves nothing).
  assert rel_err(ref[1], ref_nomask[1]) > 1e-3


def test_padded_text_does_not_change_image_output(pair):
  _, model = pair
  latents, sigma, text, mask = make_inputs()
  args = (jnp.asarray(latents), jnp.asarray(sigma))
  base = jit_forward(model, *args, jnp.asarray(text), jnp.asarray(mask), IMG_SHAPE)
  changed = text.copy()
  changed[1, 4:] = 100.0 * np.random.default_rng(5).standard_normal(changed[1, 4:].shape)
  out = jit_forward(model, *args, jnp.asarray(changed), jnp.asarray(mask), IMG_SHAPE)
  np.testing.assert_allclose(np.asarray(out), np.asarray(base), rtol=0, atol=1e-6)
  # Control: changing a real (unmasked) token of the same row does change the image output.
  real = text.copy()
  real[1, 0] += 1.0
  out_real = jit_forward(model, *args, jnp.asarray(real), jnp.asarray(mask), IMG_SHAPE)
  assert float(jnp.max(jnp.abs(out_real[1] - base[1]))) > 1e-3


def _dot_dtypes(jaxpr):
  """Operand dtypes of every dot_general in a (closed) jaxpr, recursing into sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for sub in subjaxprs(eqn):
      found += _dot_dtypes(sub)
  return found


def test_bf16_forward(pair):
  tmodel, model32 = pair
  model16 = ours_from_torch(tmodel, param_dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model16, nnx.Param))} == {
      jnp.dtype(jnp.bfloat16)
  }
  latents, sigma, text, mask = make_inputs()
  inputs = [jnp.asarray(x) for x in (latents, sigma, text, mask)]
  out32 = jit_forward(model32, *inputs, IMG_SHAPE)
  # sigma stays float32: rounding it to bf16 moves t = 1000*sigma by up to ~2 and changes the sinusoidal
  # embedding far more than bf16 matmuls do (diffusers' bf16 forward does round it; we do not).
  bf16_inputs = [
      inputs[0].astype(jnp.bfloat16),
      inputs[1],
      inputs[2].astype(jnp.bfloat16),
      inputs[3],
  ]
  out16 = jit_forward(model16, *bf16_inputs, IMG_SHAPE)
  assert out16.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(out16)))
  assert rel_err(out16, np.asarray(out32)) < 3e-2
  # The matmuls really run in bf16 (not silently promoted to f32).
  graphdef, state = nnx.split(model16)
  jaxpr = jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a, img_shape=IMG_SHAPE))(
      state, *bf16_inputs
  )
  dtypes = _dot_dtypes(jaxpr.jaxpr)
  assert len(dtypes) > 20 and all(d == ("bfloat16", "bfloat16") for d in dtypes), dtypes


def test_count_params_and_flops(pair):
  tmodel, model = pair
  cfg = model.config
  n_ours = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  n_torch = sum(p.numel() for p in tmodel.parameters())
  assert count_params(cfg) == n_ours == n_torch
  # Full-size QwenImage is the published ~20B transformer.
  assert 19e9 < count_params(MMDiTConfig()) < 21e9
  # Analytic FLOPs equal the matmul FLOPs in the traced program (scan body counted num_layers times).
  latents, sigma, text, mask = make_inputs()
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a, img_shape=IMG_SHAPE))(
      state, latents, sigma, text, mask
  )
  n_img = int(np.prod(IMG_SHAPE))
  assert dot_flops(jaxpr.jaxpr) == flops_per_forward(cfg, B, n_img, L)


def test_rope_positions_follow_qwen_layout():
  img, txt = rope_positions((2, 3, 4), 5)
  assert img.shape == (24, 3) and txt.shape == (5, 3)
  np.testing.assert_array_equal(np.unique(img[:, 0]), [0, 1])
  np.testing.assert_array_equal(
      np.unique(img[:, 1]), [-2, -1, 0]
  )  # h=3: centred, odd -> one more negative
  np.testing.assert_array_equal(np.unique(img[:, 2]), [-2, -1, 0, 1])  # w=4
  np.testing.assert_array_equal(img[5], [0, -1, -1])  # row-major: token 5 = (f0, y1, x1)
  np.testing.assert_array_equal(txt[:, 0], np.arange(5) + 2)  # starts at max(h//2, w//2)


def test_config_validation():
  with pytest.raises(ValueError, match="axes_dims_rope"):
    MMDiTConfig(attention_head_dim=64, axes_dims_rope=(16, 56, 56))
  with pytest.raises(ValueError, match="axes_dims_rope"):
    MMDiTConfig(attention_head_dim=33, axes_dims_rope=(9, 12, 12))
  with pytest.raises(ValueError, match="num_layers"):
    MMDiTConfig(num_layers=0)
  with pytest.raises(ValueError, match="guidance_embeds"):
    MMDiTConfig(guidance_embeds=True)
  with pytest.raises(ValueError, match="zero_cond_t"):
    config_from_diffusers({**TINY, "zero_cond_t": True})
  with pytest.raises(ValueError, match="unknown diffusers config keys"):
    config_from_diffusers({**TINY, "some_new_flag": 1})
  assert config_from_diffusers({**TINY, "out_channels": None}).out_channels == TINY["in_channels"]


def test_input_validation(pair):
  _, model = pair
  latents, sigma, text, mask = (jnp.asarray(x) for x in make_inputs())
  with pytest.raises(ValueError, match="img_shape"):
    model(latents, sigma, text, mask, img_shape=(1, 5, 5))
  with pytest.raises(ValueError, match="text_mask"):
    model(latents, sigma, text, mask[:, :3], img_shape=IMG_SHAPE)
  with pytest.raises(ValueError, match="sigma"):
    model(latents, sigma[:1], text, mask, img_shape=IMG_SHAPE)
