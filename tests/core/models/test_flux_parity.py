"""Parity of digen_jax.models.transformers.flux.Flux with diffusers' FluxTransformer2DModel (tiny, CPU, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from digen_jax.models.transformers import flux
from digen_jax.models.transformers.flux import FluxConfig
from digen_jax.models.io.flux_convert import config_from_diffusers, flux_key_table, load_flux_from_diffusers
from tests.helpers import diffusers_models
from tests.helpers.parity import dot_flops, flux_pipeline_image_ids

import torch  # noqa: E402  (a missing test dependency must fail, not skip)
import diffusers  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # noqa: E402

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
)
GRID = (3, 5)  # odd, non-square token grid
B, L = 2, 7


def make_inputs(seed: int = 1):
  rng = np.random.default_rng(seed)
  latents = rng.standard_normal((B, GRID[0] * GRID[1], TINY["in_channels"]), dtype=np.float32)
  sigma = np.array([0.3, 0.85], np.float32)
  text = rng.standard_normal((B, L, TINY["joint_attention_dim"]), dtype=np.float32)
  pooled = rng.standard_normal((B, TINY["pooled_projection_dim"]), dtype=np.float32)
  guidance = np.array([3.5, 1.0], np.float32)
  return latents, sigma, text, pooled, guidance


def torch_forward(tmodel, latents, sigma, text, pooled, guidance, img_ids, txt_ids):
  # As FluxPipeline (diffusers 0.42.1) calls the transformer: timestep = sigma, guidance = raw scale, 2-D ids.
  with torch.no_grad():
    out = tmodel(
        hidden_states=torch.from_numpy(latents),
        encoder_hidden_states=torch.from_numpy(text),
        pooled_projections=torch.from_numpy(pooled),
        timestep=torch.from_numpy(sigma),
        img_ids=torch.from_numpy(img_ids).float(),
        txt_ids=torch.from_numpy(txt_ids).float(),
        guidance=None if guidance is None else torch.from_numpy(guidance),
        return_dict=False,
    )[0]
  return out.numpy()


@nnx.jit(static_argnames="img_shape")
def jit_forward(model, latents, sigma, text, pooled, guidance, img_shape):
  return model(latents, sigma, text, pooled, guidance, img_shape=img_shape)


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=[False, True], ids=["schnell", "dev"])
def pair(request, tmp_path_factory):
  """(torch model, ours loaded from its save_pretrained folder), without / with the guidance embedding."""
  tmodel = diffusers_models.randomized_transformer(
      diffusers.FluxTransformer2DModel, **TINY, guidance_embeds=request.param
  )
  folder = tmp_path_factory.mktemp("flux")
  tmodel.save_pretrained(folder)
  return tmodel, load_flux_from_diffusers(folder)


def test_forward_matches_diffusers(pair):
  tmodel, model = pair
  assert model.config == FluxConfig(**TINY, guidance_embeds=tmodel.config.guidance_embeds)
  latents, sigma, text, pooled, guidance = make_inputs()
  if not model.config.guidance_embeds:
    guidance = None
  ref = torch_forward(
      tmodel,
      latents,
      sigma,
      text,
      pooled,
      guidance,
      flux_pipeline_image_ids(*GRID),
      np.zeros((L, 3), np.float32),
  )
  args = [None if x is None else jnp.asarray(x) for x in (latents, sigma, text, pooled, guidance)]
  out = jit_forward(model, *args, GRID)
  assert out.shape == ref.shape == (B, GRID[0] * GRID[1], TINY["in_channels"])
  assert out.dtype == jnp.float32
  err = rel_err(out, ref)
  print(f"max relative error ({'dev' if guidance is not None else 'schnell'}): {err:.2e}")
  assert err <= 1e-4
  if guidance is not None:
    # The guidance input matters (else its parity above proves little).
    other = jit_forward(model, *args[:4], args[4] + 2.0, GRID)
    assert rel_err(other, np.asarray(out)) > 1e-3


def test_explicit_ids_match_diffusers(pair):
  # Non-grid positions (e.g. a second image offset on the first id axis, as FLUX Kontext does) and non-zero text
  # ids: our RoPE follows the ids, not the grid.
  tmodel, model = pair
  latents, sigma, text, pooled, guidance = make_inputs(seed=2)
  if not model.config.guidance_embeds:
    guidance = None
  img_ids = flux_pipeline_image_ids(*GRID) + np.array([1.0, 2.0, -3.0], np.float32)
  txt_ids = np.random.default_rng(3).integers(0, 9, (L, 3)).astype(np.float32)
  ref = torch_forward(tmodel, latents, sigma, text, pooled, guidance, img_ids, txt_ids)
  out = nnx.jit(lambda m, *a: m(*a, img_ids=img_ids, txt_ids=txt_ids))(
      model,
      *(None if x is None else jnp.asarray(x) for x in (latents, sigma, text, pooled, guidance)),
  )
  assert rel_err(out, ref) <= 1e-4
  grid_out = jit_forward(
      model,
      *(None if x is None else jnp.asarray(x) for x in (latents, sigma, text, pooled, guidance)),
      GRID,
  )
  assert rel_err(grid_out, ref) > 1e-3  # the ids really changed the output


def test_state_dict_loader_and_unrolled_layers(pair):
  tmodel, model = pair
  from_sd = load_flux_from_diffusers(
      tmodel.state_dict(), model.config, scan_layers=False, remat=True
  )
  assert from_sd.config.scan_layers is False
  for (path, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(model, nnx.Param)),
      nnx.to_flat_state(nnx.state(from_sd, nnx.Param)),
  ):
    np.testing.assert_array_equal(
        np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path)
    )
  # Unrolled + remat layers compute the same function as the scanned stack.
  latents, sigma, text, pooled, guidance = make_inputs()
  args = [jnp.asarray(x) for x in (latents, sigma, text, pooled)]
  args.append(jnp.asarray(guidance) if model.config.guidance_embeds else None)
  np.testing.assert_allclose(
      np.asarray(jit_forward(from_sd, *args, GRID)),
      np.asarray(jit_forward(model, *args, GRID)),
      rtol=0,
      atol=1e-5,
  )


def test_bf16_forward(pair):
  tmodel, model32 = pair
  model16 = load_flux_from_diffusers(tmodel.state_dict(), model32.config, param_dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model16, nnx.Param))} == {
      jnp.dtype(jnp.bfloat16)
  }
  latents, sigma, text, pooled, guidance = (jnp.asarray(x) for x in make_inputs())
  guidance = guidance if model32.config.guidance_embeds else None
  out32 = jit_forward(model32, latents, sigma, text, pooled, guidance, GRID)
  out16 = jit_forward(
      model16,
      latents.astype(jnp.bfloat16),
      sigma,
      text.astype(jnp.bfloat16),
      pooled,
      guidance,
      GRID,
  )
  assert out16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out16)))
  assert rel_err(out16, np.asarray(out32)) < 3e-2


def test_count_params_and_flops(pair):
  tmodel, model = pair
  cfg = model.config
  n_ours = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  n_torch = sum(p.numel() for p in tmodel.parameters())
  assert flux.count_params(cfg) == n_ours == n_torch
  # The key table covers each diffusers tensor once.
  assert {k for s in flux_key_table(cfg).values() for k in s.keys} == set(tmodel.state_dict())
  # Analytic FLOPs equal the matmul FLOPs in the traced program (scan bodies counted per layer).
  latents, sigma, text, pooled, guidance = make_inputs()
  inputs = (latents, sigma, text, pooled, guidance if cfg.guidance_embeds else None)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a, img_shape=GRID))(state, *inputs)
  assert dot_flops(jaxpr.jaxpr) == flux.flops_per_forward(cfg, B, GRID[0] * GRID[1], L)


def test_full_size_param_counts():
  # FLUX.1-dev / -schnell transformers: 11.9B parameters (dev has the extra guidance embedder).
  dev, schnell = flux.count_params(FluxConfig(guidance_embeds=True)), flux.count_params(
      FluxConfig()
  )
  assert 11.8e9 < schnell < dev < 12.0e9
  assert dev - schnell == 256 * 3072 + 3072 + 3072 * 3072 + 3072


def test_rope_tables_match_flux_pos_embed():
  # Large positions: the float64 angles of FluxPosEmbed matter there.
  ids = np.concatenate([np.zeros((3, 3)), flux_pipeline_image_ids(64, 96)[::37]], axis=0)
  cos_ref, sin_ref = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(torch.from_numpy(ids).float())
  cos, sin = flux.rope_cos_sin(ids.astype(np.int64), (16, 56, 56))
  # diffusers repeats every entry for the two members of its pair.
  np.testing.assert_array_equal(np.repeat(cos, 2, axis=1), cos_ref.numpy())
  np.testing.assert_array_equal(np.repeat(sin, 2, axis=1), sin_ref.numpy())
  np.testing.assert_array_equal(flux.image_ids(*GRID), flux_pipeline_image_ids(*GRID))


def test_config_and_input_validation(pair):
  with pytest.raises(ValueError, match="axes_dims_rope"):
    FluxConfig(attention_head_dim=64)
  with pytest.raises(ValueError, match="num_single_layers"):
    FluxConfig(num_single_layers=0)
  with pytest.raises(ValueError, match="unknown diffusers config keys"):
    config_from_diffusers({**TINY, "some_new_flag": 1})
  assert config_from_diffusers({**TINY, "out_channels": None}).out_channels == TINY["in_channels"]
  _, model = pair
  latents, sigma, text, pooled, guidance = (jnp.asarray(x) for x in make_inputs())
  guidance_arg = guidance if model.config.guidance_embeds else None
  with pytest.raises(ValueError, match="img_shape"):
    model(latents, sigma, text, pooled, guidance_arg, img_shape=(4, 4))
  with pytest.raises(ValueError, match="exactly one of img_shape"):
    model(latents, sigma, text, pooled, guidance_arg)
  with pytest.raises(ValueError, match="pooled"):
    model(latents, sigma, text, pooled[:, :3], guidance_arg, img_shape=GRID)
  with pytest.raises(ValueError, match="guidance"):
    model(
        latents,
        sigma,
        text,
        pooled,
        None if model.config.guidance_embeds else guidance,
        img_shape=GRID,
    )
  with pytest.raises(ValueError, match="txt_ids"):
    model(latents, sigma, text, pooled, guidance_arg, img_shape=GRID, txt_ids=np.zeros((L + 1, 3)))
