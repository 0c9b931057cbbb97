"""digen_jax.models.io.convert: diffusers folders (single file, sharded, pipeline layout, bf16) and clear errors."""

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.models.io.convert import load_diffusers_folder, load_diffusers_state
from digen_jax.models.transformers.mmdit import MMDiT, MMDiTConfig
from tests.helpers import diffusers_models

import torch  # noqa: E402  (a missing test dependency must fail, not skip)
import diffusers  # noqa: E402,F401

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
IMG_SHAPE = (1, 2, 3)
B, L = 2, 5


@pytest.fixture(scope="module")
def tmodel():
  """Tiny diffusers model, every tensor randomised (norm scales and biases included)."""
  return diffusers_models.randomized_transformer(**TINY)


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  latents = rng.standard_normal((B, int(np.prod(IMG_SHAPE)), TINY["in_channels"]), dtype=np.float32)
  sigma = np.array([0.2, 0.7], np.float32)
  text = rng.standard_normal((B, L, TINY["joint_attention_dim"]), dtype=np.float32)
  mask = np.ones((B, L), np.int64)
  mask[0, 3:] = 0
  return latents, sigma, text, mask


def assert_parity(model, tmodel, inputs, tol=1e-4):
  latents, sigma, text, mask = inputs
  with torch.no_grad():
    ref = (
        tmodel(
            hidden_states=torch.from_numpy(latents),
            timestep=torch.from_numpy(sigma),
            encoder_hidden_states_mask=torch.from_numpy(mask),
            encoder_hidden_states=torch.from_numpy(text),
            img_shapes=[[IMG_SHAPE]] * B,
            return_dict=False,
        )[0]
        .float()
        .numpy()
    )
  out = np.asarray(model(*(jnp.asarray(x) for x in inputs), img_shape=IMG_SHAPE))
  assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= tol


def test_load_single_file(tmodel, inputs, tmp_path):
  tmodel.save_pretrained(tmp_path)
  assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
  model = load_diffusers_folder(tmp_path)
  assert model.config == MMDiTConfig(**TINY)
  assert model.img_in.kernel.dtype == jnp.float32
  assert_parity(model, tmodel, inputs)


def test_load_sharded_pipeline_folder(tmodel, inputs, tmp_path):
  # Pipeline layout: the transformer lives in transformer/, next to other components.
  tmodel.save_pretrained(tmp_path / "transformer", max_shard_size="100KB")
  (tmp_path / "model_index.json").write_text("{}")
  shards = sorted((tmp_path / "transformer").glob("*.safetensors"))
  assert len(shards) > 1 and list((tmp_path / "transformer").glob("*.safetensors.index.json"))
  assert_parity(load_diffusers_folder(tmp_path), tmodel, inputs)


def test_load_bf16_checkpoint(tmodel, tmp_path):
  # Real QwenImage checkpoints are bf16; numpy reads them through ml_dtypes.
  copy.deepcopy(tmodel).to(torch.bfloat16).save_pretrained(tmp_path)
  model = load_diffusers_folder(tmp_path, param_dtype=jnp.bfloat16)
  assert model.proj_out.kernel.dtype == jnp.bfloat16
  want = tmodel.transformer_blocks[1].attn.to_q.weight.detach().to(torch.bfloat16).float().numpy().T
  np.testing.assert_array_equal(np.asarray(model.blocks.attn.to_q.kernel[1], np.float32), want)


def test_missing_folder_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="diffusers folder not found: .*nope"):
    load_diffusers_folder(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="no config.json in"):
    load_diffusers_folder(tmp_path)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="cannot read .*config.json"):
    load_diffusers_folder(tmp_path)


def test_no_safetensors_or_corrupt_file(tmodel, tmp_path):
  tmodel.save_pretrained(
      tmp_path, safe_serialization=False
  )  # pickle .bin only: must be refused, not read
  with pytest.raises(ValueError, match="no \\*.safetensors weights in"):
    load_diffusers_folder(tmp_path)
  (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
  with pytest.raises(
      ValueError, match="cannot read safetensors file .*diffusion_pytorch_model.safetensors"
  ):
    load_diffusers_folder(tmp_path)


def _edit_config(folder, **changes):
  cfg = json.loads((folder / "config.json").read_text())
  cfg.update(changes)
  (folder / "config.json").write_text(json.dumps(cfg))


def test_shape_and_key_mismatches(tmodel, tmp_path):
  tmodel.save_pretrained(tmp_path)
  _edit_config(tmp_path, joint_attention_dim=40)
  with pytest.raises(
      ValueError, match=r"diffusers key '(txt_norm|txt_in)\.weight' has shape \(.*48.*\), expected"
  ):
    load_diffusers_folder(tmp_path)
  _edit_config(tmp_path, joint_attention_dim=48, num_layers=3)
  with pytest.raises(ValueError, match="missing diffusers keys .*transformer_blocks.2.attn"):
    load_diffusers_folder(tmp_path)
  _edit_config(tmp_path, num_layers=1)
  with pytest.raises(ValueError, match="unexpected diffusers keys .*transformer_blocks.1.attn"):
    load_diffusers_folder(tmp_path)


def test_load_state_dict_in_place(tmodel, inputs):
  import flax.nnx as nnx

  sd = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
  model = MMDiT(MMDiTConfig(**TINY), rngs=nnx.Rngs(1))
  assert load_diffusers_state(model, sd) is model
  assert_parity(model, tmodel, inputs)
  sd.pop("transformer_blocks.0.attn.norm_added_k.weight")
  sd["extra.weight"] = np.zeros(3, np.float32)
  with pytest.raises(
      ValueError, match="missing diffusers keys .*norm_added_k.*unexpected diffusers keys .*extra"
  ):
    load_diffusers_state(model, sd)
