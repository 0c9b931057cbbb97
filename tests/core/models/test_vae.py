"""Qwen-Image VAE (digen_jax.models.vae.qwen_vae) against diffusers' AutoencoderKLQwenImage on a tiny random
model saved with save_pretrained: decode, encode, packed entry points, sliced and tiled decode,
the loader's key table and error messages, bf16 params."""

import copy
import json

from diffusers import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
import torch

from digen_jax.models import latents as latents_lib
from digen_jax.models.io import tensor_source
from digen_jax.models.vae import qwen_vae as vae
from digen_jax.models.vae import vae_blocks
from tests.helpers import diffusers_models

# Three downsamplings (8x, as Qwen-Image), both 2-D and 3-D resample modes, resnets with and
# without conv_shortcut, mid-block attention over 32 channels.
TINY = dict(
    base_dim=16,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.31, -0.52, 0.13, -0.07],
    latents_std=[1.7, 0.6, 2.3, 1.1],
)
RTOL = 1e-4


@pytest.fixture(scope='module')
def ref():
  torch.manual_seed(0)
  model = AutoencoderKLQwenImage(**TINY).eval()
  diffusers_models.randomize_vae(model, 1)
  return model


@pytest.fixture(scope='module')
def folder(ref, tmp_path_factory):
  """A pipeline-style folder: <root>/vae/{config.json, *.safetensors}."""
  root = tmp_path_factory.mktemp('pipe')
  ref.save_pretrained(root / 'vae', safe_serialization=True)
  return root


@pytest.fixture(scope='module')
def ours(folder):
  return vae.load_vae_folder(folder / 'vae')


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
  """diffusers decode of one frame, back to channels-last."""
  z = torch.from_numpy(latents_nhwc).permute(0, 3, 1, 2)[:, :, None]
  with torch.no_grad():
    out = ref.decode(z, return_dict=False)[0][:, :, 0]
  return out.permute(0, 2, 3, 1).numpy()


def _ref_encode(ref, images_nhwc: np.ndarray) -> np.ndarray:
  x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2)[:, :, None]
  with torch.no_grad():
    mode = ref.encode(x).latent_dist.mode()[:, :, 0]
  return mode.permute(0, 2, 3, 1).numpy()


def _rel(ours_out, ref_out) -> float:
  return float(np.max(np.abs(ours_out - ref_out)) / np.max(np.abs(ref_out)))


