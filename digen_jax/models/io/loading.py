"""Reading diffusers model folders into our modules: one load path for every model class.

A `DiffusersModel` names what differs between diffusers model classes (the class name, the
pipeline subfolder, the config.json parser, our module and its key table) and gives the rest
once: finding the component folder, reading its config, building the module abstractly
(nnx.eval_shape: no random init), filling it from an in-memory state dict, or streaming its
safetensors straight onto device shardings (models/io/streaming.py). The transformer converters
(convert.py, flux_convert.py) and the VAEs (vae.py, flux_vae.py) each define one.

    model = convert.LOADER.load_folder('/ckpt/Qwen-Image')        # pipeline or model folder
    cfg, graphdef, state = flux_convert.LOADER.load_sharded(folder, shardings_fn, jnp.bfloat16)
    table = vae.LOADER.table(vae_config)                           # {our param: TensorSource}

`check_config_keys` and `config_kwargs` are the config.json checks they share: a config of
another class, or one with a key we do not understand (it may change the math), is refused.
Only safetensors files are ever read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from digen_jax.models.io import streaming
from digen_jax.models.io import tensor_source
from digen_jax.models.io.tensor_source import KeyTable


def check_config_keys(
    cfg: Mapping[str, Any], class_name: str, known: Iterable[str], *, kind: str, what: str
) -> None:
  """ValueError unless a config.json dict is of diffusers model `class_name` (a missing
  _class_name passes) and every key not starting with '_' (metadata) is `known`. kind names the
  config in messages ('diffusers', 'VAE'); what names the config class that understands `known`."""
  known = tuple(known)
  cls = cfg.get('_class_name', class_name)
  if cls != class_name:
    raise ValueError(f'{kind} config _class_name is {cls!r}; expected {class_name!r}')
  unknown = sorted(k for k in cfg if not k.startswith('_') and k not in known)
  if unknown:
    raise ValueError(f'unknown {kind} config keys {unknown}; {what} understands {list(known)}')


def config_kwargs(
    cfg: Mapping[str, Any],
    class_name: str,
    keys: tuple[str, ...],
    what: str,
    default_in_channels: int,
) -> dict[str, Any]:
  """Config-dataclass kwargs from a diffusers transformer config.json dict of model `class_name`:
  the `keys` present (same names as the dataclass fields), after `check_config_keys`.
  out_channels=None becomes in_channels (diffusers' meaning); axes_dims_rope a tuple."""
  check_config_keys(cfg, class_name, keys, kind='diffusers', what=what)
  kwargs = {k: cfg[k] for k in keys if k in cfg}
  if kwargs.get('out_channels', 0) is None:  # diffusers: out_channels=None means in_channels
    kwargs['out_channels'] = kwargs.get('in_channels', default_in_channels)
  if 'axes_dims_rope' in kwargs:
    kwargs['axes_dims_rope'] = tuple(kwargs['axes_dims_rope'])
  return kwargs


def transformer_config(
    config_cls: type, class_name: str, keys: tuple[str, ...], cfg: Mapping[str, Any], **overrides
) -> Any:
  """config_cls (a transformer config dataclass) from a diffusers config.json dict (see
  `config_kwargs`); `overrides` set its fields (e.g. remat=True)."""
  kwargs = config_kwargs(cfg, class_name, keys, config_cls.__name__, config_cls.in_channels)
  kwargs.update(overrides)
  return config_cls(**kwargs)


def first_device_shardings(abstract: Any) -> Any:
  """Every leaf of `abstract` on the first local device (a single-device model)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda _: device, abstract)


@dataclasses.dataclass(frozen=True)
class DiffusersModel:
  """How one diffusers model class is read into one of our modules.

  class_name: diffusers' _class_name. subfolder: its folder in a pipeline ('transformer', 'vae').
  parse_config: (config.json dict, **overrides) -> our config. module: (config, *, rngs,
  param_dtype) -> our module. label: names the model in error messages ('MMDiT', 'VAE').
  The key table ({our dotted param path: TensorSource}) comes from key_table(config), or, for a
  module whose leaf modules each give their own sources, from those `leaves`
  (tensor_source.table_from_modules).
  """

  class_name: str
  subfolder: str
  parse_config: Callable[..., Any]
  module: Callable[..., nnx.Module]
  label: str
  key_table: Callable[[Any], KeyTable] | None = None
  leaves: tuple[type, ...] = ()

  def table(self, config: Any) -> KeyTable:
    """Our dotted param path -> its diffusers source (every param, every diffusers key once)."""
    if self.key_table is not None:
      return self.key_table(config)
    model = self.abstract_module(config)
    return tensor_source.table_from_modules(model, self.leaves, f'the {self.label} key table')

  def folder(self, path: str | os.PathLike) -> Path:
    """The folder holding the model's config.json: `path` itself or `path`/`subfolder` (a pipeline
    folder)."""
    return streaming.component_folder(path, self.subfolder, self.class_name)

  def read_config(self, path: str | os.PathLike, **overrides: Any) -> Any:
    """Our config from a model folder (or a pipeline folder holding it); `overrides` set its
    fields. A ValueError names the config.json."""
    parse = functools.partial(self.parse_config, **overrides) if overrides else self.parse_config
    return streaming.read_component_config(self.folder(path), parse)

  def abstract_module(self, config: Any, param_dtype: Any = jnp.float32) -> nnx.Module:
    """The module built under nnx.eval_shape: params are ShapeDtypeStructs, nothing is drawn."""
    return nnx.eval_shape(lambda: self.module(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))

  def abstract(self, config: Any, param_dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, abstract nnx.State of ShapeDtypeStructs) of the module."""
    return nnx.split(self.abstract_module(config, param_dtype))

  def load_state(self, model: nnx.Module, state_dict: Mapping[str, Any]) -> nnx.Module:
    """Set every param of `model` IN PLACE from a diffusers state dict {key: array [torch
    layout]}; returns `model`, which may be abstract (`abstract_module`). Arrays are cast to each
    param's dtype. ValueError names missing / unexpected keys or a key whose shape does not fit."""
    return tensor_source.fill_params(model, self.table(model.config), state_dict, self.label)

  def load_sharded(
      self,
      path: str | os.PathLike,
      shardings_fn: Callable[[nnx.State], Any],
      dtype: Any = None,
      **config_overrides: Any,
  ) -> tuple[Any, nnx.GraphDef, nnx.State]:
    """(config, graphdef, state) of a module whose params stream from a diffusers folder (the
    model's, or a pipeline folder holding it; *.safetensors, optionally sharded with an index)
    straight onto `shardings_fn(abstract_state)` (a tree of Shardings matching the state, e.g.
    ``lambda s: mesh_lib.fsdp_shardings(s, mesh)``), each device reading only its slice.

    dtype: the params' dtype (None: float32). No random init is materialised; the checkpoint is
    validated (keys and shapes) before any tensor data is read."""
    folder = self.folder(path)
    config = self.read_config(folder, **config_overrides)
    checkpoint = streaming.open_checkpoint(folder)
    param_dtype = jnp.float32 if dtype is None else dtype
    graphdef, abstract = self.abstract(config, param_dtype)
    state = streaming.load(
        checkpoint,
        self.table(config),
        abstract,
        shardings_fn(abstract),
        param_dtype,
        label='diffusers',
    )
    return config, graphdef, state

  def load_folder(
      self, path: str | os.PathLike, param_dtype: Any = jnp.float32, **config_overrides: Any
  ) -> nnx.Module:
    """The module with weights from a diffusers folder (as `load_sharded`), its params in
    `param_dtype` on the first local device, streamed tensor by tensor: no random init or whole
    checkpoint is materialised."""
    _, graphdef, state = self.load_sharded(
        path, first_device_shardings, param_dtype, **config_overrides
    )
    return nnx.merge(graphdef, state)
