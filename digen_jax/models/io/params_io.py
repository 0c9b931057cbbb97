"""Save / load model parameters as a small self-describing folder (safetensors + JSON, no pickle).

Each kind of model stored this way has a "format" in config.json: the MMDiT (FORMAT, e.g. the
ShapesBench base generator) here, others registered by their own module with `register_kind`
(the ShapesBench autoencoder, tasks/shapes/autoencoder.py). `model_config` is the kind's config
dataclass.

A params folder holds:
  params.safetensors   one tensor per parameter, keyed by its dotted path in the NNX state
                       (e.g. "blocks.attn.to_q.kernel" [num_layers, D, D]); float32, or bfloat16
                       when saved with dtype='bfloat16' (loading always returns float32).
  config.json          {"format": FORMAT, "model_config": MMDiTConfig fields, "dtype": ...,
                        "num_params": int, "sha256": digest of params.safetensors, "extra": {...}}

The digest makes a truncated or altered weights file a clear error instead of silently wrong
weights. `extra` is free-form JSON (training command, text-encoder settings, measured accuracy).

    save_params("assets/shapes_base", params, model_config, extra={"steps": 3000})
    cfg, params, extra = load_params("assets/shapes_base")      # params: nnx.State of MMDiT
    cfg, params, extra = load_params_sharded("assets/shapes_base", lambda s: fsdp_shardings(s, mesh))
    model = load_model("assets/shapes_base")                     # MMDiT with those params
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors)
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from digen_jax.models.io import streaming
from digen_jax.models.transformers.mmdit import MMDiT, MMDiTConfig

FORMAT = "digen_jax.mmdit_params/1"
# format -> (config class, module class); every module takes (config, rngs=...).
_KINDS: dict[str, tuple[type, Any]] = {FORMAT: (MMDiTConfig, MMDiT)}


def register_kind(fmt: str, config_cls: type, module_cls: Any) -> None:
  """Lets save_params / load_params store modules of `module_cls` (built as
  module_cls(config, rngs=...)) under config.json's format `fmt`."""
  if _KINDS.get(fmt, (config_cls, module_cls)) != (config_cls, module_cls):
    raise ValueError(f"params format {fmt!r} is already registered to {_KINDS[fmt]}")
  _KINDS[fmt] = (config_cls, module_cls)


WEIGHTS_FILE = "params.safetensors"
CONFIG_FILE = "config.json"
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _path_key(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _flat_leaves(params: Any) -> dict[str, Any]:
  """nnx.State (or nested dict) -> {"a.b.c": leaf} (leaves untouched: arrays or ShapeDtypeStructs)."""
  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  return {_path_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]}


def _flatten(params: Any) -> dict[str, np.ndarray]:
  """nnx.State (or nested dict of arrays) -> {"a.b.c": host numpy array}."""
  return {k: np.asarray(jax.device_get(v)) for k, v in _flat_leaves(params).items()}


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _kind(config) -> tuple[str, Any]:
  """(format, module class) of a model config; ValueError for another type."""
  for fmt, (cls, module) in _KINDS.items():
    if isinstance(config, cls):
      return fmt, module
  raise ValueError(
      f"model_config must be one of {[c.__name__ for c, _ in _KINDS.values()]}, "
      f"got {type(config).__name__}"
  )


