"""Load diffusers ``QwenImageTransformer2DModel`` checkpoints into ``digen_jax.models.mmdit.MMDiT``.

Only safetensors files are read (never pickle / torch.load). Every diffusers tensor must map to exactly one of our
params and every one of our params must be set, else a ValueError lists what is missing or unexpected.

    model = load_diffusers_folder("/ckpt/Qwen-Image")            # pipeline folder (uses transformer/) or model folder
    cfg, graphdef, state = load_diffusers_sharded("/ckpt/Qwen-Image", lambda s: mesh_lib.fsdp_shardings(s, mesh))
    cfg = config_from_diffusers(json.load(open("config.json")))
    load_diffusers_state(model, {key: np.ndarray})                # in place
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can hand out BF16 tensors)
from flax import nnx

from digen_jax.models import streaming, tensor_source
from digen_jax.models.mmdit import MMDiT, MMDiTConfig
from digen_jax.models.tensor_source import TensorSource

DIFFUSERS_CLASS_NAME = "QwenImageTransformer2DModel"

# diffusers config key -> MMDiTConfig field (identical names; out_channels=None means in_channels).
_CONFIG_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "axes_dims_rope",
    "guidance_embeds",
    "zero_cond_t",
    "use_additional_t_cond",
    "use_layer3d_rope",
)

# (diffusers module prefix, our module path): Linear layers, weight [out, in] -> kernel [in, out], bias -> bias.
_GLOBAL_LINEARS = (
    ("time_text_embed.timestep_embedder.linear_1", ("time_embed", "linear_1")),
    ("time_text_embed.timestep_embedder.linear_2", ("time_embed", "linear_2")),
    ("img_in", ("img_in",)),
    ("txt_in", ("txt_in",)),
    ("norm_out.linear", ("norm_out",)),
    ("proj_out", ("proj_out",)),
)
_GLOBAL_NORMS = (("txt_norm.weight", ("txt_norm", "scale")),)
# Per block, relative to "transformer_blocks.{i}."; ours are stacked along a leading layer axis under "blocks".
_BLOCK_LINEARS = (
    ("img_mod.1", ("img_mod",)),
    ("txt_mod.1", ("txt_mod",)),
    ("attn.to_q", ("attn", "to_q")),
    ("attn.to_k", ("attn", "to_k")),
    ("attn.to_v", ("attn", "to_v")),
    ("attn.add_q_proj", ("attn", "add_q_proj")),
    ("attn.add_k_proj", ("attn", "add_k_proj")),
    ("attn.add_v_proj", ("attn", "add_v_proj")),
    ("attn.to_out.0", ("attn", "to_out")),
    ("attn.to_add_out", ("attn", "to_add_out")),
    ("img_mlp.net.0.proj", ("img_mlp", "fc1")),
    ("img_mlp.net.2", ("img_mlp", "fc2")),
    ("txt_mlp.net.0.proj", ("txt_mlp", "fc1")),
    ("txt_mlp.net.2", ("txt_mlp", "fc2")),
)
_BLOCK_NORMS = (
    ("attn.norm_q.weight", ("attn", "norm_q", "scale")),
    ("attn.norm_k.weight", ("attn", "norm_k", "scale")),
    ("attn.norm_added_q.weight", ("attn", "norm_added_q", "scale")),
    ("attn.norm_added_k.weight", ("attn", "norm_added_k", "scale")),
)


def config_kwargs(
    cfg: Mapping[str, Any],
    class_name: str,
    keys: tuple[str, ...],
    what: str,
    default_in_channels: int,
) -> dict[str, Any]:
  """Config-dataclass kwargs from a diffusers config.json dict of model `class_name`: the `keys` present (same
  names as the dataclass fields). Keys starting with '_' (metadata) are ignored; any other unknown key raises (it
  may change the math). out_channels=None becomes in_channels (diffusers' meaning); axes_dims_rope a tuple.
  """
  cls = cfg.get("_class_name", class_name)
  if cls != class_name:
    raise ValueError(f"config _class_name is {cls!r}; expected {class_name!r}")
  unknown = sorted(k for k in cfg if not k.startswith("_") and k not in keys)
  if unknown:
    raise ValueError(
        f"unknown diffusers config keys {unknown}; {what} only understands {list(keys)}"
    )
  kwargs = {k: cfg[k] for k in keys if k in cfg}
  if kwargs.get("out_channels", 0) is None:  # diffusers: out_channels=None means in_channels
    kwargs["out_channels"] = kwargs.get("in_channels", default_in_channels)
  if "axes_dims_rope" in kwargs:
    kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
  return kwargs


def config_from_diffusers(cfg: Mapping[str, Any], **overrides: Any) -> MMDiTConfig:
  """MMDiTConfig from a diffusers transformer config.json dict. Keys starting with '_' (metadata) are ignored;
  any other unknown key raises (it may change the math). `overrides` set MMDiTConfig fields (e.g. remat=True).
  """
  kwargs = config_kwargs(
      cfg, DIFFUSERS_CLASS_NAME, _CONFIG_KEYS, "MMDiTConfig", MMDiTConfig.in_channels
  )
  kwargs.update(overrides)
  return MMDiTConfig(**kwargs)


class BlockStack(NamedTuple):
  """A stack of diffusers blocks held as ONE module with a leading layer axis (mmdit.stacked_blocks).

  name: our module name ("blocks"); prefix: the diffusers module list ("transformer_blocks"), layer i's keys
  start with f"{prefix}.{i}."; linears / tensors: as for ``build_key_table``, relative to one block.
  """

  name: str
  prefix: str
  num_layers: int
  linears: tuple[tuple[str, tuple[str, ...]], ...]
  tensors: tuple[tuple[str, tuple[str, ...]], ...] = ()


def build_key_table(
    linears, tensors, stacks: tuple[BlockStack, ...] = ()
) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source.

  linears: (diffusers module prefix, our module path) pairs of Linear layers: weight [out, in] -> kernel [in, out]
  (transposed), bias -> bias. tensors: (diffusers key, our param path) pairs taken as they are (norm scales).
  stacks: per-block linears and tensors, stacked along our leading layer axis (one diffusers key per layer).
  """
  table: dict[str, TensorSource] = {}
  for prefix, path in linears:
    name = ".".join(path)
    table[f"{name}.kernel"] = TensorSource((f"{prefix}.weight",), perm=(1, 0))
    table[f"{name}.bias"] = TensorSource((f"{prefix}.bias",))
  for key, path in tensors:
    table[".".join(path)] = TensorSource((key,))
  for stack in stacks:
    layers = range(stack.num_layers)
    for prefix, path in stack.linears:
      name = ".".join((stack.name,) + path)
      table[f"{name}.kernel"] = TensorSource(
          tuple(f"{stack.prefix}.{i}.{prefix}.weight" for i in layers), perm=(1, 0), stacked=True
      )
      table[f"{name}.bias"] = TensorSource(
          tuple(f"{stack.prefix}.{i}.{prefix}.bias" for i in layers), stacked=True
      )
    for key, path in stack.tensors:
      table[".".join((stack.name,) + path)] = TensorSource(
          tuple(f"{stack.prefix}.{i}.{key}" for i in layers), stacked=True
      )
  return table


def diffusers_key_table(config: MMDiTConfig) -> dict[str, TensorSource]:
  """Our dotted param path -> its diffusers source: Linear weights [out, in] transposed to kernels [in, out];
  per-block tensors stacked along our leading layer axis (one diffusers key per layer)."""
  return build_key_table(
      _GLOBAL_LINEARS,
      _GLOBAL_NORMS,
      (
          BlockStack(
              "blocks", "transformer_blocks", config.num_layers, _BLOCK_LINEARS, _BLOCK_NORMS
          ),
      ),
  )


def load_diffusers_state(model: MMDiT, state_dict: Mapping[str, Any]) -> MMDiT:
  """Set every param of `model` IN PLACE from a diffusers state dict {key: array [torch layout]}; returns `model`.

  `model` may be abstract (built under nnx.eval_shape) so that no random init is materialised. Arrays are cast to
  each param's existing dtype. Raises ValueError naming missing / unexpected keys, or the key with a wrong shape.
  """
  return tensor_source.fill_params(model, diffusers_key_table(model.config), state_dict, "MMDiT")


def resolve_transformer_folder(path: str | os.PathLike) -> Path:
  """The folder holding the transformer's config.json: `path` itself or `path`/transformer (pipeline folder)."""
  return streaming.component_folder(path, "transformer", DIFFUSERS_CLASS_NAME)


def read_config(folder: str | os.PathLike, **overrides: Any) -> MMDiTConfig:
  """MMDiTConfig of a transformer folder (or a pipeline folder with transformer/)."""
  return config_from_diffusers(
      streaming.read_config_json(resolve_transformer_folder(folder)), **overrides
  )


def load_diffusers_sharded(
    path: str | os.PathLike,
    shardings_fn: Callable[[nnx.State], Any],
    dtype: Any = None,
    **config_overrides: Any,
) -> tuple[MMDiTConfig, nnx.GraphDef, nnx.State]:
  """(config, graphdef, state) of an MMDiT whose params stream from a diffusers folder (as in
  `load_diffusers_folder`) straight onto `shardings_fn(abstract_state)` (a tree of Shardings matching the
  state, e.g. ``lambda s: mesh_lib.fsdp_shardings(s, mesh)``), each device reading only its slice.

  dtype: the params' dtype (None: float32). No random init is materialised; the checkpoint is validated
  (keys and shapes) before any tensor data is read."""
  folder = resolve_transformer_folder(path)
  config = read_config(folder, **config_overrides)
  checkpoint = streaming.open_checkpoint(folder)
  param_dtype = jnp.float32 if dtype is None else dtype
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: MMDiT(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
  )
  state = streaming.load(
      checkpoint,
      diffusers_key_table(config),
      abstract,
      shardings_fn(abstract),
      param_dtype,
      label="diffusers",
  )
  return config, graphdef, state


def load_diffusers_folder(
    path: str | os.PathLike, *, param_dtype: Any = jnp.float32, **config_overrides: Any
) -> MMDiT:
  """MMDiT with weights from a diffusers folder (config.json + *.safetensors, optionally sharded with an index;
  or a pipeline folder with transformer/). Params are stored in `param_dtype` on the first local device; they
  stream tensor by tensor (`load_diffusers_sharded`), so no random init or whole checkpoint is materialised.
  """
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  _, graphdef, state = load_diffusers_sharded(
      path,
      lambda abstract: jax.tree.map(lambda _: device, abstract),
      param_dtype,
      **config_overrides,
  )
  return nnx.merge(graphdef, state)
