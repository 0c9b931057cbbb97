"""Streamed, sharded loading of safetensors checkpoints straight onto device meshes.

A checkpoint (a folder of *.safetensors shards, or one file) is opened by reading its headers
only. `load` then fills a tree of ShapeDtypeStructs param by param: for every distinct slice
that this process's devices hold, it reads exactly that slice from the file, puts it in our
layout (the param's `TensorSource`: axis permutation, layer stacking, size-1 reshapes), casts
it, copies it to every device that holds it, and frees it before reading the next. Host memory
thus holds about one device shard at a time, never the checkpoint or a random init. Only this
process's (addressable) devices are read for, so every process of a multi-process job loads its
own part.

    ckpt = open_checkpoint('/ckpt/Qwen-Image/transformer')      # headers only
    state = load(ckpt, convert.diffusers_key_table(cfg), abstract_state,
                 mesh_lib.fsdp_shardings(abstract_state, mesh), dtype=jnp.bfloat16)

Pickle files (.bin, .pt, .ckpt) are never read.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from pathlib import Path
import time
from typing import Any, Callable, Mapping, TypeVar
import weakref

from flax import nnx
import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from digen_jax.models.io import tensor_source
from digen_jax.models.io.tensor_source import KeyTable, TensorSource

# safetensors header dtype name -> numpy dtype (ml_dtypes gives numpy bfloat16 / float8).
_NP_DTYPES = {
    'F64': np.float64,
    'F32': np.float32,
    'F16': np.float16,
    'BF16': ml_dtypes.bfloat16,
    'F8_E4M3': ml_dtypes.float8_e4m3fn,
    'F8_E5M2': ml_dtypes.float8_e5m2,
    'I64': np.int64,
    'I32': np.int32,
    'I16': np.int16,
    'I8': np.int8,
    'U64': np.uint64,
    'U32': np.uint32,
    'U16': np.uint16,
    'U8': np.uint8,
    'BOOL': np.bool_,
}

Bounds = tuple[tuple[int, int], ...]  # [start, stop) per axis
_T = TypeVar('_T')


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor as its file header describes it (no data read)."""

  file: Path
  shape: tuple[int, ...]
  dtype: str  # safetensors name: 'F32', 'BF16', ...

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(_NP_DTYPES[self.dtype]).itemsize


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """The tensors of a set of safetensors files: key -> where it lives, its shape and dtype."""

  path: Path  # the folder (or single file) that was opened
  files: tuple[Path, ...]
  tensors: Mapping[str, TensorInfo]

  def read(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Tensor `key` in its file layout, or only the slice `index` of it (one slice per axis,
    step 1).

    The file is opened for this read only: safetensors maps it, and closing the map right away
    keeps the touched file pages from piling up in this process's resident memory.
    """
    info = self.tensors[key]
    bounds = None
    if index is not None:
      if len(index) != len(info.shape) or any(s.step not in (None, 1) for s in index):
        raise ValueError(
            f'read({key!r}): index {index} must hold one step-1 slice per axis of '
            f'shape {info.shape}'
        )
      bounds = [s.indices(n)[:2] for s, n in zip(index, info.shape)]
    with safe_open(str(info.file), framework='np') as f:
      if bounds is None or all(b == (0, n) for b, n in zip(bounds, info.shape)):
        return f.get_tensor(key)
      if any(stop <= start for start, stop in bounds):  # safetensors cannot read an empty slice
        return np.empty([max(stop - start, 0) for start, stop in bounds], _NP_DTYPES[info.dtype])
      return f.get_slice(key)[tuple(slice(a, b) for a, b in bounds)]


def component_folder(path: str | os.PathLike, subfolder: str, what: str) -> Path:
  """The folder holding a diffusers component's config.json: `path` itself, or `path`/`subfolder`
  of a pipeline folder (e.g. 'transformer', 'vae'). FileNotFoundError naming both otherwise;
  `what` names the expected class in the message."""
  folder = Path(path)
  if not folder.is_dir():
    raise FileNotFoundError(f'diffusers folder not found: {folder}')
  for candidate in (folder, folder / subfolder):
    if (candidate / 'config.json').is_file():
      return candidate
  raise FileNotFoundError(
      f'no config.json in {folder} or {folder / subfolder}; expected a '
      f'diffusers {what} folder or a pipeline folder with {subfolder}/'
  )


def read_config_json(folder: str | os.PathLike) -> dict[str, Any]:
  """A component folder's config.json as a dict; ValueError naming the file otherwise."""
  config_file = Path(folder) / 'config.json'
  try:
    raw = json.loads(config_file.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f'cannot read {config_file}: {e}') from e
  if not isinstance(raw, dict):
    raise ValueError(f'{config_file} must hold a JSON object, got {type(raw).__name__}')
  return raw


def read_component_config(folder: str | os.PathLike, parse: Callable[[dict[str, Any]], _T]) -> _T:
  """parse(the folder's config.json dict), e.g. a model's config_from_diffusers; a ValueError from
  reading or parsing names the file."""
  config_file = Path(folder) / 'config.json'
  raw = read_config_json(folder)
  try:
    return parse(raw)
  except ValueError as e:
    raise ValueError(f'{config_file}: {e}') from e


def weight_files(folder: str | os.PathLike) -> list[Path]:
  """The safetensors files of a folder: those its one *.safetensors.index.json names, else every
  *.safetensors in it. Pickle weights are never listed (ValueError when nothing else is there)."""
  folder = Path(folder)
  indexes = sorted(folder.glob('*.safetensors.index.json'))
  if len(indexes) > 1:
    raise ValueError(
        f'several safetensors index files in {folder}: ' f'{[i.name for i in indexes]}; keep one'
    )
  if indexes:
    names = set(_weight_map(indexes[0]).values())
    files = sorted(folder / name for name in names)
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
      raise ValueError(f'shard index {indexes[0]} names missing files: {absent}')
    return files
  files = sorted(folder.glob('*.safetensors'))
  if not files:
    raise ValueError(
        f'no *.safetensors weights in {folder} (pickle .bin/.pt files are never '
        'read; re-save with safe_serialization=True)'
    )
  return files


def _weight_map(index: Path) -> dict[str, str]:
  """The index's {key: file name}; ValueError when it is unreadable or names files elsewhere."""
  try:
    weight_map = json.loads(index.read_text())['weight_map']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'cannot read shard index {index}: {e}') from e
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
  ):
    raise ValueError(f'shard index {index}: weight_map must map tensor names to file names')
  for key, name in weight_map.items():
    if Path(name).name != name or name in ('.', '..'):
      raise ValueError(
          f'shard index {index} puts {key!r} in {name!r}; shards must be plain file '
          'names in the same folder'
      )
  return weight_map


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
  """Checkpoint over a folder's safetensors files (see `weight_files`) or over one .safetensors
  file. Reads headers only; ValueError for an unreadable file, a key held by two files, or an
  index that disagrees with its shards."""
  path = Path(path)
  if path.is_file():
    files, index = [path], None
  elif path.is_dir():
    files = weight_files(path)
    indexes = sorted(path.glob('*.safetensors.index.json'))
    index = indexes[0] if indexes else None
  else:
    raise ValueError(
        f'checkpoint not found: {path} (expected a folder of *.safetensors or one '
        '.safetensors file)'
    )
  tensors: dict[str, TensorInfo] = {}
  for f in files:
    try:
      with safe_open(str(f), framework='np') as handle:
        found = {k: handle.get_slice(k) for k in handle.keys()}
        headers = {k: (tuple(s.get_shape()), str(s.get_dtype())) for k, s in found.items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types; report them uniformly
      raise ValueError(f'cannot read safetensors file {f}: {e}') from e
    for key, (shape, dtype) in headers.items():
      if key in tensors:
        raise ValueError(
            f'tensor {key!r} appears in both {tensors[key].file} and {f}; '
            'keep one checkpoint (or variant) per folder'
        )
      if dtype not in _NP_DTYPES:
        raise ValueError(
            f'tensor {key!r} in {f} has dtype {dtype}, which this loader cannot '
            f'read (supported: {sorted(_NP_DTYPES)})'
        )
      tensors[key] = TensorInfo(f, shape, dtype)
  if index is not None:
    weight_map = _weight_map(index)
    for key, name in weight_map.items():
      if key not in tensors or tensors[key].file.name != name:
        where = tensors[key].file if key in tensors else 'no shard'
        raise ValueError(
            f'shard index {index} puts {key!r} in {name}, but {where} holds it; '
            'the index and the shards come from different saves'
        )
    for key, info in tensors.items():
      if key not in weight_map:
        raise ValueError(
            f'tensor {key!r} in {info.file} is not in the shard index {index}; '
            'the index and the shards come from different saves'
        )
  return Checkpoint(path, tuple(files), tensors)


def numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype of a safetensors dtype name ('F32', 'BF16', ...)."""
  return np.dtype(_NP_DTYPES[name])


def flat_params(tree: Any) -> dict[str, Any]:
  """{dotted path: leaf} of an nnx.State or nested dict: the names key tables use."""
  return _flat(tree)


def identity_table(abstract: Any) -> dict[str, TensorSource]:
  """Key table of a checkpoint saved in our own layout: each param's file key is its dotted path
  (params_io's params.safetensors)."""
  return {name: TensorSource((name,)) for name in _flat(abstract)}


def _dotted(path) -> str:
  parts = []
  for k in path:
    for attr in ('key', 'idx', 'name'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '.'.join(parts)


def _pure(tree: Any) -> Any:
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _flat(tree: Any) -> dict[str, Any]:
  """{dotted path: leaf} of an nnx.State or a nested dict (leaves as they are)."""
  leaves = jax.tree_util.tree_flatten_with_path(_pure(tree))[0]
  return {_dotted(path): leaf for path, leaf in leaves}


def _fmt(items, limit: int = 20) -> str:
  items = sorted(items)
  more = f' ... (+{len(items) - limit} more)' if len(items) > limit else ''
  return ', '.join(items[:limit]) + more


def _validate(ckpt: Checkpoint, table: KeyTable, leaves: Mapping[str, Any], label: str) -> None:
  """ValueError (before any data is read) unless the table, the model and the files agree."""
  no_source = set(leaves) - set(table)
  if no_source:  # a module was added to the model without a key-table entry
    raise ValueError(f'the {label} key table has no source for our params: {_fmt(no_source)}')
  no_param = set(table) - set(leaves)
  if no_param:
    raise ValueError(
        f'the {label} key table names params the model does not have: ' f'{_fmt(no_param)}'
    )
  expected, given = tensor_source.file_keys(table), set(ckpt.tensors)
  missing, unexpected = expected - given, given - expected
  if missing or unexpected:
    msg = []
    if missing:
      msg.append(
          f'missing {label} keys ({len(missing)}): {_fmt(missing)} (searched '
          f'{", ".join(str(f) for f in ckpt.files)})'
      )
    if unexpected:
      msg.append(
          f'unexpected {label} keys ({len(unexpected)}): '
          f'{_fmt(f"{k} (in {ckpt.tensors[k].file})" for k in unexpected)}'
      )
    raise ValueError(f'checkpoint {ckpt.path} does not match the model: ' + '; '.join(msg))
  for name, leaf in leaves.items():
    source = table[name]
    want = tuple(leaf.shape[1:] if source.stacked else leaf.shape)
    floating = jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
    for key in source.keys:
      info = ckpt.tensors[key]
      if floating and not jax.numpy.issubdtype(_NP_DTYPES[info.dtype], jax.numpy.floating):
        raise ValueError(
            f'{label} key {key!r} in {info.file} has dtype {info.dtype}, expected a '
            f'floating-point tensor (F32, BF16 or F16) for our param {name}'
        )
    if source.stacked and (not leaf.shape or leaf.shape[0] != len(source.keys)):
      raise ValueError(
          f'our param {name} has shape {tuple(leaf.shape)} but the {label} key '
          f'table stacks {len(source.keys)} keys along its first axis'
      )
    for key in source.keys:
      info = ckpt.tensors[key]
      try:
        got = source.our_shape(info.shape)[1 if source.stacked else 0 :]
      except ValueError as e:
        raise ValueError(
            f'{label} key {key!r} in {info.file}: {e} (our param {name} is ' f'{tuple(leaf.shape)})'
        ) from e
      if got != want:
        raise ValueError(
            f'{label} key {key!r} has shape {info.shape}, expected one that gives '
            f'{want} for our param {name} (it gives {got}); file {info.file}'
        )


def check(checkpoint: Checkpoint, table: KeyTable, abstract: Any, *, label: str) -> None:
  """What `load` checks before it reads any data, without loading: every param of `abstract`
  (ShapeDtypeStructs) has its key(s) in `checkpoint`, of a shape that fits and a floating dtype
  where the param is floating, and no file key is left over. ValueError naming the key, its file
  and what was expected; called when a run is built, so a bad checkpoint is one line then."""
  _validate(checkpoint, table, _flat(abstract), label)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _read_part(ckpt: Checkpoint, source: TensorSource, key: str, bounds: Bounds) -> np.ndarray:
  """The slice `bounds` (our per-key axes) of one file tensor, in our layout (maybe a view)."""
  ours = tuple(slice(a, b) for a, b in bounds)
  if source.shape is not None:  # a size-1 reshape: such tensors are small, read them whole
    return source.to_ours(ckpt.read(key))[ours]
  if source.perm is None:
    return ckpt.read(key, ours)
  file_index = [slice(None)] * len(source.perm)
  for j, axis in enumerate(source.perm):  # our axis j is file axis perm[j]
    file_index[axis] = ours[j]
  return np.transpose(ckpt.read(key, tuple(file_index)), source.perm)


def _staging(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialised host buffer that a transfer copies from and then lets go of.

  XLA's CPU client adopts a 64-byte-aligned host buffer as device memory instead of copying it
  (jax ignores may_alias=False for numpy inputs), which would keep every staging buffer alive as
  part of the loaded params. Starting the buffer at 32 mod 64 (aligned for vectorised casts, never
  for adoption) makes CPU behave as accelerators do: copy, then release.
  """
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = (32 - raw.ctypes.data) % 64
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def _read_shard(
    ckpt: Checkpoint, source: TensorSource, bounds: Bounds, dtype: np.dtype
) -> np.ndarray:
  """One device's slice `bounds` of our param in `dtype`, in a fresh staging buffer."""
  out = _staging(tuple(b - a for a, b in bounds), dtype)
  if not source.stacked:
    out[...] = _read_part(ckpt, source, source.keys[0], bounds)
    return out
  (first, last), rest = bounds[0], bounds[1:]
  for i, key in enumerate(source.keys[first:last]):  # the stacked axis picks the keys to read
    out[i] = _read_part(ckpt, source, key, rest)
  return out


class _Releases:
  """Waits until each transfer has let go of its host buffer, so that the next read does not pile
  up on it. The runtime drops its reference from another thread once the copy is done and hands
  it back to Python at its next garbage collection, which jax runs from Python's gc callbacks (a
  young-generation collection is cheap). A runtime that keeps the buffer (adopts it as device
  memory) times out once and is not waited for again in this load."""

  def __init__(self, timeout_s: float = 1.0):
    self.timeout_s = timeout_s
    self.enabled = True

  def wait(self, ref: weakref.ref) -> None:
    deadline = time.monotonic() + self.timeout_s
    while self.enabled and ref() is not None:
      gc.collect(0)
      if ref() is None:
        return
      if time.monotonic() > deadline:
        self.enabled = False
        return
      time.sleep(1e-4)


def _load_one(
    ckpt: Checkpoint,
    source: TensorSource,
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    dtype: np.dtype,
    releases: _Releases,
) -> jax.Array:
  # Devices holding the same slice (replicas) share one read and one host buffer.
  groups: dict[Bounds, list[jax.Device]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    groups.setdefault(_bounds(index, shape), []).append(device)
  arrays = []
  for bounds, devices in groups.items():
    host = _read_shard(ckpt, source, bounds, dtype)
    put = jax.device_put([host] * len(devices), devices, may_alias=False)
    arrays.extend(jax.block_until_ready(put))
    owner = host
    while isinstance(owner.base, np.ndarray):  # the runtime may hold any view of the buffer
      owner = owner.base
    released = weakref.ref(owner)
    del host, put, owner
    releases.wait(released)
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load(
    checkpoint: Checkpoint,
    table: KeyTable,
    abstract: Any,
    shardings: Any,
    dtype: Any = None,
    *,
    label: str = 'checkpoint',
) -> Any:
  """Loads every param of `abstract` from `checkpoint`, each straight onto its sharding.

  checkpoint: from `open_checkpoint`. table: our dotted param path -> TensorSource (e.g.
    convert.diffusers_key_table(config), or identity_table(abstract)).
  abstract: nnx.State or nested dict of ShapeDtypeStructs (our layout and shapes).
  shardings: the matching tree of jax Shardings (any mesh, several axes), or one Sharding for all.
  dtype: the dtype of every loaded array (None: each abstract leaf's dtype).
  label: names the checkpoint kind in error messages ('diffusers', 'params', ...).
  Returns `abstract`'s structure with jax.Arrays. Raises ValueError, before reading any data, for
  a missing, unexpected or mis-shaped key (naming the key, its file and both shapes).
  """
  leaves = _flat(abstract)
  if isinstance(shardings, jax.sharding.Sharding):
    placement = dict.fromkeys(leaves, shardings)
  else:
    placement = _flat(shardings)
    if set(placement) != set(leaves):
      raise ValueError(
          f'shardings do not match the abstract tree: missing '
          f'{_fmt(set(leaves) - set(placement))}, extra '
          f'{_fmt(set(placement) - set(leaves))}'
      )
  for name, sharding in placement.items():
    if not isinstance(sharding, jax.sharding.Sharding):
      raise ValueError(f'shardings[{name}] is {type(sharding).__name__}, not a jax Sharding')
  _validate(checkpoint, table, leaves, label)
  loaded, releases = {}, _Releases()
  for name, leaf in leaves.items():
    want = np.dtype(dtype if dtype is not None else leaf.dtype)
    loaded[name] = _load_one(
        checkpoint, table[name], tuple(leaf.shape), placement[name], want, releases
    )
  pure = _pure(abstract)
  paths, treedef = jax.tree_util.tree_flatten_with_path(pure)
  out = jax.tree_util.tree_unflatten(treedef, [loaded[_dotted(p)] for p, _ in paths])
  if isinstance(abstract, nnx.State):
    state = jax.tree.map(lambda x: x, abstract)  # fresh Variables; the caller's tree is untouched
    nnx.replace_by_pure_dict(state, out)
    return state
  return out


def load_module(
    path: str | os.PathLike,
    table: KeyTable,
    graphdef: nnx.GraphDef,
    abstract: Any,
    *,
    label: str = 'diffusers',
) -> Any:
  """nnx.merge(graphdef, params) with every param of `abstract` (nnx.State of ShapeDtypeStructs)
  streamed from the checkpoint at `path` (see `open_checkpoint`) through `table` onto the first
  local device: a single-device model (e.g. a VAE) with no random init. Errors as `load`."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  state = load(open_checkpoint(path), table, abstract, device, label=label)
  return nnx.merge(graphdef, state)
