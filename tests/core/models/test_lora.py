"""digen_jax.models.lora.adapters on a tiny random diffusers QwenImage transformer.

B = 0 leaves the model bit for bit; targets pick whole stacks by diffusers module names;
gradients reach every adapter; files round-trip exactly and load in diffusers' own LoRA loader
(QwenImagePipeline.load_lora_weights) with alpha != rank, and files saved by diffusers load here;
manifests catch dropped, extra, reshaped and altered adapters.
"""

import copy
import functools
import json
import math
import os
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy
from safetensors import safe_open

import diffusers
import peft
import torch

from digen_jax.models.io import convert
from digen_jax.models.lora import adapters as lora
from tests.helpers import diffusers_models
from tests.helpers.paths import REPO
from digen_jax.models.transformers.mmdit import MMDiT, MMDiTConfig

TINY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12),
)
IMG_SHAPE = (1, 2, 3)
B, L = 2, 5
# Every Linear module; rank 4 and alpha 6 (scale 1.5, so a loader that drops alpha is caught).
ALL = lora.LoraConfig(rank=4, alpha=6.0, targets='.')
# Block modules whose output feeds only the last block's text output, which the model drops:
# their gradient in the last layer is exactly zero (in diffusers too). (txt_mod is only partly
# dead there: its shift1/scale1 chunks shape the text keys and values the image attends to.)
DEAD_IN_LAST_LAYER = {
    'blocks.attn.add_q_proj.kernel',
    'blocks.attn.to_add_out.kernel',
    'blocks.txt_mlp.fc1.kernel',
    'blocks.txt_mlp.fc2.kernel',
}


@pytest.fixture(scope='module')
def tmodel():
  """Tiny diffusers model, every tensor randomised (norm scales and biases included)."""
  return diffusers_models.randomized_transformer(**TINY)


@pytest.fixture(scope='module')
def base(tmodel):
  """(graphdef, float32 nnx.State) of our MMDiT holding tmodel's weights."""
  model = nnx.eval_shape(lambda: MMDiT(MMDiTConfig(**TINY), rngs=nnx.Rngs(0)))
  convert.load_diffusers_state(model, {k: v.numpy() for k, v in tmodel.state_dict().items()})
  return nnx.split(model)


@pytest.fixture(scope='module')
def table():
  return convert.diffusers_key_table(MMDiTConfig(**TINY))


@pytest.fixture(scope='module')
def inputs():
  rng = np.random.default_rng(0)
  latents = rng.standard_normal((B, int(np.prod(IMG_SHAPE)), TINY['in_channels']), np.float32)
  sigma = np.array([0.2, 0.7], np.float32)
  text = rng.standard_normal((B, L, TINY['joint_attention_dim']), np.float32)
  mask = np.ones((B, L), np.int64)
  mask[0, 3:] = 0
  return latents, sigma, text, mask


@pytest.fixture(scope='module')
def random_adapters(base, table):
  """ALL adapters with B != 0 too, large enough to change the output by ~10%."""
  paths = lora.target_paths(base[1], table, ALL)
  init = lora.init_adapters(base[1], paths, ALL, jax.random.key(1))
  rng = np.random.default_rng(2)
  return {
      p: {'a': np.asarray(e['a']), 'b': 0.05 * rng.standard_normal(e['b'].shape).astype(np.float32)}
      for p, e in init.items()
  }


@functools.lru_cache(maxsize=None)
def merged_forward(graphdef, cfg):
  """jit((base state, adapters, inputs) -> (model output, merged state)), the model run on
  merge(base, adapters) as the training programs run it."""

  def fwd(state, adapters, inputs):
    merged = lora.merge(state, adapters, cfg)
    return nnx.merge(graphdef, merged)(*inputs, img_shape=IMG_SHAPE), merged

  return jax.jit(fwd)


@functools.lru_cache(maxsize=None)
def base_forward(graphdef):
  return jax.jit(lambda state, inputs: nnx.merge(graphdef, state)(*inputs, img_shape=IMG_SHAPE))