def _latents(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_config_and_key_table_match_diffusers(ref, folder):
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  cfg = vae.config_from_diffusers(raw)
  assert (cfg.base_dim, cfg.z_dim, cfg.dim_mult, cfg.temperal_downsample) == (
      16,
      4,
      (1, 2, 2, 2),
      (False, True, True),
  )
  assert cfg.latents_std == tuple(TINY['latents_std']) and cfg.spatial_compression == 8
  assert vae.config_from_diffusers({}) == vae.VAEConfig()  # diffusers' defaults are ours
  assert vae.VAEConfig().latents_mean == tuple(AutoencoderKLQwenImage().config.latents_mean)
  with pytest.raises(ValueError, match=r"unknown VAE config keys \['is_residual'\]"):
    vae.config_from_diffusers({**raw, 'is_residual': True})
  with pytest.raises(ValueError, match='AutoencoderKLWan'):
    vae.config_from_diffusers({**raw, '_class_name': 'AutoencoderKLWan'})
  with pytest.raises(ValueError, match='attn_scales'):
    vae.config_from_diffusers({**raw, 'attn_scales': [1.0]})
  with pytest.raises(ValueError, match='latents_std'):
    vae.config_from_diffusers({**raw, 'latents_std': [1.0]})

  # Every diffusers key read exactly once; every table entry yields our param's shape.
  table = vae.vae_key_table(cfg)
  sd = ref.state_dict()
  assert tensor_source.file_keys(table) == set(sd)
  assert len(table) == len(sd)
  _, abstract = vae.abstract_vae(cfg, jnp.bfloat16)
  shapes = {'.'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(abstract)}
  assert set(shapes) == set(table)
  for name, source in table.items():
    assert source.our_shape(tuple(sd[source.keys[0]].shape)) == shapes[name].shape, name
    assert shapes[name].dtype == jnp.bfloat16


def test_decode_matches_diffusers_odd_grid(ref, ours):
  z = _latents((2, 5, 7, 4))  # odd latent grid
  got = _jit(ours, 'decode')(z)
  want = _ref_decode(ref, z)
  assert got.shape == want.shape == (2, 40, 56, 3)
  inside = np.mean(np.abs(want) < 1.0)
  assert inside > 0.9, f'only {inside:.2f} of the reference pixels are unclipped'
  err = _rel(got, want)
  print(f'decode rel err {err:.2e}')
  assert err <= RTOL


def test_encode_matches_diffusers_odd_grid(ref, ours):
  x = np.random.default_rng(1).uniform(-1, 1, (2, 40, 56, 3)).astype(np.float32)
  got = _jit(ours, 'encode')(x)
  want = _ref_encode(ref, x)
  assert got.shape == want.shape == (2, 5, 7, 4)
  err = _rel(got, want)
  print(f'encode rel err {err:.2e}')
  assert err <= RTOL
  with pytest.raises(ValueError, match='multiples of 8'):
    ours.encode(jnp.zeros((1, 36, 56, 3)))


def test_packing_and_packed_entry_points_match_pipeline(ref, ours):
  cfg = ours.config
  h, w = 6, 8
  z = _latents((2, h, w, 4), seed=2)
  z_t = torch.from_numpy(z).permute(0, 3, 1, 2)
  tokens = QwenImagePipeline._pack_latents(z_t, 2, 4, h, w).numpy()
  np.testing.assert_array_equal(np.asarray(latents_lib.pack(jnp.asarray(z), 2)), tokens)
  unpacked = QwenImagePipeline._unpack_latents(torch.from_numpy(tokens), h * 8, w * 8, 8)
  np.testing.assert_array_equal(
      np.asarray(latents_lib.unpack(jnp.asarray(tokens), h, w, 2)),
      unpacked[:, :, 0].permute(0, 2, 3, 1).numpy(),
  )

  # Decode as QwenImagePipeline.__call__ does after denoising.
  latents_mean = torch.tensor(ref.config.latents_mean).view(1, ref.config.z_dim, 1, 1, 1)
  latents_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, ref.config.z_dim, 1, 1, 1)
  with torch.no_grad():
    want = ref.decode(unpacked / latents_std + latents_mean, return_dict=False)[0][:, :, 0]
  want = want.permute(0, 2, 3, 1).numpy()
  graphdef, state = nnx.split(ours)
  dec = jax.jit(lambda st, t: vae.decode_packed(nnx.merge(graphdef, st), t, latent_hw=(h, w)))
  got = np.asarray(dec(state, tokens))
  err = _rel(got, want)
  print(f'decode_packed rel err {err:.2e}')
  assert got.shape == (2, 48, 64, 3) and err <= RTOL

  # Encode as the img2img / edit pipelines do: (mode - mean) / std, then pack.
  x = np.random.default_rng(3).uniform(-1, 1, (2, 48, 64, 3)).astype(np.float32)
  mode = torch.from_numpy(_ref_encode(ref, x)).permute(0, 3, 1, 2)[:, :, None]
  norm = (mode - latents_mean) / torch.tensor(ref.config.latents_std).view(1, 4, 1, 1, 1)
  want_tokens = QwenImagePipeline._pack_latents(norm[:, :, 0], 2, 4, h, w).numpy()
  enc = jax.jit(lambda st, im: vae.encode_packed(nnx.merge(graphdef, st), im))
  got_tokens = np.asarray(enc(state, x))
  err = _rel(got_tokens, want_tokens)
  print(f'encode_packed rel err {err:.2e}')
  assert got_tokens.shape == (2, 12, 16) and err <= RTOL

  zn = jnp.asarray(z)
  np.testing.assert_allclose(
      vae.denormalize_latents(vae.normalize_latents(zn, cfg), cfg), zn, rtol=1e-6, atol=1e-6
  )
  with pytest.raises(ValueError, match='latent_hw'):
    vae.decode_packed(ours, jnp.asarray(tokens), latent_hw=(5, 8))


