"""Load diffusers ``WanTransformer3DModel`` checkpoints into ``digen_jax.models.transformers.wan.Wan``.

The Wan counterpart of ``digen_jax.models.io.convert``: the same load path (models/io/loading.py) and the
same checks (every diffusers tensor maps to exactly one of our params and every one of our params
is set; only safetensors files are read; a config key we do not understand is refused).

    cfg, graphdef, state = load_wan_sharded(
        "/ckpt/Wan2.1-T2V-1.3B-Diffusers", lambda s: mesh_lib.fsdp_shardings(s, mesh))
    model = LOADER.load_folder("/ckpt/Wan2.1-T2V-1.3B-Diffusers")   # on the first local device
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from digen_jax.models.io import loading
from digen_jax.models.transformers.layers import TIMESTEP_CHANNELS, embedder_linears, feed_forward_linears
from digen_jax.models.io.tensor_source import BlockStack, TensorSource, build_key_table
from digen_jax.models.io.tensor_source import weight_and_bias
from digen_jax.models.transformers.wan import Wan, WanConfig

DIFFUSERS_CLASS_NAME = "WanTransformer3DModel"

# Every key of WanTransformer3DModel's config (diffusers 0.42.1). The image-conditioning ones
# (Wan2.1 I2V / FLF2V) must be unset: only text-to-video is implemented.
_IMAGE_KEYS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
_CONFIG_KEYS = (
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    # diffusers 0.42.1 normalises q and k across heads whatever qk_norm says (WanAttention never
    # reads it), so any value is that math.
    "qk_norm",
    "eps",
    "rope_max_seq_len",
) + _IMAGE_KEYS
# Config keys with the same name and meaning in WanConfig.
_SAME_KEYS = (
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    "eps",
    "rope_max_seq_len",
)

# Per block, relative to "blocks.{i}." (ours: the same names under the stacked "blocks").
_ATTENTION_LINEARS = tuple(
    (f"{attn}.{diffusers}", (attn, ours))
    for attn in ("attn1", "attn2")
    for diffusers, ours in (
        ("to_q", "to_q"),
        ("to_k", "to_k"),
        ("to_v", "to_v"),
        ("to_out.0", "to_out"),
    )
)
_BLOCK_LINEARS = _ATTENTION_LINEARS + feed_forward_linears("ffn", "ffn")
_BLOCK_TENSORS = (("scale_shift_table", ("scale_shift_table",)),) + tuple(
    (f"{attn}.{norm}.weight", (attn, norm, "scale"))
    for attn in ("attn1", "attn2")
    for norm in ("norm_q", "norm_k")
)
_CROSS_NORM_TENSORS = (("norm2.weight", ("norm2", "scale")), ("norm2.bias", ("norm2", "bias")))
_GLOBAL_LINEARS = (
    *embedder_linears("condition_embedder.time_embedder", "time_embed"),
    ("condition_embedder.time_proj", ("time_proj",)),
    *embedder_linears("condition_embedder.text_embedder", "text_embed"),
    ("proj_out", ("proj_out",)),
)
_GLOBAL_TENSORS = (("scale_shift_table", ("scale_shift_table",)),)

# The LoRA targets of Wan's usual recipes: the projections of both attentions of every block.
ATTENTION_TARGETS = r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$"


def config_from_diffusers(cfg: Mapping[str, Any], **overrides: Any) -> WanConfig:
  """WanConfig from a diffusers WanTransformer3DModel config.json dict. Keys starting with '_'
  are metadata; any other unknown key raises (it may change the math), as do image conditioning
  (I2V) and a patch or timestep embedding we do not implement. `overrides` set WanConfig fields
  (e.g. remat=True)."""
  loading.check_config_keys(cfg, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, kind="diffusers", what="Wan")
  for key in _IMAGE_KEYS:
    if cfg.get(key) is not None:
      raise ValueError(
          f"{key}={cfg[key]!r}: image-conditioned Wan (I2V / FLF2V) is not supported; "
          "text-to-video checkpoints leave it null"
      )
  if cfg.get("freq_dim", TIMESTEP_CHANNELS) != TIMESTEP_CHANNELS:
    raise ValueError(f"freq_dim={cfg['freq_dim']!r}: only {TIMESTEP_CHANNELS} is supported")
  kwargs = {k: cfg[k] for k in _SAME_KEYS if k in cfg}
  if "text_dim" in cfg:
    kwargs["joint_attention_dim"] = cfg["text_dim"]
  if "patch_size" in cfg:
    patch = tuple(cfg["patch_size"])
    if len(patch) != 3 or patch[0] != 1 or patch[1] != patch[2]:
      raise ValueError(
          f"patch_size={list(patch)}: only (1, p, p) patches are supported (Wan2.1 uses (1, 2, 2))"
      )
    kwargs["patch_size"] = patch[1]
  if kwargs.get("out_channels", 0) is None:  # diffusers: None means in_channels
    kwargs["out_channels"] = kwargs.get("in_channels", WanConfig.in_channels)
  kwargs.update(overrides)
  return WanConfig(**kwargs)


def wan_key_table(config: WanConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source: Linear weights [out, in] transposed to kernels
  [in, out]; per-block tensors stacked along our leading layer axis; the patch embedding's Conv3d
  weight [D, C, 1, p, p] held as [C, p, p, D]."""
  tensors = _BLOCK_TENSORS + (_CROSS_NORM_TENSORS if config.cross_attn_norm else ())
  blocks = BlockStack("blocks", "blocks", config.num_layers, _BLOCK_LINEARS, tensors)
  table = build_key_table(_GLOBAL_LINEARS, _GLOBAL_TENSORS, (blocks,))
  p, c = config.patch_size, config.in_channels
  table.update(
      weight_and_bias(
          "img_in", "patch_embedding", perm=(1, 2, 3, 4, 0), shape=(c, p, p, config.inner_dim)
      )
  )
  return table


# The load path (models/io/loading.py) of Wan transformers.
LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME, "transformer", config_from_diffusers, Wan, "Wan", key_table=wan_key_table
)
# WanConfig of a transformer folder (or a pipeline folder with transformer/), with overrides.
read_config = LOADER.read_config
# (config, graphdef, state) streamed onto shardings_fn(abstract_state): DiffusersModel.load_sharded.
load_wan_sharded = LOADER.load_sharded
# Wan with weights from a diffusers folder, on the first local device.
load_wan_folder = LOADER.load_folder