def torch_forward(model, inputs):
  latents, sigma, text, mask = (torch.from_numpy(x) for x in inputs)
  with torch.no_grad():
    return (
        model(
            hidden_states=latents,
            timestep=sigma,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=text,
            img_shapes=[[IMG_SHAPE]] * B,
            return_dict=False,
        )[0]
        .float()
        .numpy()
    )


def rel_err(x, ref):
  return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ------------------------------------------------------------------------------------------------


def test_module_does_not_import_torch():
  # The training process imports lora.py and must stay torch-free.
  code = 'import sys, digen_jax.models.lora.adapters; assert "torch" not in sys.modules, "torch imported"'
  subprocess.run(
      [sys.executable, '-c', code],
      check=True,
      env=os.environ | {'JAX_PLATFORMS': 'cpu'},
      cwd=REPO,
  )


def test_config_validation():
  assert lora.LoraConfig(rank=8, alpha=4, targets='to_q').scale == 0.5
  for kwargs, field in [
      (dict(rank=0), 'rank'),
      (dict(rank=2.0), 'rank'),
      (dict(rank=True), 'rank'),
      (dict(alpha=0.0), 'alpha'),
      (dict(alpha=-1.0), 'alpha'),
      (dict(alpha=float('nan')), 'alpha'),
      (dict(targets=''), 'targets'),
      (dict(targets='to_(q'), 'targets'),
      (dict(dropout=0.1), 'dropout'),
  ]:
    args = dict(rank=4, alpha=4.0, targets='to_q') | kwargs
    with pytest.raises(ValueError, match=rf'config\.model\.lora\.{field}'):
      lora.LoraConfig(**args)


def test_target_paths(base, table):
  state = base[1]

  def paths(targets):
    return lora.target_paths(state, table, lora.LoraConfig(rank=2, alpha=2.0, targets=targets))

  assert paths('to_q|to_v') == ['blocks.attn.to_q.kernel', 'blocks.attn.to_v.kernel']
  assert paths(lora.ATTENTION_TARGETS) == sorted(
      f'blocks.attn.{m}.kernel'
      for m in (
          'to_q',
          'to_k',
          'to_v',
          'to_out',
          'add_q_proj',
          'add_k_proj',
          'add_v_proj',
          'to_add_out',
      )
  )
  assert paths(r'^img_in$|norm_out\.linear') == ['img_in.kernel', 'norm_out.kernel']
  assert paths(r'img_mlp\.net\.0\.proj') == ['blocks.img_mlp.fc1.kernel']
  assert len(paths('.')) == 20
  # Abstract params (what the trainer has before weights stream in) give the same answer.
  assert lora.target_paths(jax.eval_shape(lambda: state), table, ALL) == paths('.')
  with pytest.raises(
      ValueError,
      match=r"config\.model\.lora\.targets='to_qq' matches no Linear "
      r'module.*transformer_blocks\.0\.attn\.to_q',
  ):
    paths('to_qq')
  with pytest.raises(ValueError, match='matches no Linear module'):
    paths('norm_q')  # an RMSNorm, not a Linear
  with pytest.raises(
      ValueError,
      match=r'only some layers of stacked kernels: blocks\.attn\.to_q'
      r'\.kernel \(1 of 2 layers.*whole stacks',
  ):
    paths(r'transformer_blocks\.0\.attn\.to_q')