def test_sliced_decode_equals_unsliced(ours):
  z = _latents((2, 5, 7, 4))
  full = _jit(ours, 'decode')(z)  # the same call as the parity test (cached)
  # 3 images in chunks of 2: one lax.map step plus a remainder of one image.
  sliced = _jit(ours, 'decode', batch_chunk=2)(np.concatenate([z, z[:1]]))
  np.testing.assert_allclose(sliced, np.concatenate([full, full[:1]]), rtol=0, atol=1e-6)


def test_tiled_decode_matches_diffusers_tiled(ref, ours):
  # 5x7 latents = 40x56 pixels; tiles 32x48 px every 24x32 px: latent tiles start at rows {0, 3}
  # and cols {0, 4}, so four tile shapes (4 or 2 rows x 6 or 3 cols), overlaps of 8 px (rows)
  # and 16 px (cols), and a corner tile whose neighbours were blended first (diffusers blends
  # in place).
  tile = vae.TileConfig(height=32, width=48, stride_height=24, stride_width=32)
  z = _latents((2, 5, 7, 4))
  tiled_ref = copy.deepcopy(ref)
  tiled_ref.enable_tiling(
      tile_sample_min_height=32,
      tile_sample_min_width=48,
      tile_sample_stride_height=24,
      tile_sample_stride_width=32,
  )
  # diffusers' tiled path does not clamp; our decode always clips to [-1, 1].
  want = np.clip(_ref_decode(tiled_ref, z), -1, 1)
  got = _jit(ours, 'decode', tile=tile)(z)
  err = _rel(got, want)
  print(f'tiled decode rel err {err:.2e}')
  assert err <= RTOL
  untiled = _jit(ours, 'decode')(z)
  assert np.max(np.abs(untiled - got)) > 1e-2  # tiling really happened
  with pytest.raises(ValueError, match='TileConfig.stride_width'):
    ours.decode(jnp.asarray(z), tile=vae.TileConfig(32, 40, 24, 12))


@pytest.mark.parametrize('a_len,b_len,extent', [(16, 16, 8), (16, 5, 8), (3, 16, 8), (9, 7, 0)])
def test_blends_match_diffusers(ref, a_len, b_len, extent):
  """Overlap blending, including extents clipped by a short edge tile, against diffusers'."""
  rng = np.random.default_rng(a_len * 100 + b_len)
  a = rng.normal(size=(2, a_len, 6, 3)).astype(np.float32)
  b = rng.normal(size=(2, b_len, 6, 3)).astype(np.float32)
  to_t = lambda x: torch.from_numpy(x).permute(0, 3, 1, 2)[:, :, None].clone()
  from_t = lambda x: x[:, :, 0].permute(0, 2, 3, 1).numpy()
  want_v = from_t(ref.blend_v(to_t(a), to_t(b), extent))
  np.testing.assert_allclose(
      vae_blocks.blend_v(jnp.asarray(a), jnp.asarray(b), extent), want_v, rtol=1e-6, atol=1e-6
  )
  at, bt = a.transpose(0, 2, 1, 3).copy(), b.transpose(0, 2, 1, 3).copy()  # along width
  want_h = from_t(ref.blend_h(to_t(at), to_t(bt), extent))
  np.testing.assert_allclose(
      vae_blocks.blend_h(jnp.asarray(at), jnp.asarray(bt), extent), want_h, rtol=1e-6, atol=1e-6
  )


def test_attention_query_chunks_equal_whole():
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 37, 8)), jnp.float32) for _ in range(3))
  np.testing.assert_allclose(
      vae_blocks.spatial_attention(q, k, v, query_chunk=16),
      vae_blocks.spatial_attention(q, k, v),
      rtol=1e-6,
      atol=1e-6,
  )


