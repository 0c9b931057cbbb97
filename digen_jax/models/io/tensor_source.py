"""Where each of our parameters comes from in a checkpoint file: the one description that the
in-memory converters and the streamed (sliced, per-device) loader both read.

A key table maps our dotted parameter path (as in the model's nnx.State, e.g.
"blocks.attn.to_q.kernel") to a `TensorSource`: the file key(s), how the file's axes map to ours,
and whether per-layer tensors are stacked along a new leading axis (layers under lax.scan).

    table = convert.diffusers_key_table(model_config)      # {"blocks.attn.to_q.kernel": TensorSource(...)}
    value = tensor_source.gather(table["img_in.kernel"], state_dict.__getitem__)   # full array, our layout

Tables are written two ways, both with the builders here: the transformers list their Linear layers
and block stacks (`build_key_table`, `BlockStack`); the VAEs' leaf modules each give their own
params' sources (`table_from_modules`, most of them through `weight_and_bias`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple

from flax import nnx
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSource:
  """keys: the file key, or one per layer when `stacked`.
  perm: np.transpose axes taking one file tensor to our layout (None: same layout).
  stacked: the keys' tensors are stacked along a new leading axis (our axis 0).
  shape: our per-key shape when it differs from the permuted file shape only by size-1 axes
    (e.g. a norm's gamma saved as [C, 1, 1] that we hold as [C]); None: the permuted shape."""

  keys: tuple[str, ...]
  perm: tuple[int, ...] | None = None
  stacked: bool = False
  shape: tuple[int, ...] | None = None

  def __post_init__(self):
    if not self.keys:
      raise ValueError('TensorSource needs at least one key')
    if len(self.keys) > 1 and not self.stacked:
      raise ValueError(f'TensorSource with {len(self.keys)} keys must be stacked: {self.keys[:3]}')

  def our_shape(self, file_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Our full shape given one key's shape in the file (checks a `shape` reshape is legal)."""
    if self.perm and len(file_shape) != len(self.perm):
      raise ValueError(
          f'{self.keys[0]}: file shape {tuple(file_shape)} has rank '
          f'{len(file_shape)}, expected {len(self.perm)}'
      )
    permuted = tuple(file_shape[i] for i in self.perm) if self.perm else tuple(file_shape)
    if self.shape is not None:
      if [d for d in self.shape if d != 1] != [d for d in permuted if d != 1]:
        raise ValueError(
            f'{self.keys[0]}: file shape {tuple(file_shape)} cannot be held as '
            f'{self.shape} (only size-1 axes may differ)'
        )
      permuted = tuple(self.shape)
    return ((len(self.keys),) if self.stacked else ()) + permuted

  def to_ours(self, array: np.ndarray) -> np.ndarray:
    """One file tensor in our (per-key) layout."""
    out = np.transpose(array, self.perm) if self.perm else array
    return out.reshape(self.shape) if self.shape is not None else out


KeyTable = Mapping[str, TensorSource]
# (file module path, our module path) pairs of Linear layers, e.g.
# ("img_mlp.net.0.proj", ("img_mlp", "fc1")).
LinearEntries = tuple[tuple[str, tuple[str, ...]], ...]


def weight_and_bias(
    ours: str,
    theirs: str,
    perm: tuple[int, ...] | None,
    shape: tuple[int, ...] | None = None,
) -> dict[str, TensorSource]:
  """The sources of a layer with a kernel and a bias: our `ours`.kernel <- `theirs`.weight (axes
  `perm`, held as `shape`: see TensorSource) and `ours`.bias <- `theirs`.bias."""
  return {
      f'{ours}.kernel': TensorSource((f'{theirs}.weight',), perm=perm, shape=shape),
      f'{ours}.bias': TensorSource((f'{theirs}.bias',)),
  }


class BlockStack(NamedTuple):
  """A stack of file blocks held as ONE module with a leading layer axis (stacking.stacked_blocks).

  name: our module name ("blocks"); prefix: the file's module list ("transformer_blocks"), layer
  i's keys start with f"{prefix}.{i}."; linears / tensors: as for ``build_key_table``, relative
  to one block.
  """

  name: str
  prefix: str
  num_layers: int
  linears: LinearEntries
  tensors: LinearEntries = ()


def build_key_table(
    linears: LinearEntries, tensors: LinearEntries, stacks: tuple[BlockStack, ...] = ()
) -> dict[str, TensorSource]:
  """Our dotted param path -> its file source.

  linears: (file module prefix, our module path) pairs of Linear layers: weight [out, in] ->
  kernel [in, out] (transposed), bias -> bias. tensors: (file key, our param path) pairs taken as
  they are (norm scales). stacks: per-block linears and tensors, stacked along our leading layer
  axis (one file key per layer).
  """
  table: dict[str, TensorSource] = {}
  for prefix, path in linears:
    table.update(weight_and_bias('.'.join(path), prefix, perm=(1, 0)))
  for key, path in tensors:
    table['.'.join(path)] = TensorSource((key,))
  for stack in stacks:
    layers = range(stack.num_layers)
    for prefix, path in stack.linears:
      name = '.'.join((stack.name,) + path)
      table[f'{name}.kernel'] = TensorSource(
          tuple(f'{stack.prefix}.{i}.{prefix}.weight' for i in layers), perm=(1, 0), stacked=True
      )
      table[f'{name}.bias'] = TensorSource(
          tuple(f'{stack.prefix}.{i}.{prefix}.bias' for i in layers), stacked=True
      )
    for key, path in stack.tensors:
      table['.'.join((stack.name,) + path)] = TensorSource(
          tuple(f'{stack.prefix}.{i}.{key}' for i in layers), stacked=True
      )
  return table


def gather(source: TensorSource, read: Callable[[str], np.ndarray]) -> np.ndarray:
  """The whole parameter in our layout; read(key) returns one file tensor (np.ndarray)."""
  parts = [source.to_ours(np.asarray(read(k))) for k in source.keys]
  return np.stack(parts) if source.stacked else parts[0]


def file_keys(table: KeyTable) -> set[str]:
  """Every file key a table reads."""
  return {k for s in table.values() for k in s.keys}


def fmt_keys(keys, limit: int = 20) -> str:
  """Sorted keys, the first `limit` of them, for error messages."""
  keys = sorted(keys)
  more = f' ... (+{len(keys) - limit} more)' if len(keys) > limit else ''
  return ', '.join(keys[:limit]) + more


def table_from_modules(model, leaf_types: tuple[type, ...], what: str) -> dict[str, TensorSource]:
  """The key table of a model whose every param lives in a leaf module of one of `leaf_types`,
  each with a static `sources(path, shapes)` giving its params' TensorSources (path: the leaf's
  dotted path; shapes: {dotted param path: our shape}). `model` may be abstract (nnx.eval_shape).
  ValueError (naming `what`) when a param is held by a module that is not such a leaf."""
  shapes = {
      '.'.join(map(str, p)): tuple(v.get_value().shape)
      for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }
  table: dict[str, TensorSource] = {}
  for path, module in nnx.iter_modules(model):
    if isinstance(module, leaf_types):
      table.update(module.sources('.'.join(map(str, path)), shapes))
  if set(table) != set(shapes):  # a module holding params that is not a known leaf
    raise ValueError(f'{what} misses our params {sorted(set(shapes) - set(table))[:10]}')
  return table


def fill_params(model, table: KeyTable, state_dict: Mapping[str, np.ndarray], what: str):
  """Sets every nnx.Param of `model` IN PLACE from `state_dict` ({file key: array, in the file's
  layout}) through `table`, cast to each param's dtype; returns `model` (which may be abstract,
  built under nnx.eval_shape: no random init is needed). ValueError names params without a
  source, missing / unexpected file keys, or a key whose shape does not give our param's.
  `what` names the model in messages (e.g. 'MMDiT')."""
  params = {'.'.join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  unset = sorted(set(params) - set(table))
  if unset:  # a module was added without a key-table entry
    raise ValueError(
        f'{what}: the key table has no checkpoint source for our params: ' f'{fmt_keys(unset)}'
    )
  expected, given = file_keys(table), set(state_dict.keys())
  missing, unexpected = expected - given, given - expected
  if missing or unexpected:
    msg = [
        f'{label} diffusers keys ({len(keys)}): {fmt_keys(keys)}'
        for label, keys in (('missing', missing), ('unexpected', unexpected))
        if keys
    ]
    raise ValueError(f'{what} state dict does not match its config: ' + '; '.join(msg))
  for name, var in params.items():
    source, target = table[name], var.get_value()
    want = tuple(target.shape[1:] if source.stacked else target.shape)
    for key in source.keys:
      file_shape = tuple(np.shape(state_dict[key]))
      try:
        got = source.our_shape(file_shape)[1 if source.stacked else 0 :]
      except ValueError as e:
        got = f'none: {e}'
      if got != want:
        raise ValueError(
            f'diffusers key {key!r} has shape {file_shape}, expected one that gives '
            f'{want} for our param {name} (it gives {got})'
        )
    var.set_value(jnp.asarray(gather(source, state_dict.__getitem__), dtype=target.dtype))
  return model
