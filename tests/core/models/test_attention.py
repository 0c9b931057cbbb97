"""models/attention/kernels.py: the one attention function of every family.

The portable path is the one the diffusers parity tests run (tests/core/models/test_mmdit_parity.py,
test_flux_parity.py, test_vae.py); here it is checked against a float64 softmax, the fused path's
plumbing (keys permuted so the visible ones come first, the mask passed as key lengths) through
jax.nn.dot_product_attention's XLA path against it, the query chunking against the whole, and on
a GPU cuDNN's fused kernel against the portable path to bf16 tolerance.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.models.attention import kernels as attention_lib
from digen_jax.models.transformers import mmdit

# bf16 tolerance of cuDNN fused vs portable (both bf16 operands, float32 softmax statistics):
# outputs are convex combinations of bf16 values (|v| <= ~4 here), so they agree to a few bf16
# ulps of the output scale: |fused - portable| <= 2e-2 + 2e-2 |portable|.
BF16_ATOL = BF16_RTOL = 2e-2


def _qkv(rng, b=2, sq=13, sk=13, h=3, d=8, dtype=jnp.float32):
  q = rng.normal(size=(b, sq, h, d)) / np.sqrt(d)
  k, v = rng.normal(size=(b, sk, h, d)), rng.normal(size=(b, sk, h, d))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _masks(rng, b, sk):
  """A suffix-padded row, a mask with holes (visible keys not first) and an all-visible row."""
  m = np.ones((b, sk), bool)
  m[0, sk - 4 :] = False
  if b > 1:
    m[1, ::3] = False
  return jnp.asarray(m)


def _reference(q, k, v, mask):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum('bqhd,bkhd->bhqk', q, k)
  if mask is not None:
    logits = np.where(np.asarray(mask)[:, None, None, :], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', p, v)


@pytest.mark.parametrize('masked', [False, True])
def test_portable_matches_a_float64_softmax(masked):
  rng = np.random.default_rng(0)
  q, k, v = _qkv(rng, sk=17)
  mask = _masks(rng, 2, 17) if masked else None
  got = attention_lib.attention(q, k, v, mask, implementation='portable')
  np.testing.assert_allclose(got, _reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('masked', [False, True])
def test_fused_plumbing_matches_portable_forward_and_gradient(masked):
  # 'xla' runs the fused path's argument handling (permuted keys, key lengths) through
  # jax.nn.dot_product_attention's XLA implementation: what cuDNN receives on a GPU.
  rng = np.random.default_rng(1)
  q, k, v = _qkv(rng, sq=11, sk=11)
  mask = _masks(rng, 2, 11) if masked else None
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(impl):
    return lambda q, k, v: jnp.sum(w * attention_lib.attention(q, k, v, mask, implementation=impl))

  for impl in ('portable', 'xla'):
    np.testing.assert_allclose(
        attention_lib.attention(q, k, v, mask, implementation=impl),
        _reference(q, k, v, mask),
        rtol=1e-5,
        atol=1e-6,
    )
  g_portable = jax.grad(loss('portable'), argnums=(0, 1, 2))(q, k, v)
  g_fused = jax.grad(loss('xla'), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_fused, g_portable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_query_chunks_equal_the_whole_forward_and_gradient():
  rng = np.random.default_rng(2)
  q, k, v = _qkv(rng, sq=37, sk=29)
  mask = _masks(rng, 2, 29)
  whole = lambda q, k, v: attention_lib.attention(q, k, v, mask, implementation='portable')
  chunked = lambda q, k, v: attention_lib.attention(
      q, k, v, mask, implementation='portable', query_chunk=8
  )
  np.testing.assert_allclose(chunked(q, k, v), whole(q, k, v), rtol=1e-6, atol=1e-6)
  gw = jax.grad(lambda *a: jnp.sum(whole(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
  gc = jax.grad(lambda *a: jnp.sum(chunked(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(gc, gw):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_portable_chunks_once_the_logits_outgrow_the_budget():
  assert attention_lib.portable_chunk(2, 24, 1152, 1152) == 1152  # Qwen-Image 512 px: whole
  # The Qwen-Image VAE mid-block at 1328 px: one head over 27,556 positions -> 8,192-row chunks
  # (1 GiB of logits at most, against 3 GiB whole).
  chunk = attention_lib.portable_chunk(1, 1, 27556, 27556)
  assert chunk == 8192 and chunk * 27556 * 4 <= attention_lib.LOGITS_BUDGET
  # Wan2.1 14B at 480x832x81 (32,760 tokens, 40 heads) stops at the 256-row floor.
  assert attention_lib.portable_chunk(1, 40, 32760, 32760) == 256


def test_auto_is_portable_off_gpu_and_fused_reasons_are_clear():
  assert attention_lib.resolve('auto', jnp.bfloat16, 128, platform='cpu') == 'portable'
  assert attention_lib.resolve('auto', jnp.bfloat16, 128, platform='gpu') == 'cudnn'
  assert attention_lib.resolve('auto', jnp.float32, 128, platform='gpu') == 'portable'
  assert attention_lib.resolve('auto', jnp.bfloat16, 384, platform='gpu') == 'portable'  # VAE
  assert attention_lib.resolve('fused', jnp.float32, 128, platform='cpu') == 'cudnn'
  assert 'GPU' in attention_lib.fused_unsupported('cpu', jnp.bfloat16, 128)
  assert 'compute_dtype' in attention_lib.fused_unsupported('gpu', jnp.float32, 128)
  assert attention_lib.fused_unsupported('gpu', jnp.bfloat16, 128) is None


def test_config_forcing_fused_where_it_cannot_run_is_one_clear_error():
  config = configlib.apply_overrides(qwenimage.get_config('tiny'), {'model.attention': 'fused'})
  with pytest.raises(ValueError, match=r"config.model.attention='fused' cannot run here: .*GPU"):
    experiment.attention_choice(config)
  config.model.attention = 'portable'
  assert experiment.attention_choice(config) == 'portable'
  config.model.attention = 'flash'
  with pytest.raises(ValueError, match='model.attention'):
    configlib.validate(config, 1)


@pytest.mark.parametrize('masked', [False, True])
def test_mmdit_with_the_fused_plumbing_equals_portable(masked):
  # The model passes its text mask the way the fused kernel takes it: same velocity.
  outs = {}
  for impl in ('portable', 'xla'):
    cfg = mmdit.MMDiTConfig(
        in_channels=8,
        out_channels=2,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=12,
        axes_dims_rope=(4, 6, 6),
    )
    model = mmdit.MMDiT(dataclasses.replace(cfg, attention=impl), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    lat = jnp.asarray(rng.normal(size=(2, 12, 8)), jnp.float32)
    text = jnp.asarray(rng.normal(size=(2, 5, 12)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], jnp.int32) if masked else None
    outs[impl] = model(lat, jnp.asarray([0.3, 0.8]), text, mask, img_shape=(1, 3, 4))
  np.testing.assert_allclose(outs['xla'], outs['portable'], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    jax.default_backend() != 'gpu', reason='no GPU: cuDNN fused attention needs one'
)
@pytest.mark.parametrize('masked', [False, True])
def test_cudnn_matches_portable_to_bf16_tolerance_on_gpu(masked):
  rng = np.random.default_rng(4)
  q, k, v = _qkv(rng, b=2, sq=1152, sk=1152, h=4, d=128, dtype=jnp.bfloat16)
  mask = _masks(rng, 2, 1152) if masked else None
  fused = attention_lib.attention(q, k, v, mask, implementation='cudnn')
  portable = attention_lib.attention(q, k, v, mask, implementation='portable')
  np.testing.assert_allclose(
      np.asarray(fused, np.float32),
      np.asarray(portable, np.float32),
      rtol=BF16_RTOL,
      atol=BF16_ATOL,
  )