def test_init_adapters(base, table):
  state = base[1]
  cfg = lora.LoraConfig(rank=8, alpha=8.0, targets=r'attn\.to_q|img_in')
  paths = lora.target_paths(state, table, cfg)
  ad = lora.init_adapters(state, paths, cfg, jax.random.key(0))
  assert sorted(ad) == ['blocks.attn.to_q.kernel', 'img_in.kernel']
  q, i = ad['blocks.attn.to_q.kernel'], ad['img_in.kernel']
  assert q['a'].shape == (2, 64, 8) and q['b'].shape == (2, 8, 64)
  assert i['a'].shape == (16, 8) and i['b'].shape == (8, 64)
  for e, n_in in ((q, 64), (i, 16)):
    assert e['a'].dtype == e['b'].dtype == jnp.float32
    assert not np.any(np.asarray(e['b']))
    a = np.asarray(e['a'])
    # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in] = U(-1/sqrt(in), 1/sqrt(in)).
    assert np.max(np.abs(a)) <= 1 / math.sqrt(n_in) and np.max(np.abs(a)) > 0.9 / math.sqrt(n_in)
    assert abs(np.std(a) - 1 / math.sqrt(3 * n_in)) < 0.15 / math.sqrt(3 * n_in)
  assert not np.array_equal(q['a'][0], q['a'][1])
  again = lora.init_adapters(state, paths[::-1], cfg, jax.random.key(0))
  np.testing.assert_array_equal(again['img_in.kernel']['a'], i['a'])
  with pytest.raises(ValueError, match="'blocks.attn.to_q.bias' has shape"):
    lora.init_adapters(state, ['blocks.attn.to_q.bias'], cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="'nope.kernel' is not a param path"):
    lora.init_adapters(state, ['nope.kernel'], cfg, jax.random.key(0))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_zero_b_merge_is_exact_on_signed_zeros(dtype):
  # A plain W + 0.0 turns -0.0 into +0.0; merge must return W bit for bit, also under jit.
  w = np.random.default_rng(0).standard_normal((3, 8, 5)).astype(dtype)
  w[0, 0, :3] = [-0.0, 0.0, -0.0]
  params = {'layer': {'kernel': jnp.asarray(w), 'bias': jnp.ones(5, dtype)}}
  cfg = lora.LoraConfig(rank=2, alpha=3.0, targets='.')
  ad = {
      'layer.kernel': {
          'a': jnp.asarray(np.random.default_rng(1).standard_normal((3, 8, 2)), jnp.float32),
          'b': jnp.zeros((3, 2, 5), jnp.float32),
      }
  }
  assert bits(w + np.zeros_like(w))[0, 0, 0] != bits(w)[0, 0, 0]  # what a plain add does
  for fn in (lora.merge, jax.jit(lora.merge, static_argnums=2)):
    out = fn(params, ad, cfg)
    assert isinstance(out, dict) and out['layer']['kernel'].dtype == dtype
    np.testing.assert_array_equal(bits(out['layer']['kernel']), bits(w))
    np.testing.assert_array_equal(bits(out['layer']['bias']), bits(params['layer']['bias']))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_zero_b_model_is_bit_identical(base, table, inputs, dtype):
  graphdef, state = base
  state = jax.tree.map(lambda x: x.astype(dtype), state)
  # One kernel entry is -0.0, as real checkpoints may hold.
  state = jax.tree_util.tree_map_with_path(
      lambda p, x: x.at[0, 0, 0].set(-0.0)
      if 'to_q' in jax.tree_util.keystr(p) and x.ndim == 3
      else x,
      state,
  )
  ad = lora.init_adapters(state, lora.target_paths(state, table, ALL), ALL, jax.random.key(0))
  out, merged = merged_forward(graphdef, ALL)(state, ad, inputs)
  assert isinstance(merged, nnx.State)
  want, got = nnx.to_flat_state(state), nnx.to_flat_state(merged)
  assert [p for p, _ in want] == [p for p, _ in got]
  for (path, w), (_, m) in zip(want, got):
    assert m.get_value().dtype == dtype, path
    np.testing.assert_array_equal(bits(m.get_value()), bits(w.get_value()), err_msg=str(path))
  ref = np.asarray(base_forward(graphdef)(state, inputs))
  np.testing.assert_array_equal(bits(out), bits(ref))


