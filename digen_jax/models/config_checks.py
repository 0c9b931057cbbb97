"""Field checks shared by the model configs (transformers and VAEs).

Each raises a ValueError naming `Owner.field` and the bad value, so a wrong config.model entry is
reported when the config is made, before anything is built or compiled.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from digen_jax.models.attention import kernels as attention_lib


def require_positive_ints(owner: str, config: Any, names: Iterable[str]) -> None:
  """Every field in `names` is an int (not a bool) > 0."""
  for name in names:
    value = getattr(config, name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
      raise ValueError(f'{owner}.{name} must be a positive int, got {value!r}')


def require_positive(owner: str, config: Any, names: Iterable[str]) -> None:
  """Every field in `names` is > 0 (a number; NaN fails)."""
  for name in names:
    if not getattr(config, name) > 0:
      raise ValueError(f'{owner}.{name} must be > 0, got {getattr(config, name)}')


def require_bools(owner: str, config: Any, names: Iterable[str]) -> None:
  """Every field in `names` is a bool (numpy's included)."""
  for name in names:
    if not isinstance(getattr(config, name), (bool, np.bool_)):
      raise ValueError(f'{owner}.{name} must be a bool, got {getattr(config, name)!r}')


def check_attention_choice(owner: str, choice: str) -> None:
  """A model config's `attention` field: a config choice ('auto', 'portable', 'fused') or an
  implementation of models/attention/kernels.py ('cudnn', 'xla')."""
  known = tuple(dict.fromkeys(attention_lib.CONFIG_CHOICES + attention_lib.IMPLEMENTATIONS))
  if choice not in known:
    raise ValueError(f'{owner}.attention must be one of {known}, got {choice!r}')


def check_rope_axes(owner: str, axes_dims: tuple[int, ...], head_dim: int, axes: str) -> None:
  """axes_dims_rope: 3 positive even ints (`axes` says what the three are) summing to head_dim."""
  if len(axes_dims) != 3 or any(a <= 0 or a % 2 for a in axes_dims):
    raise ValueError(
        f'{owner}.axes_dims_rope must be 3 positive even ints ({axes}), got {axes_dims}'
    )
  if sum(axes_dims) != head_dim:
    raise ValueError(
        f'{owner}.axes_dims_rope must sum to attention_head_dim={head_dim}, '
        f'got sum({axes_dims}) = {sum(axes_dims)}'
    )
