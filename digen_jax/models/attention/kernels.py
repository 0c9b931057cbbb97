"""One attention function for every family (MMDiT, FLUX, the VAEs' mid-block, video to come).

    attention(q, k, v, key_mask=None, implementation='auto') -> [B, Sq, H, Dh]

q, k, v are [B, S, H, Dh] (the layout of jax.nn.dot_product_attention and cuDNN), q already
multiplied by the softmax scale (models fold 1/sqrt(Dh) into q, exact for power-of-two head
dims). key_mask [B, Sk] bool marks the keys a query may see (None: all); no row may be empty.

Implementations:
  portable  the XLA path, float32 statistics, equal to diffusers' attention to float32 rounding
            (the parity tests run it). It materialises [B, H, Sq, Sk] logits, so queries go in
            chunks (`query_chunk`, or automatically past LOGITS_BUDGET bytes) each
            rematerialised in the backward pass: memory grows with Sq x chunk, not Sq x Sk.
  cudnn     jax.nn.dot_product_attention(implementation='cudnn'): cuDNN's fused flash attention
            on NVIDIA GPUs, never materialising S x S (bf16/fp16 operands, head dim a multiple
            of 8 up to 128). The key mask travels the way the kernel accepts it, as per-sample
            key lengths: keys are permuted (stably) so the visible ones come first. Attention
            is invariant to a permutation of its keys and values, so this is exact.
  xla       the same permutation and key lengths through jax.nn.dot_product_attention's XLA
            path: what the fused path computes, runnable on any backend (tests on the CPU).
  auto      cudnn where it applies (GPU, supported dtype and head dim), else portable. TPU gets
            portable: its Pallas flash kernels are not wired in yet.

`fused_unsupported` says why the fused path cannot run (None when it can); configs forcing
'fused' are checked with it when the run is built, before anything compiles.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ('auto', 'portable', 'cudnn', 'xla')
# The config-level choice (config.model.attention): 'fused' is cudnn.
CONFIG_CHOICES = ('auto', 'portable', 'fused')

# Added to the logits of hidden keys. Finite (not -inf) so that no inf - inf can appear in the
# backward pass; exp(-1e30 - max) is exactly 0 in float32: a hidden key gets probability 0.
MASK_BIAS = -1e30
# The portable path chunks its queries once the float32 logits of one call would exceed this
# many bytes (the VAE mid-block at 1328 px: 27,556 positions, 3 GiB of logits unchunked).
LOGITS_BUDGET = 1 << 30
_MIN_CHUNK = 256
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
_FUSED_MAX_HEAD_DIM = 128


def fused_unsupported(platform: str, dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused attention cannot run `dtype` operands of `head_dim` on `platform`
  (jax.default_backend(): 'gpu', 'cpu', 'tpu'), or None when it can."""
  if platform != 'gpu':
    return f'it needs an NVIDIA GPU (cuDNN); this process runs on {platform!r}'
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _FUSED_DTYPES]:
    return (
        f'cuDNN fused attention takes bfloat16/float16 operands, the compute dtype is '
        f'{jnp.dtype(dtype).name} (set optim.compute_dtype=bfloat16)'
    )
  if head_dim % 8 or head_dim > _FUSED_MAX_HEAD_DIM:
    return (
        f'cuDNN fused attention takes head dims that are multiples of 8 up to 128, got {head_dim}'
    )
  return None