def test_gradients_reach_every_adapter(base, table, inputs, random_adapters):
  graphdef, state = base
  ad0 = lora.init_adapters(state, lora.target_paths(state, table, ALL), ALL, jax.random.key(0))
  weights = np.random.default_rng(3).standard_normal((B, 6, 16)).astype(np.float32)

  @jax.jit
  def grad(adapters):
    def loss(adapters):
      out = nnx.merge(graphdef, lora.merge(state, adapters, ALL))(*inputs, img_shape=IMG_SHAPE)
      return jnp.sum(out * weights)

    return jax.grad(loss)(adapters)

  def check(grads, a_zero):
    assert sorted(grads) == sorted(ad0)
    for path, g in grads.items():
      for name in ('a', 'b'):
        x = np.asarray(g[name])
        assert x.shape == ad0[path][name].shape and np.all(np.isfinite(x))
        if name == 'a' and a_zero:
          assert not np.any(x), path  # dA = scale * dW @ B^T is exactly 0 at B = 0
          continue
        layers = x if x.ndim == 3 else x[None]
        for i, layer in enumerate(layers):
          dead = path in DEAD_IN_LAST_LAYER and i == len(layers) - 1
          assert bool(np.any(layer)) != dead, (path, name, i)

  check(grad(ad0), a_zero=True)
  check(grad(random_adapters), a_zero=False)


def test_merge_rejects_mismatched_adapters(base):
  state = base[1]
  cfg = lora.LoraConfig(rank=2, alpha=2.0, targets='to_q')
  good = {'a': jnp.zeros((2, 64, 2)), 'b': jnp.zeros((2, 2, 64))}
  with pytest.raises(
      ValueError,
      match=r"adapter 'blocks.attn.to_q.kernel' has shapes a "
      r'\(2, 64, 3\).*rank=2 needs a \(2, 64, 2\), b \(2, 2, 64\)',
  ):
    lora.merge(
        state,
        {'blocks.attn.to_q.kernel': {'a': jnp.zeros((2, 64, 3)), 'b': jnp.zeros((2, 3, 64))}},
        cfg,
    )
  with pytest.raises(ValueError, match="'blocks.attn.to_x.kernel' is not a param path"):
    lora.merge(state, {'blocks.attn.to_x.kernel': good}, cfg)
  with pytest.raises(ValueError, match='must be a dict with keys "a" and "b"'):
    lora.merge(state, {'blocks.attn.to_q.kernel': {'a': good['a']}}, cfg)


def test_save_load_roundtrip(tmp_path, table, random_adapters):
  path = lora.save_diffusers_lora(tmp_path, random_adapters, ALL, table)
  lora.save_diffusers_lora(tmp_path, random_adapters, ALL, table)  # overwrite in place
  assert path == tmp_path / 'pytorch_lora_weights.safetensors'
  assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
  with safe_open(str(path), framework='np') as f:
    keys = set(f.keys())
    assert f.get_tensor('transformer.transformer_blocks.1.attn.to_out.0.lora_A.weight').shape == (
        4,
        64,
    )
    b = f.get_tensor('transformer.transformer_blocks.0.img_mlp.net.0.proj.lora_B.weight')
    np.testing.assert_array_equal(b, random_adapters['blocks.img_mlp.fc1.kernel']['b'][0].T)
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
  assert len(keys) == 2 * (6 + 14 * 2) and 'transformer.norm_out.linear.lora_A.weight' in keys
  assert meta['transformer.r'] == 4 and meta['transformer.lora_alpha'] == 6.0
  assert len(meta['transformer.target_modules']) == 34

  loaded, cfg = lora.load_diffusers_lora(tmp_path, table)
  assert cfg == ALL
  assert sorted(loaded) == sorted(random_adapters)
  for p, e in random_adapters.items():
    for n in ('a', 'b'):
      assert loaded[p][n].dtype == np.float32
      np.testing.assert_array_equal(loaded[p][n], e[n])
  assert lora.manifest(loaded) == lora.manifest(random_adapters)

  with pytest.raises(
      ValueError,
      match=r"adapter 'blocks.attn.add_k_proj.kernel' has shapes a "
      r'\(2, 64, 4\), b \(2, 4, 64\); expected a \[2, in, 5\].*rank=5',
  ):
    lora.save_diffusers_lora(
        tmp_path / 'x', random_adapters, lora.LoraConfig(rank=5, alpha=5.0, targets='.'), table
    )


