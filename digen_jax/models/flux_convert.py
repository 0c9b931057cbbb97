"""Load diffusers ``FluxTransformer2DModel`` checkpoints into ``digen_jax.models.flux.Flux``.

The FLUX counterpart of ``digen_jax.models.convert`` (same key-table machinery, same checks: every diffusers tensor
maps to exactly one of our params and every one of our params is set; only safetensors files are read).

    model = load_flux_from_diffusers("/ckpt/FLUX.1-dev")              # pipeline folder (transformer/) or model folder
    model = load_flux_from_diffusers(torch_model.state_dict(), config)  # in-memory state dict
    cfg, graphdef, state = load_flux_sharded("/ckpt/FLUX.1-dev", lambda s: mesh_lib.fsdp_shardings(s, mesh))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from digen_jax.models import streaming, tensor_source
from digen_jax.models.convert import BlockStack, build_key_table, config_kwargs
from digen_jax.models.flux import Flux, FluxConfig
from digen_jax.models.tensor_source import TensorSource

DIFFUSERS_CLASS_NAME = "FluxTransformer2DModel"

# diffusers config keys (identical FluxConfig field names; out_channels=None means in_channels).
_CONFIG_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",
    "axes_dims_rope",
)

# (diffusers module prefix, our module path): Linear weight [out, in] -> kernel [in, out], bias -> bias.
_GLOBAL_LINEARS = (
    ("time_text_embed.timestep_embedder.linear_1", ("time_embed", "linear_1")),
    ("time_text_embed.timestep_embedder.linear_2", ("time_embed", "linear_2")),
    ("time_text_embed.text_embedder.linear_1", ("text_pool", "linear_1")),
    ("time_text_embed.text_embedder.linear_2", ("text_pool", "linear_2")),
    ("context_embedder", ("txt_in",)),
    ("x_embedder", ("img_in",)),
    ("norm_out.linear", ("norm_out",)),
    ("proj_out", ("proj_out",)),
)
_GUIDANCE_LINEARS = (
    ("time_text_embed.guidance_embedder.linear_1", ("guidance_embed", "linear_1")),
    ("time_text_embed.guidance_embedder.linear_2", ("guidance_embed", "linear_2")),
)
# Double-stream blocks are mmdit.MMDiTBlock: FluxTransformerBlock's names -> QwenImage's.
_DOUBLE_LINEARS = (
    ("norm1.linear", ("img_mod",)),
    ("norm1_context.linear", ("txt_mod",)),
    ("attn.to_q", ("attn", "to_q")),
    ("attn.to_k", ("attn", "to_k")),
    ("attn.to_v", ("attn", "to_v")),
    ("attn.add_q_proj", ("attn", "add_q_proj")),
    ("attn.add_k_proj", ("attn", "add_k_proj")),
    ("attn.add_v_proj", ("attn", "add_v_proj")),
    ("attn.to_out.0", ("attn", "to_out")),
    ("attn.to_add_out", ("attn", "to_add_out")),
    ("ff.net.0.proj", ("img_mlp", "fc1")),
    ("ff.net.2", ("img_mlp", "fc2")),
    ("ff_context.net.0.proj", ("txt_mlp", "fc1")),
    ("ff_context.net.2", ("txt_mlp", "fc2")),
)
_DOUBLE_NORMS = (
    ("attn.norm_q.weight", ("attn", "norm_q", "scale")),
    ("attn.norm_k.weight", ("attn", "norm_k", "scale")),
    ("attn.norm_added_q.weight", ("attn", "norm_added_q", "scale")),
    ("attn.norm_added_k.weight", ("attn", "norm_added_k", "scale")),
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
  """FluxConfig from a diffusers FluxTransformer2DModel config.json dict (unknown non-'_' keys raise);
  `overrides` set FluxConfig fields (e.g. remat=True)."""
  kwargs = config_kwargs(
      cfg, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, "FluxConfig", FluxConfig.in_channels
  )
  kwargs.update(overrides)
  return FluxConfig(**kwargs)


def flux_key_table(config: FluxConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source: Linear weights [out, in] transposed to kernels [in, out];
  per-block tensors stacked along our leading layer axis (one diffusers key per layer)."""
  linears = _GLOBAL_LINEARS + (_GUIDANCE_LINEARS if config.guidance_embeds else ())
  return build_key_table(
      linears,
      (),
      (
          BlockStack(
              "blocks", "transformer_blocks", config.num_layers, _DOUBLE_LINEARS, _DOUBLE_NORMS
          ),
          BlockStack(
              "single_blocks",
              "single_transformer_blocks",
              config.num_single_layers,
              _SINGLE_LINEARS,
              _SINGLE_NORMS,
          ),
      ),
  )


