"""Latent packing equals diffusers' QwenImage _pack_latents; FSDP shardings are what we expect."""

import jax
import numpy as np

from digen_jax.models import latents
from digen_jax.parallel import mesh as mesh_lib


def test_pack_matches_diffusers_and_roundtrips():
  import torch

  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 4, 6, 8)).astype(np.float32)  # B, C, H, W (torch layout)
  # diffusers' QwenImagePipeline._pack_latents (importing the pipeline needs `transformers`):
  t = torch.from_numpy(x).view(2, 4, 3, 2, 4, 2).permute(0, 2, 4, 1, 3, 5)
  ref = t.reshape(2, 3 * 4, 4 * 4).numpy()
  ours = np.asarray(latents.pack(x.transpose(0, 2, 3, 1), 2))  # ours takes B, H, W, C
  np.testing.assert_array_equal(ours, ref)
  back = np.asarray(latents.unpack(ours, 6, 8, 2))
  np.testing.assert_array_equal(back, x.transpose(0, 2, 3, 1))


def test_fsdp_spec_shards_largest_divisible_dim():
  assert mesh_lib.fsdp_spec((3, 8), 4, 'data') == jax.sharding.PartitionSpec(None, 'data')
  assert mesh_lib.fsdp_spec((12, 8), 4, 'data') == jax.sharding.PartitionSpec('data', None)
  assert mesh_lib.fsdp_spec((3, 5), 4, 'data') == jax.sharding.PartitionSpec()
  assert mesh_lib.fsdp_spec((), 4, 'data') == jax.sharding.PartitionSpec()
  mesh = mesh_lib.make_mesh(jax.devices()[:4])
  tree = {'w': np.zeros((16, 4), np.float32), 'b': np.zeros((3,), np.float32)}
  placed = jax.device_put(tree, mesh_lib.fsdp_shardings(tree, mesh))
  assert placed['w'].addressable_shards[0].data.shape == (4, 4)
  assert placed['b'].addressable_shards[0].data.shape == (3,)
