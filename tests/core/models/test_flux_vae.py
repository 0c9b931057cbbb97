"""FLUX.1 VAE (digen_jax.models.vae.flux_vae) against diffusers' AutoencoderKL on tiny random models
saved with save_pretrained: decode, encode, FluxPipeline's packed decode and its encode scaling,
tiled and sliced decode, quant convs and the attention-free mid block, the config reader, the key
table and the loader's error messages, bf16 params."""

import copy
import json

from diffusers import AutoencoderKL
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
import torch

from digen_jax.models.vae import flux_vae
from digen_jax.models import latents as latents_lib
from digen_jax.models.io import tensor_source
from digen_jax.models.vae import qwen_vae as vae_lib
from tests.helpers import diffusers_models

# FLUX.1-dev's (and -schnell's) vae/config.json as published.
FLUX_CONFIG = {
    '_class_name': 'AutoencoderKL',
    '_diffusers_version': '0.30.0.dev0',
    'act_fn': 'silu',
    'block_out_channels': [128, 256, 512, 512],
    'down_block_types': ['DownEncoderBlock2D'] * 4,
    'force_upcast': True,
    'in_channels': 3,
    'latent_channels': 16,
    'latents_mean': None,
    'latents_std': None,
    'layers_per_block': 2,
    'mid_block_add_attention': True,
    'norm_num_groups': 32,
    'out_channels': 3,
    'sample_size': 1024,
    'scaling_factor': 0.3611,
    'shift_factor': 0.1159,
    'up_block_types': ['UpDecoderBlock2D'] * 4,
    'use_post_quant_conv': False,
    'use_quant_conv': False,
}
# FLUX's layout at toy width: 16 latent channels, no quant convs, FLUX's scaling and shift; one
# downsampling (2x), resnets with and without conv_shortcut, mid-block attention over 16 channels.
TINY = dict(
    block_out_channels=[8, 16],
    layers_per_block=1,
    norm_num_groups=4,
    latent_channels=16,
    down_block_types=['DownEncoderBlock2D'] * 2,
    up_block_types=['UpDecoderBlock2D'] * 2,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
# The other branches of AutoencoderKL: quant_conv / post_quant_conv, a mid block without attention.
VARIANT = {
    **TINY,
    'use_quant_conv': True,
    'use_post_quant_conv': True,
    'mid_block_add_attention': False,
}
RTOL = 1e-4
Z = 16


def _reference(config, seed):
  torch.manual_seed(0)
  model = AutoencoderKL(**config).eval()
  diffusers_models.randomize_vae(model, seed)
  return model


@pytest.fixture(scope='module')
def ref():
  return _reference(TINY, 1)


@pytest.fixture(scope='module')
def folder(ref, tmp_path_factory):
  """A pipeline-style folder: <root>/vae/{config.json, *.safetensors}."""
  root = tmp_path_factory.mktemp('flux_pipe')
  ref.save_pretrained(root / 'vae', safe_serialization=True)
  return root


@pytest.fixture(scope='module')
def ours(folder):
  return flux_vae.load_vae_folder(folder / 'vae')


_JITTED = {}


def _jit(model, method: str, **kwargs):
  """model.<method>(x, **kwargs) as one jitted function of the params, compiled once per model,
  method and options (XLA compile time dominates this file's runtime)."""
  key = (id(model), method, tuple(sorted(kwargs.items())))
  if key not in _JITTED:
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, x: getattr(nnx.merge(graphdef, st), method)(x, **kwargs))
    _JITTED[key] = (model, lambda x: np.asarray(fn(state, x)))  # model kept alive: id stays unique
  return _JITTED[key][1]


def _ref_decode(ref, latents_nhwc: np.ndarray) -> np.ndarray:
  """diffusers decode, back to channels-last (unclamped, as AutoencoderKL.decode returns it)."""
  z = torch.from_numpy(latents_nhwc).permute(0, 3, 1, 2)
  with torch.no_grad():
    out = ref.decode(z, return_dict=False)[0]
  return out.permute(0, 2, 3, 1).numpy()


def _ref_encode(ref, images_nhwc: np.ndarray) -> np.ndarray:
  x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2)
  with torch.no_grad():
    mode = ref.encode(x).latent_dist.mode()
  return mode.permute(0, 2, 3, 1).numpy()


def _rel(ours_out, ref_out) -> float:
  return float(np.max(np.abs(ours_out - ref_out)) / np.max(np.abs(ref_out)))


