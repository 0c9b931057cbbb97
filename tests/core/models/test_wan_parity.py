"""Parity of digen_jax.models.transformers.wan.Wan with diffusers' WanTransformer3DModel (tiny, CPU, float32),
its loaders (state dict, folder, streamed onto a 4-device FSDP mesh), LoRA target names, analytic
sizes and the family entry."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from digen_jax.models import family as family_lib
from digen_jax.models import latents as latents_lib
from digen_jax.models.lora import adapters as lora
from digen_jax.models.io import tensor_source
from digen_jax.models.transformers import wan
from digen_jax.models.io import wan_convert
from digen_jax.models.transformers.wan import WanConfig
from digen_jax.parallel import mesh as mesh_lib
from tests.helpers import diffusers_models
from tests.helpers.parity import dot_flops, rel_err
from tests.helpers.wan_forward import FRAMES, H, IMG_SHAPE, W, jit_forward, ours_forward, torch_forward

import torch  # noqa: E402  (a missing test dependency must fail, not skip)
import diffusers  # noqa: E402

# Head dim 16: RoPE axes (8, 4, 4); two heads, so norms across heads differ from per-head ones.
TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=24,
    freq_dim=256,
    ffn_dim=48,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm='rms_norm_across_heads',
    eps=1e-6,
    rope_max_seq_len=32,
)
B, L = 2, 9
LENGTHS = (4, 9)  # prompt lengths: WanPipeline zeroes the embeddings past them


def make_inputs(seed: int = 1):
  """(latents [B, F, H, W, C], sigma [B], text [B, L, text_dim] zero past each prompt's length)."""
  rng = np.random.default_rng(seed)
  latents = rng.standard_normal((B, FRAMES, H, W, TINY['in_channels']), dtype=np.float32)
  sigma = np.array([0.3, 0.85], np.float32)
  text = rng.standard_normal((B, L, TINY['text_dim']), dtype=np.float32)
  for i, n in enumerate(LENGTHS):
    text[i, n:] = 0.0
  return latents, sigma, text


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  tmodel = diffusers_models.randomized_transformer(diffusers.WanTransformer3DModel, **TINY)
  root = tmp_path_factory.mktemp('wan')
  tmodel.save_pretrained(root / 'transformer')
  return root, tmodel


@pytest.fixture(scope='module')
def model(folder):
  return wan_convert.load_wan_folder(folder[0])


def test_forward_matches_diffusers(folder, model):
  _, tmodel = folder
  assert model.config == WanConfig(
      patch_size=2,
      num_attention_heads=2,
      attention_head_dim=16,
      in_channels=4,
      out_channels=4,
      joint_attention_dim=24,
      ffn_dim=48,
      num_layers=2,
      rope_max_seq_len=32,
  )
  assert model.config.axes_dims_rope == (8, 4, 4)
  latents, sigma, text = make_inputs()
  ref = torch_forward(tmodel, latents, sigma, text)
  out = ours_forward(model, latents, sigma, text)
  assert out.shape == ref.shape == (B, FRAMES, H, W, TINY['out_channels'])
  err = rel_err(out, ref)
  print(f'Wan transformer max relative error: {err:.2e}')
  assert err <= 1e-4
  # Every input matters: a frame shuffled, the text's zero padding shortened, another sigma.
  assert rel_err(ours_forward(model, latents[:, ::-1], sigma, text), ref) > 1e-3
  assert rel_err(ours_forward(model, latents, sigma[::-1], text), ref) > 1e-3
  short = jit_forward(
      model,
      latents_lib.pack_frames(jnp.asarray(latents), 2),
      jnp.asarray(sigma),
      jnp.asarray(text[:, :5]),
      IMG_SHAPE,
  )
  assert rel_err(latents_lib.unpack_frames(short, FRAMES, H, W, 2)[:1], ref[:1]) > 1e-4


def test_bf16_forward_close_to_float32(folder, model):
  model16 = wan_convert.load_wan_folder(folder[0], param_dtype=jnp.bfloat16)
  dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model16, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  latents, sigma, text = make_inputs()
  out32 = ours_forward(model, latents, sigma, text)
  out16 = ours_forward(model16, latents, sigma, text, jnp.bfloat16)
  assert out16.dtype == np.float32 and np.all(np.isfinite(out16))
  err = rel_err(out16, out32)
  print(f'Wan transformer bf16 vs float32 relative error: {err:.2e}')
  assert err < 3e-2


def test_unrolled_layers_and_state_dict_loader(folder, model):
  _, tmodel = folder
  sd = {k: v.numpy() for k, v in tmodel.state_dict().items()}
  unrolled = wan_convert.LOADER.load_state(
      wan_convert.LOADER.abstract_module(
          wan_convert.config_from_diffusers(dict(tmodel.config), scan_layers=False, remat=True)
      ),
      sd,
  )
  latents, sigma, text = make_inputs(seed=3)
  np.testing.assert_allclose(
      ours_forward(unrolled, latents, sigma, text),
      ours_forward(model, latents, sigma, text),
      rtol=0,
      atol=1e-5,
  )


def test_streamed_fsdp_load_equals_folder_load(folder, model):
  mesh = mesh_lib.make_mesh(jax.devices()[:4])
  cfg, graphdef, state = wan_convert.load_wan_sharded(
      folder[0], lambda a: mesh_lib.fsdp_shardings(a, mesh)
  )
  assert cfg == model.config
  ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  sharded = 0
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    np.testing.assert_array_equal(np.asarray(value), np.asarray(ours[path].get_value()))
    sharded += value.sharding.spec != jax.sharding.PartitionSpec()
  assert sharded >= 10  # the big params are really split over the 4 devices
  assert nnx.merge(graphdef, state).blocks.attn1.norm_q.scale.shape == (2, 32)


def test_key_table_lora_names_and_family(folder, model):
  _, tmodel = folder
  cfg = model.config
  table = wan_convert.wan_key_table(cfg)
  assert tensor_source.file_keys(table) == set(tmodel.state_dict())
  n_ours = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert wan.count_params(cfg) == n_ours == sum(p.numel() for p in tmodel.parameters())
  # LoRA targets by diffusers module names: both attentions' projections of every block; the
  # patch embedding (a Conv3d) is never a target.
  params = nnx.state(model, nnx.Param)
  paths = lora.target_paths(params, table, lora.LoraConfig(4, 4.0, wan_convert.ATTENTION_TARGETS))
  assert paths == sorted(
      f'blocks.{a}.{p}.kernel'
      for a in ('attn1', 'attn2')
      for p in ('to_k', 'to_out', 'to_q', 'to_v')
  )
  ffn = lora.target_paths(params, table, lora.LoraConfig(4, 4.0, r'ffn\.net\.0\.proj$'))
  assert ffn == ['blocks.ffn.fc1.kernel']
  with pytest.raises(ValueError, match='matches only some layers'):
    lora.target_paths(params, table, lora.LoraConfig(4, 4.0, r'blocks\.0\.attn1\.to_q$'))
  # The family entry: the same forward through the conditioning dict.
  fam = family_lib.get('wan')
  assert fam.cond_keys == ('text', 'text_mask')
  assert fam.read_config(folder[0]) == cfg and fam.key_table(cfg) == table
  latents, sigma, text = make_inputs()
  tokens = latents_lib.pack_frames(jnp.asarray(latents), 2)
  cond = {'text': jnp.asarray(text), 'text_mask': jnp.asarray((np.abs(text).sum(-1) > 0))}
  via_family = fam.forward(model, tokens, jnp.asarray(sigma), cond, IMG_SHAPE, 5.0)
  np.testing.assert_allclose(
      np.asarray(via_family),
      np.asarray(jit_forward(model, tokens, jnp.asarray(sigma), jnp.asarray(text), IMG_SHAPE)),
      rtol=0,
      atol=2e-5,
  )


def test_diffusers_loads_our_wan_lora(folder, model, tmp_path):
  """diffusers' own WanPipeline.load_lora_weights reads our adapters file (both attentions of
  every block, alpha != rank) and reproduces our merged forward."""
  _, tmodel = folder
  cfg = lora.LoraConfig(2, 3.0, wan_convert.ATTENTION_TARGETS)
  graphdef, state = nnx.split(model)
  table = wan_convert.wan_key_table(model.config)
  adapters = lora.init_adapters(state, lora.target_paths(state, table, cfg), cfg, jax.random.key(0))
  key = jax.random.key(1)
  for p in adapters:  # B = 0 at init: give every adapter real values
    key, k = jax.random.split(key)
    adapters[p]['b'] = 0.3 * jax.random.normal(k, adapters[p]['b'].shape)
  lora.save_diffusers_lora(tmp_path, jax.device_get(adapters), cfg, table)
  transformer = copy.deepcopy(tmodel)
  pipe = diffusers.WanPipeline(
      tokenizer=None,
      text_encoder=None,
      vae=None,
      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
      transformer=transformer,
  )
  pipe.load_lora_weights(str(tmp_path))
  latents, sigma, text = make_inputs(seed=5)
  ref = torch_forward(transformer, latents, sigma, text)
  ours = ours_forward(nnx.merge(graphdef, lora.merge(state, adapters, cfg)), latents, sigma, text)
  err = rel_err(ours, ref)
  print(f'Wan LoRA through diffusers load_lora_weights: max relative error {err:.2e}')
  assert err <= 1e-4
  assert rel_err(torch_forward(tmodel, latents, sigma, text), ref) > 0.05  # the adapters matter


def test_flops_and_full_size_counts(model):
  cfg = model.config
  latents, sigma, text = make_inputs()
  tokens = latents_lib.pack_frames(jnp.asarray(latents), 2)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a, img_shape=IMG_SHAPE))(
      state, tokens, sigma, text
  )
  n_img = int(np.prod(IMG_SHAPE))
  assert dot_flops(jaxpr.jaxpr) == wan.flops_per_forward(cfg, B, n_img, L)
  # The released sizes: Wan2.1 1.3B and 14B.
  small = WanConfig(num_layers=30, num_attention_heads=12, ffn_dim=8960)
  assert 1.40e9 < wan.count_params(small) < 1.45e9
  assert 14.2e9 < wan.count_params(WanConfig()) < 14.4e9


