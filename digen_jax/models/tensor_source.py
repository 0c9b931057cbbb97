"""Where each of our parameters comes from in a checkpoint file: the one description that the
in-memory converters and the streamed (sliced, per-device) loader both read.

A key table maps our dotted parameter path (as in the model's nnx.State, e.g.
"blocks.attn.to_q.kernel") to a `TensorSource`: the file key(s), how the file's axes map to ours,
and whether per-layer tensors are stacked along a new leading axis (layers under lax.scan).

    table = convert.diffusers_key_table(model_config)      # {"blocks.attn.to_q.kernel": TensorSource(...)}
    value = tensor_source.gather(table["img_in.kernel"], state_dict.__getitem__)   # full array, our layout
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

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
      raise ValueError(f'{self.keys[0]}: file shape {tuple(file_shape)} has rank '
                       f'{len(file_shape)}, expected {len(self.perm)}')
    permuted = tuple(file_shape[i] for i in self.perm) if self.perm else tuple(file_shape)
    if self.shape is not None:
      if [d for d in self.shape if d != 1] != [d for d in permuted if d != 1]:
        raise ValueError(f'{self.keys[0]}: file shape {tuple(file_shape)} cannot be held as '
                         f'{self.shape} (only size-1 axes may differ)')
      permuted = tuple(self.shape)
    return ((len(self.keys),) if self.stacked else ()) + permuted

  def to_ours(self, array: np.ndarray) -> np.ndarray:
    """One file tensor in our (per-key) layout."""
    out = np.transpose(array, self.perm) if self.perm else array
    return out.reshape(self.shape) if self.shape is not None else out


KeyTable = Mapping[str, TensorSource]


def gather(source: TensorSource, read: Callable[[str], np.ndarray]) -> np.ndarray:
  """The whole parameter in our layout; read(key) returns one file tensor (np.ndarray)."""
  parts = [source.to_ours(np.asarray(read(k))) for k in source.keys]
  return np.stack(parts) if source.stacked else parts[0]


def file_keys(table: KeyTable) -> set[str]:
  """Every file key a table reads."""
  return {k for s in table.values() for k in s.keys}
