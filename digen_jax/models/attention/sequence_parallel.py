"""Attention with each sample's tokens split over devices ("Ulysses", DeepSpeed-Ulysses,
arXiv 2309.14509): exact, one jitted program.

The split is an argument: `token_mesh`, a 2-D Mesh (samples over its first axis, each sample's
tokens over its second, of size s; parallel/sequence.py builds it from a role's mesh), which the
programs pass to the family's forward and the model passes down to every block (its `token_mesh`
keyword). With a mesh:

  * `attention` runs models/attention/kernels.py's attention under jax.shard_map on that mesh. Self-
    attention (as many keys as queries): q, k, v arrive token-split [B/d, S/s, H, Dh]; one
    all-to-all per operand makes them head-split [B/d, S, H/s, Dh], each device attends over the
    whole sequence for its H/s heads (the fused kernel where it runs), and one all-to-all brings
    the output back token-split. Cross-attention (keys of another length: Wan's text): the
    queries stay token-split and every device holds all keys; no communication. Attention is
    per query row and per head, so both are exact. Tokens (and samples) the mesh does not
    divide are padded; padded keys are masked, padded rows sliced off.
  * `constrain` lays a token stream [B, S, ...] out token-split (a sharding constraint), so the
    layers between attentions (norms, projections, feed-forward) run on S/s tokens a device.

With None both are the identity / plain attention.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _axes(mesh: Mesh) -> tuple[str, str]:
  """(samples, tokens): the axis names of a token mesh; ValueError for any other mesh."""
  if len(mesh.axis_names) != 2:
    raise ValueError(
        f'token_mesh must be a (samples, tokens) mesh (parallel/sequence.token_mesh), got axes '
        f'{mesh.axis_names}'
    )
  return tuple(mesh.axis_names)


def constrain(x: jax.Array, token_mesh: Mesh | None) -> jax.Array:
  """x [B, S, ...] laid out samples x tokens on `token_mesh` (unchanged with None)."""
  if token_mesh is None:
    return x
  samples, tokens = _axes(token_mesh)
  spec = P(samples, tokens, *([None] * (x.ndim - 2)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(token_mesh, spec))


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_mask: jax.Array | None,
    attend: Callable[..., jax.Array],
    token_mesh: Mesh | None,
) -> jax.Array:
  """attend(q, k, v, key_mask) -> [B, Sq, H, Dh] (models/attention/kernels.py's signature), run split
  over `token_mesh` (module docstring); plain attend with None. q [B, Sq, H, Dh] (pre-scaled),
  k, v [B, Sk, H, Dh], key_mask [B, Sk] bool or None."""
  if token_mesh is None:
    return attend(q, k, v, key_mask)
  mesh = token_mesh
  samples, tokens = _axes(mesh)
  d, s = mesh.shape[samples], mesh.shape[tokens]
  b, sq, h, _ = q.shape
  sk = k.shape[1]
  self_attention = sq == sk
  if self_attention and h % s:
    raise ValueError(
        f'sequence-parallel attention gives each of {s} devices whole heads: {h} heads do not '
        f'divide (config.parallel.sequence must divide model.num_attention_heads)'
    )
  # Padded keys are hidden; padded sample rows see every real key (no row may be empty).
  if self_attention and (sk % s or key_mask is not None):
    visible = jnp.ones((b, sk), bool) if key_mask is None else key_mask.astype(bool)
    key_mask = _pad_to(_pad_to(visible, 1, s, False), 0, d, True)
  elif key_mask is not None:
    key_mask = _pad_to(key_mask.astype(bool), 0, d, True)
  q = _pad_to(_pad_to(q, 1, s), 0, d)
  k, v = (_pad_to(_pad_to(a, 1, s if self_attention else 1), 0, d) for a in (k, v))

  split = P(samples, tokens, None, None)
  whole = P(samples, None, None, None)
  if self_attention:

    def body(q, k, v, mask):
      # token-split [b, S/s, H, Dh] <-> head-split [b, S, H/s, Dh]
      to_heads = lambda a: jax.lax.all_to_all(a, tokens, 2, 1, tiled=True)
      out = attend(to_heads(q), to_heads(k), to_heads(v), mask)
      return jax.lax.all_to_all(out, tokens, 1, 2, tiled=True)

    kv_spec = split
  else:

    def body(q, k, v, mask):
      return attend(q, k, v, mask)

    kv_spec = whole
  mask_spec = P(samples, None)
  if key_mask is None:
    in_specs, args = (split, kv_spec, kv_spec), (q, k, v)
    run = lambda q, k, v: body(q, k, v, None)
  else:
    in_specs, args, run = (split, kv_spec, kv_spec, mask_spec), (q, k, v, key_mask), body
  out = jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=split)(*args)
  return out[:b, :sq]