def test_load_errors_and_bare_files(tmp_path, table, random_adapters):
  lora.save_diffusers_lora(tmp_path, random_adapters, ALL, table)
  with safe_open(str(tmp_path / lora.WEIGHT_NAME), framework='np') as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}

  def load(tensors, metadata=None):
    folder = tmp_path / f'case{len(list(tmp_path.iterdir()))}'
    folder.mkdir()
    safetensors_numpy.save_file(tensors, str(folder / lora.WEIGHT_NAME), metadata=metadata)
    return lora.load_diffusers_lora(folder, table)

  # No metadata (e.g. an older trainer): alpha = rank, diffusers' rule; targets from the names.
  sub = {k: v for k, v in tensors.items() if '.to_q.' in k or 'img_in' in k}
  ad, cfg = load(sub)
  assert (cfg.rank, cfg.alpha) == (4, 4.0) and sorted(ad) == [
      'blocks.attn.to_q.kernel',
      'img_in.kernel',
  ]
  assert cfg.targets == r'^(?:transformer_blocks\.\d+\.attn\.to_q|img_in)$'

  drop = 'transformer.transformer_blocks.1.attn.to_k.lora_A.weight'
  with pytest.raises(ValueError, match=r'without both lora_A and lora_B.*blocks\.1\.attn\.to_k'):
    load({k: v for k, v in tensors.items() if k != drop})
  with pytest.raises(ValueError, match=r'only 1 of 2 layers of blocks\.attn\.to_k\.kernel'):
    load({k: v for k, v in tensors.items() if 'blocks.1.attn.to_k.' not in k})
  with pytest.raises(ValueError, match=r"not Linear layers of this model: \['pos_embed'\]"):
    load(
        tensors
        | {
            'transformer.pos_embed.lora_A.weight': np.zeros((4, 3), np.float32),
            'transformer.pos_embed.lora_B.weight': np.zeros((3, 4), np.float32),
        }
    )
  with pytest.raises(
      ValueError, match=r'not "transformer.<module>.lora_A/lora_B.weight".*' r'text_encoder'
  ):
    load(tensors | {'text_encoder.x.lora_A.weight': np.zeros((4, 3), np.float32)})
  with pytest.raises(ValueError, match='several ranks'):
    load(
        tensors
        | {
            'transformer.img_in.lora_A.weight': np.zeros((2, 16), np.float32),
            'transformer.img_in.lora_B.weight': np.zeros((64, 2), np.float32),
        }
    )
  with pytest.raises(ValueError, match=r'metadata says r=8'):
    load(sub, {'lora_adapter_metadata': json.dumps({'transformer.r': 8})})
  with pytest.raises(ValueError, match='use_dora=True is not supported'):
    load(sub, {'lora_adapter_metadata': json.dumps({'transformer.use_dora': True})})
  with pytest.raises(FileNotFoundError, match='no pytorch_lora_weights.safetensors in'):
    lora.load_diffusers_lora(tmp_path / 'nowhere', table)


def test_diffusers_loads_our_file(tmp_path, tmodel, base, table, inputs, random_adapters):
  """THE interop check: diffusers' own LoRA loader, our file, alpha != rank."""
  graphdef, state = base
  lora.save_diffusers_lora(tmp_path, random_adapters, ALL, table)
  transformer = copy.deepcopy(tmodel)
  pipe = diffusers.QwenImagePipeline(
      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
      vae=None,
      text_encoder=None,
      tokenizer=None,
      transformer=transformer,
  )
  pipe.load_lora_weights(str(tmp_path))
  layers = [m for m in transformer.modules() if isinstance(m, peft.tuners.lora.Linear)]
  assert len(layers) == 34 and all(list(m.scaling.values()) == [1.5] for m in layers)
  ref = torch_forward(transformer, inputs)
  ours = np.asarray(merged_forward(graphdef, ALL)(state, random_adapters, inputs)[0])
  err = rel_err(ours, ref)
  assert err <= 1e-4
  # The adapters change the output ~500x more than the tolerance: a dropped module or a scale
  # of 1 (alpha ignored) on either side would fail the check above.
  assert rel_err(torch_forward(tmodel, inputs), ref) > 0.05