def _abstract_state(config) -> tuple[Any, nnx.State]:
  """(graphdef, state of ShapeDtypeStructs) of the config's module, without allocating weights."""
  module = _kind(config)[1]
  abstract = nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def save_params(
    folder: str | os.PathLike,
    params: nnx.State,
    model_config: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    dtype: str = "float32",
) -> str:
  """Writes params.safetensors + config.json into `folder` (created if needed); returns the folder.

  params: the model's nnx.State (as from nnx.split(model)); its keys and shapes must be those of
  the module model_config describes (MMDiT or a registered kind). extra: JSON-serialisable dict stored
  under "extra".
  """
  fmt = _kind(model_config)[0]
  if dtype not in _DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {sorted(_DTYPES)}")
  extra = dict(extra or {})
  try:
    json.dumps(extra)
  except TypeError as e:
    raise ValueError(
        f"extra must be JSON-serialisable (plain numbers, strings, lists, dicts): {e}"
    ) from e
  flat = _flatten(params)
  _check_against_config(flat, model_config, source="params")
  folder = os.fspath(folder)
  os.makedirs(folder, exist_ok=True)
  weights = os.path.join(folder, WEIGHTS_FILE)
  # Write to temporaries and rename, so a crash mid-save never leaves a half-written checkpoint
  # that the digest would then (correctly but unhelpfully) reject.
  tmp_w, tmp_c = weights + ".tmp", os.path.join(folder, CONFIG_FILE + ".tmp")
  save_file(
      {k: np.ascontiguousarray(v.astype(_DTYPES[dtype])) for k, v in flat.items()},
      tmp_w,
      metadata={"format": fmt},
  )
  meta = {
      "format": fmt,
      "model_config": dataclasses.asdict(model_config),
      "dtype": dtype,
      "num_params": int(sum(v.size for v in flat.values())),
      "sha256": _sha256(tmp_w),
      "extra": extra,
  }
  with open(tmp_c, "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
    f.write("\n")
  os.chmod(tmp_w, 0o644)  # safetensors writes 0600; a shipped asset should be world-readable
  os.replace(tmp_w, weights)
  os.replace(tmp_c, os.path.join(folder, CONFIG_FILE))
  return folder


def _check_against_config(flat: Mapping[str, np.ndarray], config, source: str) -> None:
  """ValueError listing missing / unexpected / mis-shaped keys vs the config's module."""
  _, abstract = _abstract_state(config)
  want = {k: tuple(v.shape) for k, v in _flat_leaves(abstract).items()}
  missing = sorted(set(want) - set(flat))
  unexpected = sorted(set(flat) - set(want))
  bad = sorted(
      f"{k}: {tuple(flat[k].shape)} != {want[k]}"
      for k in set(want) & set(flat)
      if tuple(flat[k].shape) != want[k]
  )
  if missing or unexpected or bad:
    raise ValueError(
        f"{source} do not match {_kind(config)[1].__name__}({config}): missing {missing[:10]}, "
        f"unexpected {unexpected[:10]}, wrong shapes {bad[:10]}"
    )


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
  """The parsed config.json of a params folder; ValueError naming the path if absent or invalid."""
  folder = os.fspath(folder)
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isdir(folder):
    raise ValueError(
        f"params folder {folder!r} does not exist (expected {CONFIG_FILE} and "
        f"{WEIGHTS_FILE} written by digen_jax.models.io.params_io.save_params)"
    )
  if not os.path.isfile(path):
    raise ValueError(
        f"params folder {folder!r} has no {CONFIG_FILE}; it was not written by "
        "params_io.save_params (or the save was interrupted)"
    )
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e
  if not isinstance(meta, dict) or meta.get("format") not in _KINDS:
    raise ValueError(
        f"{path}: format is {meta.get('format') if isinstance(meta, dict) else None!r}, "
        f"expected one of {sorted(_KINDS)}"
    )
  return meta


def load_params_sharded(
    folder: str | os.PathLike, shardings_fn: Callable[[nnx.State], Any], dtype: Any = None
) -> tuple[Any, nnx.State, dict[str, Any]]:
  """(model config, nnx.State of its module, extra), each param streamed from params.safetensors
  straight onto `shardings_fn(abstract_state)` (a matching tree of Shardings), each device reading
  only its slice. dtype: the params' dtype (None: float32, whatever dtype the file holds).

  Raises ValueError naming the path if the folder, either file, the digest, or any key/shape is wrong
  (all checked before any tensor data is read, except the digest, which reads the file once).
  """
  folder = os.fspath(folder)
  meta = read_config(folder)
  cfg_path = os.path.join(folder, CONFIG_FILE)
  try:
    config = _KINDS[meta["format"]][0](**meta["model_config"])
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{cfg_path}: bad model_config ({e})") from e
  weights = os.path.join(folder, WEIGHTS_FILE)
  if not os.path.isfile(weights):
    raise ValueError(f"params folder {folder!r} has no {WEIGHTS_FILE}")
  digest = _sha256(weights)
  if digest != meta.get("sha256"):
    raise ValueError(
        f"{weights} is corrupt or was replaced: sha256 {digest} != {meta.get('sha256')} "
        f"recorded in {cfg_path}"
    )
  try:
    checkpoint = streaming.open_checkpoint(weights)
  except ValueError as e:
    raise ValueError(f"{weights} could not be read as safetensors ({e})") from e
  _check_against_config(checkpoint.tensors, config, source=f"tensors in {weights}")
  _, abstract = _abstract_state(config)
  state = streaming.load(
      checkpoint,
      streaming.identity_table(abstract),
      abstract,
      shardings_fn(abstract),
      jnp.float32 if dtype is None else dtype,
      label="params",
  )
  return config, state, dict(meta.get("extra", {}))


def load_params(folder: str | os.PathLike) -> tuple[Any, nnx.State, dict[str, Any]]:
  """(model config, float32 nnx.State of its module on the first local device, extra) from a folder
  written by save_params (streamed: see load_params_sharded).

  Raises ValueError naming the path if the folder, either file, the digest, or any key/shape is wrong.
  """
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return load_params_sharded(folder, lambda abstract: jax.tree.map(lambda _: device, abstract))


def load_model(folder: str | os.PathLike) -> nnx.Module:
  """The module (MMDiT, or a registered kind) with the float32 params of a folder written by
  save_params."""
  config, state, _ = load_params(folder)
  graphdef, _ = _abstract_state(config)
  return nnx.merge(graphdef, state)