def resolve(implementation: str, dtype, head_dim: int, platform: str | None = None) -> str:
  """The implementation a call runs: 'auto' -> 'cudnn' where fused_unsupported is None, else
  'portable'; anything else as given (config.model.attention's 'fused' is 'cudnn')."""
  if implementation == 'fused':
    return 'cudnn'
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f'attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}'
    )
  if implementation != 'auto':
    return implementation
  platform = platform or jax.default_backend()
  return 'cudnn' if fused_unsupported(platform, dtype, head_dim) is None else 'portable'


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_mask: jax.Array | None = None,
    *,
    implementation: str = 'auto',
    query_chunk: int | None = None,
) -> jax.Array:
  """Softmax attention. q [B, Sq, H, Dh] (pre-scaled), k, v [B, Sk, H, Dh], key_mask [B, Sk]
  bool or None -> [B, Sq, H, Dh] in v.dtype. `implementation` and `query_chunk` (portable only)
  as in the module docstring."""
  if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
    raise ValueError(f'attention: q {q.shape}, k {k.shape}, v {v.shape} must be [B, S, H, Dh]')
  if key_mask is not None and key_mask.shape != k.shape[:2]:
    raise ValueError(f'attention: key_mask {key_mask.shape} must be [B, Sk]={k.shape[:2]}')
  impl = resolve(implementation, q.dtype, q.shape[-1])
  if impl == 'portable':
    return _portable(q, k, v, key_mask, query_chunk)
  return _library(q, k, v, key_mask, impl)


def _library(q, k, v, key_mask, impl: str) -> jax.Array:
  """jax.nn.dot_product_attention (cudnn or xla), the mask as key lengths over permuted keys."""
  lengths = None
  if key_mask is not None:
    visible = key_mask.astype(bool)
    # Visible keys first, each group in its original order (a permutation of keys and values).
    order = jnp.argsort(~visible, axis=1, stable=True)
    k = jnp.take_along_axis(k, order[:, :, None, None], axis=1)
    v = jnp.take_along_axis(v, order[:, :, None, None], axis=1)
    lengths = jnp.sum(visible, axis=1, dtype=jnp.int32)
  return jax.nn.dot_product_attention(
      q, k, v, scale=1.0, key_value_seq_lengths=lengths, implementation=impl
  )


def portable_chunk(batch: int, heads: int, sq: int, sk: int, budget: int = LOGITS_BUDGET) -> int:
  """Query rows per chunk so that one chunk's float32 logits [B, H, chunk, Sk] fit `budget`
  bytes: sq (no chunking) when the whole fits, else the largest power of two that does (at
  least 256)."""
  if batch * heads * sq * sk * 4 <= budget:
    return sq
  rows = max(1, budget // (batch * heads * sk * 4))
  return max(_MIN_CHUNK, 1 << int(math.floor(math.log2(rows))))


def _portable(q, k, v, key_mask, query_chunk) -> jax.Array:
  b, sq, h, _ = q.shape
  bias = None
  if key_mask is not None:
    bias = jnp.where(key_mask.astype(bool), 0.0, MASK_BIAS).astype(jnp.float32)
  chunk = query_chunk or portable_chunk(b, h, sq, k.shape[1])

  def rows(qc):  # [B, rows, H, Dh] -> same
    logits = jnp.einsum('bqhd,bkhd->bhqk', qc, k, preferred_element_type=jnp.float32)
    if bias is not None:
      logits = logits + bias[:, None, None, :]
    # Softmax is invariant to the shift; stop_gradient keeps the max out of the backward graph.
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)  # [B, H, rows, 1]
    # The denominator divides the [rows, Dh] output, not the [rows, Sk] probabilities.
    out = jnp.einsum('bhqk,bkhd->bhqd', p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return jnp.swapaxes(out / denom, 1, 2).astype(v.dtype)

  if chunk >= sq:
    return rows(q)
  n = -(-sq // chunk)
  # Padded query rows only add rows that are sliced off: softmax is per row.
  qp = jnp.pad(q, ((0, 0), (0, n * chunk - sq), (0, 0), (0, 0)))
  chunks = jnp.moveaxis(qp.reshape(b, n, chunk, *q.shape[2:]), 1, 0)
  # Each chunk's logits are recomputed in the backward pass rather than kept: memory stays one
  # chunk's [B, H, chunk, Sk], whatever Sq is.
  out = jax.lax.map(jax.checkpoint(rows), chunks)  # [n, B, chunk, H, Dh]
  return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *q.shape[2:])[:, :sq]


def flops(batch: int, heads: int, sq: int, sk: int, head_dim: int) -> float:
  """Matmul FLOPs of one attention call (QK^T and PV, 2 per multiply-add)."""
  return 4.0 * batch * heads * sq * sk * head_dim