def test_rope_tables_match_diffusers():
  from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

  shape = (21, 30, 52)  # Wan2.1 at 81 frames, 480 x 832
  rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024)
  cos_ref, sin_ref = rope(torch.zeros(1, 16, shape[0], 2 * shape[1], 2 * shape[2]))
  cos, sin = wan.rope_cos_sin(shape, wan.rope_axes(128))
  # diffusers repeats every entry for the two members of its pair.
  np.testing.assert_array_equal(np.repeat(cos, 2, axis=1), cos_ref[0, :, 0].numpy())
  np.testing.assert_array_equal(np.repeat(sin, 2, axis=1), sin_ref[0, :, 0].numpy())


def test_config_and_input_errors(model):
  base = {k: v for k, v in TINY.items()}
  with pytest.raises(ValueError, match='unknown diffusers config keys'):
    wan_convert.config_from_diffusers({**base, 'some_new_flag': 1})
  with pytest.raises(ValueError, match='image-conditioned'):
    wan_convert.config_from_diffusers({**base, 'image_dim': 1280})
  with pytest.raises(ValueError, match=r'only \(1, p, p\) patches'):
    wan_convert.config_from_diffusers({**base, 'patch_size': [2, 2, 2]})
  with pytest.raises(ValueError, match='freq_dim'):
    wan_convert.config_from_diffusers({**base, 'freq_dim': 128})
  with pytest.raises(ValueError, match='_class_name'):
    wan_convert.config_from_diffusers({**base, '_class_name': 'FluxTransformer2DModel'})
  assert wan_convert.config_from_diffusers({**base, 'out_channels': None}).out_channels == 4
  with pytest.raises(ValueError, match='axes_dims_rope is fixed'):
    WanConfig(attention_head_dim=16, axes_dims_rope=(4, 6, 6))
  latents, sigma, text = make_inputs()
  tokens = latents_lib.pack_frames(jnp.asarray(latents), 2)
  with pytest.raises(ValueError, match='img_shape'):
    model(tokens, sigma, text, img_shape=(FRAMES, 7, 5 + 1))
  with pytest.raises(ValueError, match='rope_max_seq_len'):
    model(jnp.zeros((1, 35, 16)), sigma[:1], text[:1], img_shape=(35, 1, 1))
  with pytest.raises(ValueError, match=r'latents must be \[B, N_img, 16\]'):
    model(tokens[..., :4], sigma, text, img_shape=IMG_SHAPE)
