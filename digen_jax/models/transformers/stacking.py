"""Stacks of identical blocks held as ONE module whose params carry a leading [num_layers] axis.

Every transformer family builds its block stacks with `stacked_blocks` and runs them with
`run_stacked`: under lax.scan one block is compiled whatever num_layers is, or unrolled into a
Python loop (compile time grows with num_layers, but under autodiff nothing is stacked across
layers: a scan zero-fills [num_layers, ...] residual buffers, writes each layer's residuals into
them and slices them back out in the backward pass). The checkpoint converters map one diffusers
key per layer onto the stacked axis (tensor_source.BlockStack).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def stacked_blocks(
    make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs
) -> nnx.Module:
  """ONE module whose params carry a leading [num_layers] axis: make(rngs) vmapped over split
  rngs (each layer its own init). Run it with ``run_stacked``."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_blocks(block_rngs):
    return make(block_rngs)

  return make_blocks(rngs)


def run_stacked(
    blocks: nnx.Module,
    carry: Any,
    call: Callable[[nnx.Module, Any], Any],
    *,
    num_layers: int,
    remat: bool,
    scan_layers: bool,
) -> Any:
  """carry = call(block_i, carry) for the layers i of `blocks` (from ``stacked_blocks``), in order.

  scan_layers: under lax.scan (one compiled block), else unrolled (see the module docstring).
  remat: rematerialise each layer in the backward pass (jax.checkpoint).
  """
  graphdef, block_state = nnx.split(blocks)

  def body(carry, layer_state):
    return call(nnx.merge(graphdef, layer_state), carry), None

  if remat:
    body = jax.checkpoint(body)
  if scan_layers:
    carry, _ = jax.lax.scan(body, carry, block_state)
    return carry
  # One split per stacked param (its transpose is one concatenate of the layers' gradients;
  # indexing a[i] instead would transpose to a zero-padded full-stack gradient per layer).
  parts = jax.tree.map(lambda a: jnp.split(a, num_layers, axis=0), block_state)
  for i in range(num_layers):
    layer_state = jax.tree.map(lambda p: p[i][0], parts, is_leaf=lambda x: isinstance(x, list))
    carry, _ = body(carry, layer_state)
  return carry