def test_we_load_a_diffusers_file(tmp_path, tmodel, base, table, inputs):
  """The other direction: a LoRA trained in PyTorch (PEFT) and saved by diffusers."""
  graphdef, state = base
  transformer = copy.deepcopy(tmodel)
  transformer.add_adapter(
      peft.LoraConfig(
          r=3,
          lora_alpha=5,
          lora_dropout=0.0,
          target_modules=['to_q', 'add_k_proj', 'img_mlp.net.2', 'proj_out'],
      )
  )
  gen = torch.Generator().manual_seed(4)
  with torch.no_grad():
    for name, p in transformer.named_parameters():
      if 'lora_' in name:
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
  diffusers.QwenImagePipeline.save_lora_weights(
      str(tmp_path),
      transformer_lora_layers=peft.utils.get_peft_model_state_dict(transformer),
      transformer_lora_adapter_metadata=transformer.peft_config['default'].to_dict(),
  )
  ad, cfg = lora.load_diffusers_lora(tmp_path, table)
  assert (cfg.rank, cfg.alpha) == (3, 5.0)
  assert sorted(ad) == [
      'blocks.attn.add_k_proj.kernel',
      'blocks.attn.to_q.kernel',
      'blocks.img_mlp.fc2.kernel',
      'proj_out.kernel',
  ]
  assert lora.target_paths(state, table, cfg) == sorted(ad)
  ref = torch_forward(transformer, inputs)
  ours = np.asarray(merged_forward(graphdef, cfg)(state, ad, inputs)[0])
  assert rel_err(ours, ref) <= 1e-4
  assert rel_err(torch_forward(tmodel, inputs), ref) > 0.05


def test_manifest(random_adapters):
  ad = random_adapters
  m = lora.manifest(ad)
  json.dumps(m)
  lora.check_manifest(m, m)
  entry = m['img_in.kernel']
  assert entry['a'] == {'shape': [16, 4], 'dtype': 'float32'} and len(entry['sha256']) == 64
  # An expectation built from shapes alone (no values) checks names, shapes and dtypes.
  abstract = jax.eval_shape(lambda: ad)
  assert lora.manifest(abstract)['img_in.kernel']['sha256'] is None
  lora.check_manifest(lora.manifest(abstract), m)
  assert (
      lora.num_bytes(ad)
      == lora.num_bytes(abstract)
      == sum(e['a'].nbytes + e['b'].nbytes for e in ad.values())
  )

  q = 'blocks.attn.to_q.kernel'
  dropped = {p: e for p, e in ad.items() if p != q}
  extra = ad | {'x.kernel': ad['img_in.kernel']}
  reshaped = ad | {
      'img_in.kernel': {'a': ad['img_in.kernel']['a'][:, :3], 'b': ad['img_in.kernel']['b'][:3]}
  }
  altered_b = ad[q]['b'].copy()
  altered_b[1, 2, 3] += 1e-6
  altered = ad | {q: {'a': ad[q]['a'], 'b': altered_b}}
  for got, msg in [
      (dropped, rf'missing \(1\): {q}'),
      (extra, r'unexpected \(1\): x\.kernel'),
      (
          reshaped,
          r'wrong shape or dtype \(1\): img_in\.kernel \(expected a '
          r"\{'shape': \[16, 4\].*got a \{'shape': \[16, 3\]",
      ),
      (altered, rf'different values \(sha256\) \(1\): {q}'),
  ]:
    with pytest.raises(ValueError, match=msg):
      lora.check_manifest(m, lora.manifest(got))
  as_f64 = ad | {q: {'a': ad[q]['a'].astype(np.float64), 'b': ad[q]['b']}}
  with pytest.raises(ValueError, match=rf"wrong shape or dtype \(1\): {q}.*'float64'"):
    lora.check_manifest(m, lora.manifest(as_f64))
  # Everything at once, in one message.
  with pytest.raises(ValueError, match='missing.*unexpected.*wrong shape.*different values'):
    everything = ad | {
        'x.kernel': extra['x.kernel'],
        'img_in.kernel': reshaped['img_in.kernel'],
        q: altered[q],
    }
    del everything['norm_out.kernel']
    lora.check_manifest(m, lora.manifest(everything))
