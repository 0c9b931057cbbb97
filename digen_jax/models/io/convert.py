"""Load diffusers ``QwenImageTransformer2DModel`` checkpoints into ``digen_jax.models.transformers.mmdit.MMDiT``.

Only safetensors files are read (never pickle / torch.load). Every diffusers tensor must map to
exactly one of our params and every one of our params must be set, else a ValueError lists what is
missing or unexpected. The load path itself is models/io/loading.py's (shared with FLUX and the
VAEs); this module holds QwenImage's config keys and key table.

    model = load_diffusers_folder("/ckpt/Qwen-Image")     # pipeline folder (transformer/) or model
    cfg, graphdef, state = load_diffusers_sharded(
        "/ckpt/Qwen-Image", lambda s: mesh_lib.fsdp_shardings(s, mesh))
    cfg = config_from_diffusers(json.load(open("config.json")))
    load_diffusers_state(model, {key: np.ndarray})         # in place
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors hands out BF16)

from digen_jax.models.io import loading
from digen_jax.models.transformers.layers import embedder_linears, feed_forward_linears
from digen_jax.models.transformers.mmdit import MMDiT, MMDiTConfig
from digen_jax.models.io.tensor_source import BlockStack, TensorSource, build_key_table

DIFFUSERS_CLASS_NAME = "QwenImageTransformer2DModel"

# diffusers config key -> MMDiTConfig field (identical names; out_channels=None means in_channels).
_CONFIG_KEYS = MMDiTConfig.SIZE_FIELDS + (
    "axes_dims_rope",
    "guidance_embeds",
    "zero_cond_t",
    "use_additional_t_cond",
    "use_layer3d_rope",
)

# mmdit.JointAttention under its diffusers names, relative to a block (also FLUX's double-stream
# blocks): (diffusers module prefix, our module path) of its Linear layers, then (diffusers key,
# our param) of its norms.
JOINT_ATTENTION_LINEARS = (
    ("attn.to_q", ("attn", "to_q")),
    ("attn.to_k", ("attn", "to_k")),
    ("attn.to_v", ("attn", "to_v")),
    ("attn.add_q_proj", ("attn", "add_q_proj")),
    ("attn.add_k_proj", ("attn", "add_k_proj")),
    ("attn.add_v_proj", ("attn", "add_v_proj")),
    ("attn.to_out.0", ("attn", "to_out")),
    ("attn.to_add_out", ("attn", "to_add_out")),
)
JOINT_ATTENTION_NORMS = tuple(
    (f"attn.{name}.weight", ("attn", name, "scale"))
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
)

# Linear layers, weight [out, in] -> kernel [in, out], bias -> bias.
_GLOBAL_LINEARS = (
    *embedder_linears("time_text_embed.timestep_embedder", "time_embed"),
    ("img_in", ("img_in",)),
    ("txt_in", ("txt_in",)),
    ("norm_out.linear", ("norm_out",)),
    ("proj_out", ("proj_out",)),
)
_GLOBAL_NORMS = (("txt_norm.weight", ("txt_norm", "scale")),)
# Per block, relative to "transformer_blocks.{i}."; ours are stacked along a leading layer axis
# under "blocks".
_BLOCK_LINEARS = (
    ("img_mod.1", ("img_mod",)),
    ("txt_mod.1", ("txt_mod",)),
    *JOINT_ATTENTION_LINEARS,
    *feed_forward_linears("img_mlp", "img_mlp"),
    *feed_forward_linears("txt_mlp", "txt_mlp"),
)


def config_from_diffusers(cfg: Mapping[str, Any], **overrides: Any) -> MMDiTConfig:
  """MMDiTConfig from a diffusers transformer config.json dict. Keys starting with '_' (metadata)
  are ignored; any other unknown key raises (it may change the math). `overrides` set MMDiTConfig
  fields (e.g. remat=True)."""
  return loading.transformer_config(
      MMDiTConfig, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, cfg, **overrides
  )


def diffusers_key_table(config: MMDiTConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source: Linear weights [out, in] transposed to kernels
  [in, out]; per-block tensors stacked along our leading layer axis (one diffusers key per layer).
  """
  blocks = BlockStack(
      "blocks", "transformer_blocks", config.num_layers, _BLOCK_LINEARS, JOINT_ATTENTION_NORMS
  )
  return build_key_table(_GLOBAL_LINEARS, _GLOBAL_NORMS, (blocks,))


# The load path (models/io/loading.py) of QwenImage transformers; the names below are its methods.
LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME,
    "transformer",
    config_from_diffusers,
    MMDiT,
    "MMDiT",
    key_table=diffusers_key_table,
)
# MMDiTConfig of a transformer folder (or a pipeline folder with transformer/), with overrides.
read_config = LOADER.read_config
# Set every param of an MMDiT (maybe abstract) in place from a diffusers state dict; returns it.
load_diffusers_state = LOADER.load_state
# (config, graphdef, state) streamed onto shardings_fn(abstract_state): DiffusersModel.load_sharded.
load_diffusers_sharded = LOADER.load_sharded
# MMDiT with weights from a diffusers folder, on the first local device.
load_diffusers_folder = LOADER.load_folder
