"""Load diffusers ``FluxTransformer2DModel`` checkpoints into ``digen_jax.models.transformers.flux.Flux``.

The FLUX counterpart of ``digen_jax.models.io.convert``: the same load path (models/io/loading.py) and
the same checks (every diffusers tensor maps to exactly one of our params and every one of our
params is set; only safetensors files are read). The double-stream blocks' attention entries are
convert's: those blocks are QwenImage's.

    model = load_flux_from_diffusers("/ckpt/FLUX.1-dev")   # pipeline folder (transformer/) or model
    model = load_flux_from_diffusers(torch_model.state_dict(), config)  # in-memory state dict
    cfg, graphdef, state = load_flux_sharded(
        "/ckpt/FLUX.1-dev", lambda s: mesh_lib.fsdp_shardings(s, mesh))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from digen_jax.models.io import loading
from digen_jax.models.io.convert import JOINT_ATTENTION_LINEARS, JOINT_ATTENTION_NORMS
from digen_jax.models.transformers.flux import Flux, FluxConfig
from digen_jax.models.transformers.layers import embedder_linears, feed_forward_linears
from digen_jax.models.io.tensor_source import BlockStack, TensorSource, build_key_table

DIFFUSERS_CLASS_NAME = "FluxTransformer2DModel"

# diffusers config keys (identical FluxConfig field names; out_channels=None means in_channels).
_CONFIG_KEYS = FluxConfig.SIZE_FIELDS + ("guidance_embeds", "axes_dims_rope")

# (diffusers module prefix, our module path): Linear weight [out, in] -> kernel [in, out], bias.
_GLOBAL_LINEARS = (
    *embedder_linears("time_text_embed.timestep_embedder", "time_embed"),
    *embedder_linears("time_text_embed.text_embedder", "text_pool"),
    ("context_embedder", ("txt_in",)),
    ("x_embedder", ("img_in",)),
    ("norm_out.linear", ("norm_out",)),
    ("proj_out", ("proj_out",)),
)
_GUIDANCE_LINEARS = embedder_linears("time_text_embed.guidance_embedder", "guidance_embed")
# Double-stream blocks are mmdit.MMDiTBlock: FluxTransformerBlock's names -> QwenImage's.
_DOUBLE_LINEARS = (
    ("norm1.linear", ("img_mod",)),
    ("norm1_context.linear", ("txt_mod",)),
    *JOINT_ATTENTION_LINEARS,
    *feed_forward_linears("ff", "img_mlp"),
    *feed_forward_linears("ff_context", "txt_mlp"),
)
_SINGLE_LINEARS = (
    ("norm.linear", ("mod",)),
    ("proj_mlp", ("proj_mlp",)),
    ("attn.to_q", ("attn", "to_q")),
    ("attn.to_k", ("attn", "to_k")),
    ("attn.to_v", ("attn", "to_v")),
    ("proj_out", ("proj_out",)),
)
_SINGLE_NORMS = (
    ("attn.norm_q.weight", ("attn", "norm_q", "scale")),
    ("attn.norm_k.weight", ("attn", "norm_k", "scale")),
)


def config_from_diffusers(cfg: Mapping[str, Any], **overrides: Any) -> FluxConfig:
  """FluxConfig from a diffusers FluxTransformer2DModel config.json dict (unknown non-'_' keys
  raise); `overrides` set FluxConfig fields (e.g. remat=True)."""
  return loading.transformer_config(
      FluxConfig, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, cfg, **overrides
  )


def flux_key_table(config: FluxConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source: Linear weights [out, in] transposed to kernels
  [in, out]; per-block tensors stacked along our leading layer axis (one diffusers key per layer).
  """
  linears = _GLOBAL_LINEARS + (_GUIDANCE_LINEARS if config.guidance_embeds else ())
  double = BlockStack(
      "blocks", "transformer_blocks", config.num_layers, _DOUBLE_LINEARS, JOINT_ATTENTION_NORMS
  )
  single = BlockStack(
      "single_blocks",
      "single_transformer_blocks",
      config.num_single_layers,
      _SINGLE_LINEARS,
      _SINGLE_NORMS,
  )
  return build_key_table(linears, (), (double, single))


# The load path (models/io/loading.py) of FLUX transformers.
LOADER = loading.DiffusersModel(
    DIFFUSERS_CLASS_NAME,
    "transformer",
    config_from_diffusers,
    Flux,
    "Flux",
    key_table=flux_key_table,
)
# FluxConfig of a transformer folder (or a pipeline folder with transformer/), with overrides.
read_config = LOADER.read_config
# (config, graphdef, state) streamed onto shardings_fn(abstract_state): DiffusersModel.load_sharded.
load_flux_sharded = LOADER.load_sharded


def _as_numpy(value: Any) -> np.ndarray:
  # torch tensors (e.g. a torch model's state_dict()) without importing torch here; bf16 has no
  # numpy view in torch.
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    return (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
  return np.asarray(value)


def load_flux_from_diffusers(
    source: str | os.PathLike | Mapping[str, Any],
    config: FluxConfig | None = None,
    *,
    param_dtype: Any = jnp.float32,
    **config_overrides: Any,
) -> Flux:
  """Flux with weights from diffusers: `source` is a folder (config.json + *.safetensors,
  optionally sharded; or a pipeline folder with transformer/) or a state dict {key: numpy array
  or torch tensor}.

  A folder's config comes from its config.json (`config` must then be None; `config_overrides`
  adjust it); a state dict needs `config`. Params are stored in `param_dtype` on the first local
  device, never randomly initialised.
  """
  if isinstance(source, Mapping):
    if config is None:
      raise ValueError("loading from a state dict needs config=FluxConfig(...)")
    config = dataclasses.replace(config, **config_overrides)
    model = LOADER.abstract_module(config, param_dtype)
    return LOADER.load_state(model, {k: _as_numpy(v) for k, v in source.items()})
  if config is not None:
    raise ValueError(
        "a diffusers folder carries its own config.json; pass config_overrides, not config"
    )
  return LOADER.load_folder(source, param_dtype, **config_overrides)
