"""Random initialisation of an nnx module as one compiled program."""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
from flax import nnx

M = TypeVar('M', bound=nnx.Module)


def build(make: Callable[[], M]) -> M:
  """`make()` (a module constructor that draws its params from nnx.Rngs) run under one jit.

  The values are bit-identical to calling make() eagerly (the same threefry draws), but eager
  construction compiles each initializer of each distinct shape on its own: about 5 s of every
  tiny run's start on a CPU, none of it cacheable. One program compiles once and is then read
  from the persistent compilation cache.
  """
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  state = jax.jit(lambda: nnx.state(make()))()
  return nnx.merge(graphdef, state)