def _latents(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _images(shape, seed=1):
  return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


def _check_key_table(config: flux_vae.FluxVAEConfig, sd: dict) -> None:
  """Every diffusers key read exactly once; every table entry yields our param's shape."""
  table = flux_vae.vae_key_table(config)
  assert tensor_source.file_keys(table) == set(sd)
  assert len(table) == len(sd)
  _, abstract = flux_vae.abstract_vae(config, jnp.bfloat16)
  shapes = {'.'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(abstract)}
  assert set(shapes) == set(table)
  for name, source in table.items():
    assert source.our_shape(tuple(sd[source.keys[0]].shape)) == shapes[name].shape, name
    assert shapes[name].dtype == jnp.bfloat16


def test_config_and_key_table_match_diffusers(ref, folder):
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  cfg = flux_vae.config_from_diffusers(raw)
  assert (
      cfg.block_out_channels,
      cfg.layers_per_block,
      cfg.latent_channels,
      cfg.norm_num_groups,
  ) == ((8, 16), 1, 16, 4)
  assert (
      cfg.scaling_factor,
      cfg.shift_factor,
      cfg.use_quant_conv,
      cfg.use_post_quant_conv,
      cfg.mid_block_add_attention,
  ) == (0.3611, 0.1159, False, False, True)
  assert cfg.spatial_compression == 2
  flux = flux_vae.config_from_diffusers(FLUX_CONFIG)
  assert flux == flux_vae.FluxVAEConfig() and flux.spatial_compression == 8
  # A config.json without a key means diffusers' default, not FLUX's.
  default = AutoencoderKL().config
  got = flux_vae.config_from_diffusers({})
  for field in flux_vae.CONFIG_KEYS:
    want = default[field] if default[field] is not None else 0.0  # shift_factor None -> 0.0
    assert getattr(got, field) == (tuple(want) if isinstance(want, list) else want), field

  for bad, match in [
      ({'_class_name': 'AutoencoderKLQwenImage'}, 'AutoencoderKLQwenImage'),
      ({'norm_type': 'spatial'}, r"unknown VAE config keys \['norm_type'\]"),
      ({'act_fn': 'gelu'}, 'act_fn'),
      ({'latents_mean': [0.0] * 16}, 'latents_mean'),
      ({'down_block_types': ['DownEncoderBlock2D']}, 'down_block_types'),
      ({'up_block_types': ['UpDecoderBlock2D', 'AttnUpDecoderBlock2D']}, 'up_block_types'),
      ({'norm_num_groups': 3}, 'norm_num_groups=3'),
      ({'scaling_factor': 0.0}, 'scaling_factor'),
      ({'use_quant_conv': 1}, 'use_quant_conv'),
  ]:
    with pytest.raises(ValueError, match=match):
      flux_vae.config_from_diffusers({**raw, **bad})

  _check_key_table(cfg, ref.state_dict())
  # The other branches' keys, from freshly built diffusers models (no forward needed).
  for config in (
      VARIANT,
      {
          **TINY,
          'block_out_channels': [4, 8, 8],
          'layers_per_block': 2,
          'down_block_types': ['DownEncoderBlock2D'] * 3,
          'up_block_types': ['UpDecoderBlock2D'] * 3,
      },
  ):
    model = AutoencoderKL(**config)
    _check_key_table(flux_vae.config_from_diffusers(dict(model.config)), model.state_dict())


def test_decode_matches_diffusers_odd_grid(ref, ours):
  z = _latents((2, 5, 7, Z))  # odd latent grid
  got = _jit(ours, 'decode')(z)
  want = _ref_decode(ref, z)
  assert got.shape == want.shape == (2, 10, 14, 3)
  inside = np.mean(np.abs(want) < 1.0)
  assert inside > 0.9, f'only {inside:.2f} of the reference pixels are unclipped'
  err = _rel(got, np.clip(want, -1, 1))
  print(f'decode rel err {err:.2e}')
  assert err <= RTOL


def test_encode_matches_diffusers_odd_grid(ref, ours):
  x = _images((2, 10, 14, 3))
  got = _jit(ours, 'encode')(x)
  want = _ref_encode(ref, x)
  assert got.shape == want.shape == (2, 5, 7, Z)
  err = _rel(got, want)
  print(f'encode rel err {err:.2e}')
  assert err <= RTOL
  with pytest.raises(ValueError, match='multiples of 2'):
    ours.encode(jnp.zeros((1, 9, 14, 3)))


def test_packed_entry_points_match_flux_pipeline(ref, ours):
  h, w = 6, 8  # latent grid; FLUX packs 2x2 patches
  z = _latents((2, h, w, Z), seed=2)
  z_t = torch.from_numpy(z).permute(0, 3, 1, 2)
  tokens = FluxPipeline._pack_latents(z_t, 2, Z, h, w).numpy()
  assert tokens.shape == (2, 12, 64)
  np.testing.assert_array_equal(np.asarray(latents_lib.pack(jnp.asarray(z), 2)), tokens)
  r = ours.config.spatial_compression
  unpacked = FluxPipeline._unpack_latents(torch.from_numpy(tokens), h * r, w * r, r)
  np.testing.assert_array_equal(
      np.asarray(latents_lib.unpack(jnp.asarray(tokens), h, w, 2)),
      unpacked.permute(0, 2, 3, 1).numpy(),
  )

  # Decode as FluxPipeline.__call__ does after denoising (then its postprocess clamps).
  scaling, shift = ref.config.scaling_factor, ref.config.shift_factor
  with torch.no_grad():
    want = ref.decode(unpacked / scaling + shift, return_dict=False)[0]
  want = np.clip(want.permute(0, 2, 3, 1).numpy(), -1, 1)
  graphdef, state = nnx.split(ours)
  dec = jax.jit(lambda st, t: flux_vae.decode_packed(nnx.merge(graphdef, st), t, latent_hw=(h, w)))
  got = np.asarray(dec(state, tokens))
  err = _rel(got, want)
  print(f'decode_packed rel err {err:.2e}')
  assert got.shape == (2, 12, 16, 3) and err <= RTOL

  # Encode as FluxImg2ImgPipeline does (with the posterior's mean): (z - shift) * scaling, pack.
  x = _images((2, 12, 16, 3), seed=3)
  mode = torch.from_numpy(_ref_encode(ref, x)).permute(0, 3, 1, 2)
  want_tokens = FluxPipeline._pack_latents((mode - shift) * scaling, 2, Z, h, w).numpy()
  enc = jax.jit(lambda st, im: flux_vae.encode_packed(nnx.merge(graphdef, st), im))
  got_tokens = np.asarray(enc(state, x))
  err = _rel(got_tokens, want_tokens)
  print(f'encode_packed rel err {err:.2e}')
  assert got_tokens.shape == (2, 12, 64) and err <= RTOL

  zn = jnp.asarray(z)
  np.testing.assert_allclose(ours.denormalize(ours.normalize(zn)), zn, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match='latent_hw'):
    flux_vae.decode_packed(ours, jnp.asarray(tokens), latent_hw=(5, 8))


def test_quant_convs_and_attention_free_mid_block_match_diffusers(tmp_path):
  ref = _reference(VARIANT, 4)
  ref.save_pretrained(tmp_path / 'vae', safe_serialization=True)
  ours = flux_vae.load_vae_folder(tmp_path)
  assert ours.quant_conv is not None and not ours.decoder.mid_block.attentions
  z = _latents((1, 5, 7, Z), seed=5)
  want = _ref_decode(ref, z)
  assert np.mean(np.abs(want) < 1.0) > 0.9
  dec_err = _rel(_jit(ours, 'decode')(z), np.clip(want, -1, 1))
  x = _images((1, 10, 14, 3), seed=6)
  enc_err = _rel(_jit(ours, 'encode')(x), _ref_encode(ref, x))
  print(f'quant-conv variant: decode rel err {dec_err:.2e}, encode rel err {enc_err:.2e}')
  assert dec_err <= RTOL and enc_err <= RTOL


def test_tiled_and_sliced_decode(ref, ours):
  # AutoencoderKL tiles square latent tiles of L = tile_latent_min_size every int(0.75 L) and
  # blends int(0.25 S) pixels (S = tile_sample_min_size): S = 8 px, L = 4 latents is
  # TileConfig(8, 8, 6, 6). 5x7 latents: tiles start at rows {0, 3} and cols {0, 3, 6}, so edge
  # tiles of 2 rows and of 1 column, each blended with already-blended neighbours.
  tiled_ref = copy.deepcopy(ref)
  tiled_ref.enable_tiling()
  tiled_ref.tile_sample_min_size, tiled_ref.tile_latent_min_size = 8, 4
  tile = vae_lib.TileConfig(height=8, width=8, stride_height=6, stride_width=6)
  z = _latents((2, 5, 7, Z))
  want = np.clip(_ref_decode(tiled_ref, z), -1, 1)
  got = _jit(ours, 'decode', tile=tile)(z)
  err = _rel(got, want)
  print(f'tiled decode rel err {err:.2e}')
  assert err <= RTOL
  untiled = _jit(ours, 'decode')(z)  # the same call as the parity test (cached)
  assert np.max(np.abs(untiled - got)) > 1e-2  # tiling really happened
  with pytest.raises(ValueError, match='TileConfig.height'):
    ours.decode(jnp.asarray(z), tile=vae_lib.TileConfig(9, 8, 6, 6))

  # 3 images in chunks of 2: one lax.map step plus a remainder of one image.
  sliced = _jit(ours, 'decode', batch_chunk=2)(np.concatenate([z, z[:1]]))
  np.testing.assert_allclose(sliced, np.concatenate([untiled, untiled[:1]]), rtol=0, atol=1e-6)


def test_loader_errors_name_the_key(ref, folder, ours):
  cfg = ours.config
  sd = {k: v.numpy() for k, v in ref.state_dict().items()}
  fresh = lambda: nnx.eval_shape(lambda: flux_vae.FluxVAE(cfg, rngs=nnx.Rngs(0)))
  q = 'decoder.mid_block.attentions.0.to_q.weight'
  with pytest.raises(ValueError, match=f'missing diffusers keys \\(1\\): {q}'):
    flux_vae.LOADER.load_state(fresh(), {k: v for k, v in sd.items() if k != q})
  with pytest.raises(ValueError, match='unexpected diffusers keys \\(1\\): quant_conv.weight'):
    flux_vae.LOADER.load_state(fresh(), {**sd, 'quant_conv.weight': np.zeros((32, 32, 1, 1))})
  with pytest.raises(
      ValueError, match=f"{q}' has shape \\(16, 8\\).*" 'decoder.mid_block.attentions.0.to_q.kernel'
  ):
    flux_vae.LOADER.load_state(fresh(), {**sd, q: sd[q][:, :8]})
  up = 'decoder.up_blocks.0.upsamplers.0.conv.weight'
  with pytest.raises(ValueError, match=f"{up}' has shape \\(16, 16, 3\\).*rank 3"):
    flux_vae.LOADER.load_state(fresh(), {**sd, up: sd[up][..., 0]})
  loaded = flux_vae.LOADER.load_state(fresh(), sd)
  a = nnx.to_flat_state(nnx.state(loaded, nnx.Param))
  b = nnx.to_flat_state(nnx.state(ours, nnx.Param))
  for (pa, va), (pb, vb) in zip(a, b):  # the in-memory and streamed loaders agree
    assert pa == pb
    np.testing.assert_array_equal(va.get_value(), vb.get_value())

  # Folders: bad ones are named, and so is a missing or mis-shaped key in their weights.
  bad = folder.parent / 'bad_flux'
  (bad / 'vae').mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='no config.json'):
    flux_vae.load_vae_folder(bad)
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  (bad / 'vae' / 'config.json').write_text(json.dumps({**raw, 'norm_type': 'spatial'}))
  with pytest.raises(ValueError, match=r"config.json: unknown VAE config keys \['norm_type'\]"):
    flux_vae.load_vae_folder(bad)
  (bad / 'vae' / 'config.json').write_text(json.dumps(raw))
  with pytest.raises(ValueError, match='no \\*.safetensors'):
    flux_vae.load_vae_folder(bad)
  weights = bad / 'vae' / 'w.safetensors'
  save_file({k: v for k, v in sd.items() if k != up}, str(weights))
  with pytest.raises(ValueError, match=f'missing diffusers keys \\(1\\): {up}'):
    flux_vae.load_vae_folder(bad)
  save_file({**sd, up: sd[up][:8]}, str(weights))
  with pytest.raises(
      ValueError,
      match=f"diffusers key '{up}' has shape \\(8, 16, 3, 3\\).*"
      'decoder.up_blocks.0.upsamplers.0.conv.kernel',
  ):
    flux_vae.load_vae_folder(bad)


def test_bf16_params_decode_close_to_float32(folder, ours):
  model = flux_vae.load_vae_folder(folder, param_dtype=jnp.bfloat16)
  assert model.dtype == jnp.bfloat16
  z = _latents((2, 5, 7, Z), seed=7)
  got = _jit(model, 'decode')(z)
  want = _jit(ours, 'decode')(z)
  assert got.dtype == np.float32
  err = float(np.max(np.abs(got - want)))
  print(f'bf16 decode max abs err {err:.3f} (float32 output range {np.abs(want).max():.2f})')
  assert err < 0.1