def load_flux_state(model: Flux, state_dict: Mapping[str, Any]) -> Flux:
  """Set every param of `model` IN PLACE from a diffusers state dict {key: array [torch layout]}; returns `model`
  (which may be abstract, built under nnx.eval_shape). ValueError names missing / unexpected / mis-shaped keys.
  """
  return tensor_source.fill_params(model, flux_key_table(model.config), state_dict, "Flux")


def _as_numpy(value: Any) -> np.ndarray:
  # torch tensors (e.g. a torch model's state_dict()) without importing torch here; bf16 has no numpy view in torch.
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    return (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
  return np.asarray(value)


def resolve_transformer_folder(path: str | os.PathLike):
  """The folder holding the transformer's config.json: `path` itself or `path`/transformer (pipeline folder)."""
  return streaming.component_folder(path, "transformer", DIFFUSERS_CLASS_NAME)


def read_config(folder: str | os.PathLike, **overrides: Any) -> FluxConfig:
  """FluxConfig of a transformer folder (or a pipeline folder with transformer/)."""
  return config_from_diffusers(
      streaming.read_config_json(resolve_transformer_folder(folder)), **overrides
  )


def load_flux_sharded(
    path: str | os.PathLike,
    shardings_fn: Callable[[nnx.State], Any],
    dtype: Any = None,
    **config_overrides: Any,
) -> tuple[FluxConfig, nnx.GraphDef, nnx.State]:
  """(config, graphdef, state) of a Flux whose params stream from a diffusers folder straight onto
  `shardings_fn(abstract_state)`, each device reading only its slice (as convert.load_diffusers_sharded).
  dtype: the params' dtype (None: float32)."""
  folder = resolve_transformer_folder(path)
  config = read_config(folder, **config_overrides)
  checkpoint = streaming.open_checkpoint(folder)
  param_dtype = jnp.float32 if dtype is None else dtype
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Flux(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
  )
  state = streaming.load(
      checkpoint,
      flux_key_table(config),
      abstract,
      shardings_fn(abstract),
      param_dtype,
      label="diffusers",
  )
  return config, graphdef, state


def load_flux_from_diffusers(
    source: str | os.PathLike | Mapping[str, Any],
    config: FluxConfig | None = None,
    *,
    param_dtype: Any = jnp.float32,
    **config_overrides: Any,
) -> Flux:
  """Flux with weights from diffusers: `source` is a folder (config.json + *.safetensors, optionally sharded; or
  a pipeline folder with transformer/) or a state dict {key: numpy array or torch tensor}.

  A folder's config comes from its config.json (`config` must then be None; `config_overrides` adjust it); a state
  dict needs `config`. Params are stored in `param_dtype` on the first local device, never randomly initialised.
  """
  if isinstance(source, Mapping):
    if config is None:
      raise ValueError("loading from a state dict needs config=FluxConfig(...)")
    config = dataclasses.replace(config, **config_overrides)
    model = nnx.eval_shape(lambda: Flux(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    return load_flux_state(model, {k: _as_numpy(v) for k, v in source.items()})
  if config is not None:
    raise ValueError(
        "a diffusers folder carries its own config.json; pass config_overrides, not config"
    )
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  _, graphdef, state = load_flux_sharded(
      source,
      lambda abstract: jax.tree.map(lambda _: device, abstract),
      param_dtype,
      **config_overrides,
  )
  return nnx.merge(graphdef, state)
