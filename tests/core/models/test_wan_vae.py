"""Wan2.1 VAE (digen_jax.models.vae.wan_vae over causal_vae.py, the network Qwen-Image's VAE shares)
against diffusers' AutoencoderKLWan on a tiny random model saved with save_pretrained: video decode
and encode over several frame chunks, the packed entry points as WanPipeline uses them, batch
chunks and tiles, one frame as the Qwen-Image VAE, the config and the key table."""

import copy
import json

from diffusers import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # noqa: F401  (the pipeline's module)
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from digen_jax.models import latents as latents_lib
from digen_jax.models.io import tensor_source
from digen_jax.models.vae import qwen_vae as vae
from digen_jax.models.vae import wan_vae
from tests.helpers import diffusers_models

# Wan2.1's layout at toy width: three spatial downsamplings (8x), two of them temporal (4x), so
# both resample modes of both kinds run; resnets with and without conv_shortcut.
TINY = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.31, -0.52, 0.13, -0.07],
    latents_std=[1.7, 0.6, 2.3, 1.1],
)
RTOL = 1e-4
FRAMES = 3  # latent frames: the first chunk and two scanned ones -> 9 video frames
GRID = (5, 7)  # odd latent grid: 40 x 56 pixels


@pytest.fixture(scope='module')
def ref():
  torch.manual_seed(0)
  model = AutoencoderKLWan(**TINY).eval()
  diffusers_models.randomize_vae(model, 1)
  return model


@pytest.fixture(scope='module')
def folder(ref, tmp_path_factory):
  root = tmp_path_factory.mktemp('wan_pipe')
  ref.save_pretrained(root / 'vae', safe_serialization=True)
  return root


@pytest.fixture(scope='module')
def ours(folder):
  return wan_vae.load_vae_folder(folder)


_JITTED = {}


def _jit(model, fn, **kwargs):
  """fn(model, x, **kwargs) jitted as a function of the params, compiled once per model, fn and
  options."""
  key = (id(model), fn, tuple(sorted(kwargs.items())))
  if key not in _JITTED:
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda st, x: fn(nnx.merge(graphdef, st), x, **kwargs))
    _JITTED[key] = (model, lambda x: np.asarray(jitted(state, x)))
  return _JITTED[key][1]


def _decode(model, z, **kw):
  return model.decode_video(z, **kw)


def _encode(model, x, **kw):
  return model.encode_video(x, **kw)


def _to_torch(x):  # [B, T, H, W, C] -> [B, C, T, H, W]
  return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 4, 1, 2, 3)


def _from_torch(x):
  return x.permute(0, 2, 3, 4, 1).numpy()


def _ref_decode(ref, z):
  with torch.no_grad():
    return _from_torch(ref.decode(_to_torch(z), return_dict=False)[0])


def _ref_encode(ref, x):
  with torch.no_grad():
    return _from_torch(ref.encode(_to_torch(x)).latent_dist.mode())


def _rel(a, b) -> float:
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _latents(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_decode_matches_diffusers_over_frame_chunks(ref, ours):
  z = _latents((2, FRAMES, *GRID, 4))
  got = _jit(ours, _decode)(z)
  want = _ref_decode(ref, z)
  assert got.shape == want.shape == (2, 1 + 4 * (FRAMES - 1), 40, 56, 3)
  assert np.mean(np.abs(want) < 1.0) > 0.9  # the clamp hides little
  err = _rel(got, want)
  print(f'Wan VAE decode rel err {err:.2e}')
  assert err <= RTOL
  # Causality: the frames of the first latent frame do not see the later ones, the rest do.
  z2 = z.copy()
  z2[:, -1] += 1.0
  moved = _jit(ours, _decode)(z2)
  np.testing.assert_array_equal(moved[:, :5], got[:, :5])
  assert np.abs(moved[:, 5:] - got[:, 5:]).max() > 1e-3


def test_encode_matches_diffusers_over_frame_chunks(ref, ours):
  x = np.random.default_rng(1).uniform(-1, 1, (2, 9, 40, 56, 3)).astype(np.float32)
  got = _jit(ours, _encode)(x)
  want = _ref_encode(ref, x)
  assert got.shape == want.shape == (2, 3, *GRID, 4)
  err = _rel(got, want)
  print(f'Wan VAE encode rel err {err:.2e}')
  assert err <= RTOL
  with pytest.raises(ValueError, match=r'1 \+ 4k'):
    ours.encode_video(jnp.zeros((1, 6, 40, 56, 3)))


def test_packed_entry_points_match_wan_pipeline(ref, ours):
  cfg, (h, w) = ours.config, (6, 8)
  z = _latents((2, FRAMES, h, w, 4), seed=2)
  tokens = latents_lib.pack_frames(jnp.asarray(z), 2)
  np.testing.assert_array_equal(latents_lib.unpack_frames(tokens, FRAMES, h, w, 2), z)
  # WanPipeline.__call__ after denoising: latents / (1 / std) + mean, then decode.
  mean = torch.tensor(ref.config.latents_mean).view(1, 4, 1, 1, 1)
  inv_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, 4, 1, 1, 1)
  with torch.no_grad():
    want = _from_torch(ref.decode(_to_torch(z) / inv_std + mean, return_dict=False)[0])
  dec = lambda m, t: wan_vae.decode_packed(m, t, latent_shape=(FRAMES, h, w))
  got = _jit(ours, dec)(tokens)
  err = _rel(got, want)
  print(f'Wan VAE decode_packed rel err {err:.2e}')
  assert got.shape == (2, 9, 48, 64, 3) and err <= RTOL
  # Encode as WanPipeline's video-to-video path normalises: (mode - mean) / std, then pack.
  x = np.random.default_rng(3).uniform(-1, 1, (2, 5, 48, 64, 3)).astype(np.float32)
  mode = _to_torch(_ref_encode(ref, x))
  norm = (mode - mean) * inv_std
  want_tokens = latents_lib.pack_frames(jnp.asarray(_from_torch(norm)), 2)
  got_tokens = _jit(ours, wan_vae.encode_packed)(x)
  err = _rel(got_tokens, np.asarray(want_tokens))
  print(f'Wan VAE encode_packed rel err {err:.2e}')
  assert got_tokens.shape == (2, 2 * 3 * 4, 16) and err <= RTOL
  zn = jnp.asarray(z)
  np.testing.assert_allclose(ours.denormalize(ours.normalize(zn)), zn, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match='latent_shape'):
    wan_vae.decode_packed(ours, tokens, latent_shape=(FRAMES, 5, 8))
  assert cfg.temporal_compression == 4 and cfg.spatial_compression == 8


