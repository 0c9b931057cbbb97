"""Our model params back to a diffusers model folder: the inverse of the key table.

`to_diffusers(params, table, like)` turns our params (nnx.State or nested dict, our layout:
stacked layers, kernels [in, out]) into diffusers tensors {key: array}, each in the shape and
dtype of the same key of `like` (the checkpoint the model was loaded from: its headers give the
size-1 axes and the dtype our layout dropped). `write_sharded(folder, tensors, ...)` saves them as
diffusers does: `<name>-0000i-of-0000N.safetensors` shards of at most `max_shard_bytes` and
`<name>.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}).

    tensors = to_diffusers(state, convert.diffusers_key_table(cfg), streaming.open_checkpoint(src))
    write_sharded(out / 'transformer', tensors, max_shard_bytes=5 << 30)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from digen_jax.models.io import streaming
from digen_jax.models.io.tensor_source import KeyTable, TensorSource

WEIGHTS_NAME = 'diffusion_pytorch_model'


def _to_file(source: TensorSource, ours: np.ndarray, like: streaming.Checkpoint) -> dict:
  """{file key: tensor} of one of our params (the inverse of TensorSource.to_ours per key)."""
  parts = list(ours) if source.stacked else [ours]
  out = {}
  for key, part in zip(source.keys, parts):
    info = like.tensors[key]
    permuted = tuple(info.shape[i] for i in source.perm) if source.perm else tuple(info.shape)
    part = np.asarray(part).reshape(permuted)
    if source.perm:
      part = np.transpose(part, np.argsort(source.perm))
    out[key] = np.ascontiguousarray(part.astype(streaming.numpy_dtype(info.dtype)))
  return out


def to_diffusers(params: Any, table: KeyTable, like: streaming.Checkpoint) -> dict[str, np.ndarray]:
  """Every diffusers tensor of `params` through `table`, in `like`'s shapes and dtypes.
  ValueError when a param has no source, a key of `like` is left unset, or a shape does not fit
  (the params are not of the architecture `like` holds)."""
  flat = streaming.flat_params(params)
  missing = sorted(set(table) - set(flat))
  if missing:
    raise ValueError(f'params lack {len(missing)} entries of the key table, e.g. {missing[:3]}')
  tensors = {}
  for name, source in table.items():
    try:
      tensors.update(_to_file(source, np.asarray(flat[name]), like))
    except (KeyError, ValueError) as e:
      raise ValueError(f'our param {name} does not fit {like.path}: {e}') from None
  unset = sorted(set(like.tensors) - set(tensors))
  if unset:
    raise ValueError(f'{like.path} holds keys no param fills: {unset[:5]}')
  return tensors


def write_sharded(
    folder: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int,
    name: str = WEIGHTS_NAME,
) -> Path:
  """Writes `tensors` into `folder` as diffusers' sharded safetensors + index (keys in sorted
  order, a new shard when the next tensor would pass max_shard_bytes); returns the index path."""
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  shards, size = [[]], 0
  for key in sorted(tensors):
    nbytes = tensors[key].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(key)
    size += nbytes
  weight_map = {}
  for i, keys in enumerate(shards):
    file = f'{name}-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={'format': 'pt'})
    weight_map.update(dict.fromkeys(keys, file))
  index = folder / f'{name}.safetensors.index.json'
  total = sum(t.nbytes for t in tensors.values())
  index.write_text(
      json.dumps({'metadata': {'total_size': total}, 'weight_map': weight_map}, indent=2)
  )
  return index