def test_loader_errors_name_the_key(ref, folder, ours):
  cfg = ours.config
  sd = {k: v.numpy() for k, v in ref.state_dict().items()}
  fresh = lambda: nnx.eval_shape(lambda: vae.QwenImageVAE(cfg, rngs=nnx.Rngs(0)))
  gamma = 'decoder.mid_block.attentions.0.norm.gamma'
  with pytest.raises(ValueError, match=f'missing diffusers keys \\(1\\): {gamma}'):
    vae.LOADER.load_state(fresh(), {k: v for k, v in sd.items() if k != gamma})
  with pytest.raises(ValueError, match='unexpected diffusers keys \\(1\\): encoder.extra.weight'):
    vae.LOADER.load_state(fresh(), {**sd, 'encoder.extra.weight': np.zeros(3, np.float32)})
  conv = 'decoder.up_blocks.1.upsamplers.0.resample.1.weight'
  with pytest.raises(
      ValueError,
      match=f"{conv}' has shape \\(16, 16, 3, 3\\).*"
      'decoder.up_blocks.1.upsamplers.0.resample.kernel',
  ):
    vae.LOADER.load_state(fresh(), {**sd, conv: sd[conv][:, :16]})
  with pytest.raises(ValueError, match=f"{conv}' has shape \\(16, 32, 3\\).*rank 3"):
    vae.LOADER.load_state(fresh(), {**sd, conv: sd[conv][..., 0]})
  with pytest.raises(ValueError, match=f"{gamma}' has shape \\(16, 1, 1\\).*cannot be held"):
    vae.LOADER.load_state(fresh(), {**sd, gamma: sd[gamma][:16]})
  ok = vae.LOADER.load_state(fresh(), {**sd, gamma: sd[gamma][:, 0, 0]})  # size-1 axes may differ
  np.testing.assert_array_equal(
      ok.decoder.mid_block.attentions[0].norm.gamma[...], sd[gamma][:, 0, 0]
  )

  # Folders: a model folder and a pipeline folder load the same params; bad folders are named.
  a = nnx.to_flat_state(nnx.state(vae.load_vae_folder(folder), nnx.Param))
  b = nnx.to_flat_state(nnx.state(ours, nnx.Param))
  for (pa, va), (pb, vb) in zip(a, b):
    assert pa == pb
    np.testing.assert_array_equal(va.get_value(), vb.get_value())
  bad = folder.parent / 'bad'
  (bad / 'vae').mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='no config.json'):
    vae.load_vae_folder(bad)
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  (bad / 'vae' / 'config.json').write_text(json.dumps({**raw, 'scaling_factor': 0.5}))
  with pytest.raises(ValueError, match=r"json: unknown VAE config keys \['scaling_factor'\]"):
    vae.load_vae_folder(bad)
  (bad / 'vae' / 'config.json').write_text(json.dumps(raw))
  with pytest.raises(ValueError, match='no \\*.safetensors'):
    vae.load_vae_folder(bad)
  save_file({k: v for k, v in sd.items() if k != conv}, str(bad / 'vae' / 'w.safetensors'))
  with pytest.raises(ValueError, match=f'missing diffusers keys \\(1\\): {conv}'):
    vae.load_vae_folder(bad)


def test_bf16_params_decode_close_to_float32(folder, ours):
  model = vae.load_vae_folder(folder, param_dtype=jnp.bfloat16)
  assert model.dtype == jnp.bfloat16
  z = _latents((2, 5, 7, 4), seed=7)
  got = _jit(model, 'decode')(z)
  want = _jit(ours, 'decode')(z)
  assert got.dtype == np.float32
  err = float(np.max(np.abs(got - want)))
  print(f'bf16 decode max abs err {err:.3f} (float32 output range {np.abs(want).max():.2f})')
  assert err < 0.1