def test_batch_chunks_and_tiles(ref, ours):
  z = _latents((2, FRAMES, *GRID, 4))
  full = _jit(ours, _decode)(z)  # the parity test's program (cached)
  # One video at a time: another batch size, so another conv program, equal to float rounding.
  chunked = _jit(ours, _decode, batch_chunk=1)(z)
  np.testing.assert_allclose(chunked, full, rtol=0, atol=1e-5)
  # Tiles of 32 px rows every 24 px, the full width: two tile shapes (4 and 2 latent rows), each
  # decoding all its frames, blended per frame as diffusers does (both blend directions and the
  # tile grid are vae_blocks.tiled_decode's, checked in both ways by tests/core/models/test_vae.py).
  tile = wan_vae.TileConfig(height=32, width=56, stride_height=24, stride_width=56)
  tiled_ref = copy.deepcopy(ref)
  tiled_ref.enable_tiling(32, 56, 24, 56)
  want = _ref_decode(tiled_ref, z)
  got = _jit(ours, _decode, tile=tile)(z)
  err = _rel(got, want)
  print(f'Wan VAE tiled decode rel err {err:.2e}')
  assert err <= RTOL and np.max(np.abs(got - full)) > 1e-2  # tiling really happened


def test_one_frame_is_the_qwen_image_vae(folder, ref, ours):
  """The same weights read as AutoencoderKLQwenImage (Qwen-Image's VAE is this network) decode
  and encode one frame as the video path's first frame."""
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  qwen_cfg = vae.VAEConfig(**{k: raw[k] for k in TINY})
  assert wan_vae.config_from_diffusers(raw) == qwen_cfg
  assert type(ours) is vae.QwenImageVAE
  z = _latents((2, 1, *GRID, 4), seed=4)
  image = np.asarray(jax.jit(lambda t: ours.decode(t))(z[:, 0]))
  np.testing.assert_allclose(image, _jit(ours, _decode)(z)[:, 0], rtol=0, atol=1e-6)
  assert _rel(image, _ref_decode(ref, z)[:, 0]) <= RTOL


def test_config_and_key_table(ref, folder, ours):
  raw = json.loads((folder / 'vae' / 'config.json').read_text())
  assert wan_vae.config_from_diffusers({}) == vae.VAEConfig()  # diffusers' defaults are ours
  assert vae.VAEConfig().latents_std == tuple(AutoencoderKLWan().config.latents_std)
  for bad, match in (
      ({'is_residual': True}, 'Wan2.2'),
      ({'patch_size': 2}, 'Wan2.2'),
      ({'decoder_base_dim': 16}, 'decoder_base_dim'),
      ({'out_channels': 12}, 'out_channels'),
      ({'scale_factor_temporal': 8}, 'scale_factor_temporal'),
      ({'some_new_flag': 1}, r"unknown VAE config keys \['some_new_flag'\]"),
      ({'_class_name': 'AutoencoderKLQwenImage'}, 'AutoencoderKLWan'),
  ):
    with pytest.raises(ValueError, match=match):
      wan_vae.config_from_diffusers({**raw, **bad})
  table = wan_vae.vae_key_table(ours.config)
  sd = ref.state_dict()
  assert tensor_source.file_keys(table) == set(sd) and len(table) == len(sd)
  _, abstract = wan_vae.abstract_vae(ours.config, jnp.bfloat16)
  shapes = {'.'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(abstract)}
  for name, source in table.items():
    assert source.our_shape(tuple(sd[source.keys[0]].shape)) == shapes[name].shape, name
