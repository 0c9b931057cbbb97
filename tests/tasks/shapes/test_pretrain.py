"""Pretraining of the ShapesBench base generator, params_io round trips, and the shipped checkpoint."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import shapes_pretrain
from digen_jax.experiment import build as experiment
from digen_jax.tasks.shapes import pretrain
from digen_jax.models import latents as latents_lib
from digen_jax.models.transformers import mmdit
from digen_jax.models.io import params_io
from digen_jax.models.text import encoders as text_lib
from tests.helpers.paths import REPO

SHIPPED = os.path.join(REPO, shapes_pretrain.SHAPES_BASE_CHECKPOINT)


def _tiny_model(seed=0):
  cfg = mmdit.MMDiTConfig(
      patch_size=4,
      in_channels=48,
      out_channels=3,
      num_layers=2,
      attention_head_dim=16,
      num_attention_heads=2,
      joint_attention_dim=32,
      axes_dims_rope=(4, 6, 6),
  )
  return cfg, mmdit.MMDiT(cfg, rngs=nnx.Rngs(seed))


# ------------------------------------------------------------------------------------------------
# params_io


@pytest.mark.slow
def test_params_io_round_trip_is_exact(tmp_path):
  cfg, model = _tiny_model()
  _, state = nnx.split(model)
  params_io.save_params(tmp_path / 'ck', state, cfg, {'note': 'x', 'acc': 0.25})
  cfg2, state2, extra = params_io.load_params(tmp_path / 'ck')
  assert cfg2 == cfg
  assert extra == {'note': 'x', 'acc': 0.25}
  a, b = nnx.to_flat_state(state), nnx.to_flat_state(state2)
  assert [k for k, _ in a] == [k for k, _ in b]
  for (k, va), (_, vb) in zip(a, b):
    assert np.asarray(vb[...]).dtype == np.float32, k
    np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(k))
  # The loaded model computes exactly what the saved one did.
  loaded = params_io.load_model(tmp_path / 'ck')
  x = jax.random.normal(jax.random.key(1), (2, 16, 48))
  args = (x, jnp.array([0.3, 0.9]), jnp.ones((2, 5, 32)), jnp.ones((2, 5), jnp.int32))
  np.testing.assert_array_equal(
      np.asarray(model(*args, img_shape=(1, 4, 4))), np.asarray(loaded(*args, img_shape=(1, 4, 4)))
  )


def test_params_io_bfloat16_rounds_and_loads_float32(tmp_path):
  cfg, model = _tiny_model()
  _, state = nnx.split(model)
  params_io.save_params(tmp_path / 'bf', state, cfg, dtype='bfloat16')
  _, state2, _ = params_io.load_params(tmp_path / 'bf')
  for (k, va), (_, vb) in zip(nnx.to_flat_state(state), nnx.to_flat_state(state2)):
    a, b = np.asarray(va[...]), np.asarray(vb[...])
    assert b.dtype == np.float32
    np.testing.assert_allclose(b, a, rtol=2**-8, atol=1e-30, err_msg=str(k))


def test_params_io_errors_name_the_path(tmp_path):
  with pytest.raises(ValueError, match='does not exist'):
    params_io.load_params(tmp_path / 'nope')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ValueError, match=r'empty.*config\.json'):
    params_io.load_params(tmp_path / 'empty')
  cfg, model = _tiny_model()
  _, state = nnx.split(model)
  folder = tmp_path / 'ck'
  params_io.save_params(folder, state, cfg)
  # Flip one byte of the weights: the digest catches it.
  w = folder / params_io.WEIGHTS_FILE
  data = bytearray(w.read_bytes())
  data[-5] ^= 0xFF
  w.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=r'params\.safetensors is corrupt'):
    params_io.load_params(folder)
  (folder / params_io.CONFIG_FILE).write_text('{not json')
  with pytest.raises(ValueError, match='not valid JSON'):
    params_io.load_params(folder)


def test_save_params_rejects_mismatched_params_and_bad_extra(tmp_path):
  cfg, model = _tiny_model()
  _, state = nnx.split(model)
  other = mmdit.MMDiTConfig(**{**cfg.__dict__, 'num_layers': 3})
  with pytest.raises(ValueError, match='wrong shapes'):
    params_io.save_params(tmp_path / 'a', state, other)
  with pytest.raises(ValueError, match='JSON-serialisable'):
    params_io.save_params(tmp_path / 'b', state, cfg, {'x': object()})


# ------------------------------------------------------------------------------------------------
# pretraining


def test_flow_matching_loss_is_zero_for_the_exact_velocity():
  # A "model" returning ε − x0 exactly has zero loss; a zero model has loss mean((ε − x0)²).
  x0 = jax.random.normal(jax.random.key(0), (3, 4, 2))
  eps = jax.random.normal(jax.random.key(1), (3, 4, 2))
  sigma = jnp.array([0.1, 0.5, 0.9])

  def oracle(x_t, s, text, mask, img_shape):
    return eps - x0  # the target the loss must use (a sign or mixing error makes the loss > 0)

  assert float(pretrain.flow_matching_loss(oracle, x0, eps, sigma, None, None, (1, 2, 2))) == 0.0
  zero = lambda *a, **k: jnp.zeros_like(x0)
  np.testing.assert_allclose(
      float(pretrain.flow_matching_loss(zero, x0, eps, sigma, None, None, (1, 2, 2))),
      float(jnp.mean((eps - x0) ** 2)),
      rtol=1e-6,
  )


def test_sigma_sampling_ranges():
  for kind in ('logit_normal', 'uniform'):
    s = np.asarray(pretrain.sample_train_sigmas(jax.random.key(0), 4096, kind))
    assert s.shape == (4096,) and np.all((s > 0) & (s < 1)), kind
  s = np.asarray(pretrain.sample_train_sigmas(jax.random.key(0), 4096, 'logit_normal', 0.0, 1.0))
  assert abs(np.median(s) - 0.5) < 0.03
  with pytest.raises(ValueError, match='sigma sampling'):
    pretrain.sample_train_sigmas(jax.random.key(0), 4, 'cosine')


def test_single_object_rates_are_the_capability_gate():
  texts = [
      'a red circle on a white background',
      'a red square on a white background',
      'two red circles on a white background',
      'a red circle left of a blue square on a black background',
  ]
  rates = pretrain.single_object_rates(np.array([1.0, 0.0, 1.0, 0.0]), texts)
  assert rates['single/shape/circle'] == 1.0 and rates['single/shape/square'] == 0.0
  assert rates['single/color/red'] == 0.5  # one-object prompts only: counts are composition
  assert rates['single/count/1'] == 0.5 and rates['single/count/2'] == 1.0
  assert rates['single/min'] == 0.0 and 'single/color/blue' not in rates
  assert pretrain.single_object_rates(np.array([1.0]), texts[3:]) == {}


def test_bad_caption_noise_is_a_config_error():
  c = shapes_pretrain.get_config('test')
  c.pretrain.caption_noise = 1.0
  with pytest.raises(ValueError, match='config.pretrain: caption_noise=1.0'):
    pretrain.validate(c)
  c = shapes_pretrain.get_config('test')
  c.pretrain.caption_noise_kinds = 'count,colour'
  with pytest.raises(ValueError, match="noise_kinds=.*'colour'"):
    pretrain.validate(c)
  c = shapes_pretrain.get_config('test')
  c.pretrain.single_count_weights = '1,two,3'
  with pytest.raises(ValueError, match="config.pretrain: single_count_weights='1,two,3'"):
    pretrain.validate(c)
  c.pretrain.single_count_weights = '1,3'
  with pytest.raises(ValueError, match='config.pretrain: single_count_weights=.*give 3 finite'):
    pretrain.validate(c)
  c.pretrain.single_count_weights = '1, 3, 5'
  pretrain.validate(c)
  assert pretrain.batch_spec(c).single_count_weights == (1.0, 3.0, 5.0)
  c = shapes_pretrain.get_config('test')
  c.pretrain.data_workers = -1
  with pytest.raises(ValueError, match='config.pretrain.data_workers'):
    pretrain.validate(c)


def test_sde_eval_sampler_keeps_the_last_step_deterministic():
  # GRPO rollouts never make the last step (sigma -> 0) stochastic; the eval's SDE sampler must
  # match, so with one step SDE and ODE agree exactly, and with two they differ (step 0 is SDE).
  from digen_jax.diffusion import sde as sde_lib

  cfg, model = _tiny_model()
  graphdef, state = nnx.split(model)
  x1 = jax.random.normal(jax.random.key(0), (2, 16, 48))
  text, mask = jnp.ones((2, 5, 32)), jnp.ones((2, 5), jnp.int32)
  sde_cfg = sde_lib.SDEConfig(kind='flow_grpo', noise_level=0.7)
  to_images = lambda _, tok: latents_lib.decode_pixels(tok, 16, 16, 4)
  for sig, same in (
      (np.array([0.8, 0.0], np.float32), True),
      (np.array([0.8, 0.4, 0.0], np.float32), False),
  ):
    ode = pretrain.make_sampler(graphdef, sig, (1, 4, 4), to_images)(
        state, None, x1, text, mask, jax.random.key(1)
    )
    sde = pretrain.make_sampler(graphdef, sig, (1, 4, 4), to_images, sde_cfg)(
        state, None, x1, text, mask, jax.random.key(1)
    )
    assert ode.shape == (2, 16, 16, 3)
    assert np.array_equal(np.asarray(ode), np.asarray(sde)) == same, sig


def test_eval_sampler_guidance_is_rl_cfg():
  # One Euler step from sigma 0.8: the image is decode(x1 - 0.8 v) with v = v_u + s (v_c - v_u),
  # v_u the velocity under the negative prompt's (text, mask), broadcast over the batch.
  cfg, model = _tiny_model()
  graphdef, state = nnx.split(model)
  x1 = jax.random.normal(jax.random.key(0), (2, 16, 48))
  text = jax.random.normal(jax.random.key(1), (2, 5, 32))
  mask = jnp.ones((2, 5), jnp.int32)
  uncond = (jnp.zeros((1, 5, 32)), jnp.array([[1, 0, 0, 0, 0]], jnp.int32))
  sig = np.array([0.8, 0.0], np.float32)
  to_images = lambda _, tok: latents_lib.decode_pixels(tok, 16, 16, 4)
  got = pretrain.make_sampler(graphdef, sig, (1, 4, 4), to_images, guidance=(3.0, False, uncond))(
      state, None, x1, text, mask, jax.random.key(2)
  )
  s = jnp.full((2,), 0.8)
  v_c = model(x1, s, text, mask, img_shape=(1, 4, 4))
  v_u = model(
      x1,
      s,
      jnp.broadcast_to(uncond[0], text.shape),
      jnp.broadcast_to(uncond[1], mask.shape),
      img_shape=(1, 4, 4),
  )
  want = to_images(None, x1 - 0.8 * (v_u + 3.0 * (v_c - v_u)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
  plain = pretrain.make_sampler(graphdef, sig, (1, 4, 4), to_images)(
      state, None, x1, text, mask, jax.random.key(2)
  )
  assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 1e-2


def test_cfg_evals_need_a_model_that_learnt_the_empty_prompt(tmp_path):
  c = shapes_pretrain.get_config('test')
  c.sampler.guidance_scale = 2.0
  with pytest.raises(ValueError, match='guidance_scale=2.0.*set config.pretrain.text_dropout'):
    pretrain.validate(c)
  c.pretrain.text_dropout = 0.15
  pretrain.validate(c)
  c.sampler.negative_prompt = 'blurry'
  with pytest.raises(ValueError, match="negative_prompt='blurry'"):
    pretrain.validate(c)
  # A warm start inherits the flag its checkpoint was saved with.
  c = shapes_pretrain.get_config('test')
  c.sampler.guidance_scale = 2.0
  mcfg = experiment.model_config_from(c)
  _, state = nnx.split(mmdit.MMDiT(mcfg, rngs=nnx.Rngs(0)))
  for trained in (False, True):
    folder = str(tmp_path / f'cfg_{trained}')
    params_io.save_params(folder, state, mcfg, {'cfg_trained': trained})
    c.pretrain.init_from = folder
    if trained:
      pretrain.validate(c)
    else:
      with pytest.raises(ValueError, match='never learns the empty prompt'):
        pretrain.validate(c)


def test_single_count_misses_say_why_counted_prompts_fail():
  from digen_jax.tasks.shapes import render
  from digen_jax.tasks.shapes import checker as shapes_checker

  prompts = ['three red circles on a white background'] * 2 + [
      'two blue squares on a white background'
  ]
  images = render.render_batch(
      ['three red circles on a white background', 'two red circles on a white background']
      + ['two blue squares on a white background'],
      size=32,
      seed=0,
  )
  checked = shapes_checker.check_all(images, prompts)
  misses = pretrain.single_count_misses(checked, prompts)
  assert misses == {
      'single/miss_count/2': 0.0,
      'single/miss_shape/2': 0.0,
      'single/miss_count/3': 0.5,  # two circles drawn for three
      'single/miss_shape/3': 0.0,
  }


def test_validate_rejects_bad_fields():
  c = shapes_pretrain.get_config('test')
  c.pretrain.image_size = 32
  with pytest.raises(ValueError, match='image_size'):
    pretrain.validate(c)
  c = shapes_pretrain.get_config('test')
  c.pretrain.sigma_sampling = 'cosine'
  with pytest.raises(ValueError, match='sigma_sampling'):
    pretrain.validate(c)
  with pytest.raises(ValueError, match='unknown variant'):
    shapes_pretrain.get_config('huge')
  c = shapes_pretrain.get_config('test')
  c.pretrain.init_from = '/nonexistent/params'
  with pytest.raises(ValueError, match='config.pretrain.init_from'):
    pretrain.validate(c)


def test_config_fields_are_consistent_for_rl_reuse():
  c = shapes_pretrain.get_config()
  pretrain.validate(c)
  rl = shapes_pretrain.apply_shapes_base(shapes_pretrain.configlib.base_config())
  for section in ('model', 'latent', 'text', 'sampler'):
    a, b = rl[section].to_dict(), c[section].to_dict()
    if section == 'model':  # only init/checkpoint differ: RL starts from the shipped params
      for k in ('init', 'checkpoint'):
        a.pop(k), b.pop(k)
    assert a == b, section
  assert (
      rl.model.init == 'checkpoint'
      and rl.model.checkpoint == shapes_pretrain.SHAPES_BASE_CHECKPOINT
  )


@pytest.mark.slow
def test_short_pretraining_loss_falls_and_saves(tmp_path):
  c = shapes_pretrain.get_config('test')
  summary = pretrain.train(c, str(tmp_path))
  losses = np.asarray(summary['losses'])
  assert losses.shape == (c.pretrain.steps,) and np.all(np.isfinite(losses))
  k = 10
  assert losses[-k:].mean() < 0.7 * losses[:k].mean(), (losses[:k].mean(), losses[-k:].mean())
  # metrics.jsonl has loss rows and a final eval row; the saved params load and match.
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert any('loss' in r for r in rows)
  ev = [r for r in rows if 'eval/strict_accuracy' in r][-1]
  assert 0.0 <= ev['eval/strict_accuracy'] <= 1.0 and ev['eval/num_prompts'] == 4
  cfg, state, extra = params_io.load_params(tmp_path / 'params')
  assert cfg == experiment.model_config_from(c)
  assert extra['step'] == c.pretrain.steps
  for a, b in zip(jax.tree.leaves(summary['params']), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Warm start from the saved params: training continues from them, not from scratch.
  w = shapes_pretrain.get_config('test')
  w.pretrain.init_from, w.pretrain.steps, w.pretrain.warmup = str(tmp_path / 'params'), 10, 1
  warm = pretrain.train(w, str(tmp_path / 'warm'))
  assert np.mean(warm['losses'][:5]) < 0.8 * losses[:5].mean()
  w.model.num_layers = 2
  with pytest.raises(ValueError, match='init_from.*same architecture'):
    pretrain.train(w, str(tmp_path / 'warm2'))


def test_pooled_text_warm_start_keeps_the_function_then_conditions_on_the_prompt(tmp_path):
  """A checkpoint without pooled text warm-starts a model with it (MMDiTConfig.pooled_text): at step
  0 the model computes exactly the checkpoint's velocities; once text_pool's output layer is non-zero,
  a prompt change reaches every token through the modulation."""
  c = shapes_pretrain.get_config('test')
  base_cfg = experiment.model_config_from(c)
  assert not base_cfg.pooled_text
  base = mmdit.MMDiT(base_cfg, rngs=nnx.Rngs(0))
  _, base_state = nnx.split(base)
  base_state = pretrain.zero_init_modulation(base_state)
  # Non-zero modulations, so the time embedding (and anything added to it) matters.
  rng = np.random.default_rng(
      3
  )  # numpy: one eager jax.random call per leaf shape would compile each
  base_state = jax.tree.map(
      lambda a: a + 0.05 * rng.standard_normal(a.shape).astype(np.float32), base_state
  )
  params_io.save_params(tmp_path / 'ck', base_state, base_cfg)

  c.model.pooled_text = True
  c.pretrain.init_from = str(tmp_path / 'ck')
  pooled_cfg = experiment.model_config_from(c)
  params = pretrain.warm_start_params(c, pooled_cfg)
  graphdef, _ = nnx.split(mmdit.MMDiT(pooled_cfg, rngs=nnx.Rngs(1)))
  enc = experiment.build_text_encoder(c)
  emb, mask = (
      jnp.asarray(a)
      for a in enc.encode(
          ['a red circle on a white background', 'a red square on a white background']
      )
  )
  size, p = c.latent.height, c.model.patch_size
  shape = (1, size // p, size // p)
  x = jax.random.normal(jax.random.key(0), (1, (size // p) ** 2, c.model.in_channels)).repeat(2, 0)
  sig = jnp.array([0.6, 0.6])  # same noise and σ for both prompts: they differ only in the text
  v_base = nnx.merge(nnx.split(base)[0], base_state)(x, sig, emb, mask, img_shape=shape)
  v_warm = nnx.merge(graphdef, params)(x, sig, emb, mask, img_shape=shape)
  np.testing.assert_allclose(np.asarray(v_warm), np.asarray(v_base), rtol=0, atol=1e-6)

  # Perturb only text_pool: the output now changes, and differently for the two prompts.
  flat = [
      (k, v.replace(v[...] + 0.1) if k[0] == 'text_pool' else v)
      for k, v in nnx.to_flat_state(params)
  ]
  v_pool = nnx.merge(graphdef, nnx.from_flat_state(flat))(x, sig, emb, mask, img_shape=shape)
  delta = np.asarray(v_pool - v_warm)
  assert np.abs(delta).max() > 1e-3
  assert not np.allclose(delta[0], delta[1], atol=1e-5)

  # Any other architecture difference is still refused.
  c.model.num_layers = 2
  with pytest.raises(ValueError, match='init_from.*same architecture'):
    pretrain.warm_start_params(c, experiment.model_config_from(c))


# ------------------------------------------------------------------------------------------------
# the shipped checkpoint


def test_shipped_checkpoint_loads_and_runs():
  if not os.path.isdir(SHIPPED):
    pytest.fail(
        f'{SHIPPED} is missing: run digen_jax.tasks.shapes.pretrain (see configs/shapes_pretrain.py)'
    )
  cfg, state, extra = params_io.load_params(SHIPPED)
  c = shapes_pretrain.get_config()
  assert cfg == experiment.model_config_from(c)  # the config RL reuses describes this checkpoint
  assert os.path.getsize(os.path.join(SHIPPED, params_io.WEIGHTS_FILE)) < 25 * 2**20
  # The text encoder RL builds from the config is the one the checkpoint was trained with.
  enc = experiment.build_text_encoder(c)
  assert extra['text_encoder']['table_sha256'] == text_lib.table_digest(enc)
  model = params_io.load_model(SHIPPED)
  emb, mask = enc.encode(
      [
          'two red circles on a white background',
          'a blue square left of a yellow triangle on a gray background',
      ]
  )
  size, p = c.latent.height, c.model.patch_size
  x = jax.random.normal(jax.random.key(0), (2, (size // p) ** 2, c.model.in_channels))
  v = model(
      x,
      jnp.array([1.0, 0.5]),
      jnp.asarray(emb),
      jnp.asarray(mask),
      img_shape=(1, size // p, size // p),
  )
  assert v.shape == x.shape[:2] + (cfg.out_dim,) and v.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(v)))
  img = latents_lib.decode_pixels(x - v, size, size, p)  # one Euler step from σ=1 to 0
  assert img.shape == (2, size, size, 3)


def _shapes_probe():
  """benchmarks/shapes_probe.py as a module (benchmarks/ is not a package)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      'shapes_probe', os.path.join(REPO, 'benchmarks', 'shapes_probe.py')
  )
  probe_lib = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(probe_lib)
  return probe_lib


def test_shapes_probe_reports_on_the_shipped_checkpoint():
  """benchmarks/shapes_probe.py (the base-model diagnostic of benchmarks/RESULTS.md) on the shipped base."""
  probe_lib = _shapes_probe()
  r, imgs, texts = probe_lib.probe(SHIPPED, noises=1)
  assert imgs.shape == (6, 16, 16, 3) and len(texts) == 6
  mse = [row['x0_mse'] for row in r['denoising']]
  assert all(np.isfinite(mse)) and mse == sorted(mse)  # noisier inputs denoise worse
  assert all(row['color_swap_abs'] > 0 for row in r['denoising'])
  for g in r['generation'].values():
    assert sum(g['seen'].values()) == 2  # 2 colours x 1 noise per shape
    assert 0.0 <= g['strict'] <= 1.0


def test_shipped_latent_base_draws_the_shape_and_colour_it_is_asked_for():
  """assets/shapes_latent_base on assets/shapes_ae: the shape word moves the image
  comparably to the colour word (0.53 with 8 noises), and single objects come out as the prompted
  shape, never another, including the two held-out pairs among the probe's prompts (a red circle, a
  blue triangle)."""
  from digen_jax.experiment import config as configlib

  folder = os.path.join(REPO, configlib.SHAPES_LATENT_BASE_CHECKPOINT)
  cfg, _, extra = params_io.load_params(folder)
  c = configlib.shapes_latent_base(shapes_pretrain.get_config())
  assert cfg == experiment.model_config_from(c)
  assert (
      extra['latent']['ae'] == configlib.SHAPES_AE_CHECKPOINT and extra['latent']['channels'] == 8
  )
  assert extra['text_encoder']['table_sha256'] == text_lib.table_digest(
      experiment.build_text_encoder(c)
  )
  probe_lib = _shapes_probe()
  r, imgs, texts = probe_lib.probe(folder, noises=2)
  assert imgs.shape == (12, 32, 32, 3) and len(texts) == 12
  assert r['shape_to_color_sensitivity'] > 0.5, r['shape_to_color_sensitivity']
  for shape, g in r['generation'].items():
    # Of 2 colours x 2 noises: never another shape, and the prompted one at least half the time
    # (the rest are held-out pairs drawn too imprecisely for the strict checker: 'none').
    others = [k for k in ('circle', 'square', 'triangle') if k != shape]
    assert g['seen'][shape] >= 2 and all(g['seen'][k] == 0 for k in others), (shape, g)


# ------------------------------------------------------------------------------------------------
# the ShapesBench autoencoder (latent-space base generators)


@pytest.fixture(scope='module')
def tiny_ae(tmp_path_factory):
  """A briefly trained autoencoder folder (digen_jax.tasks.shapes.pretrain_ae at toy size)."""
  from digen_jax.tasks.shapes import pretrain_ae

  out = tmp_path_factory.mktemp('ae')
  summary = pretrain_ae.train(
      str(out),
      steps=30,
      batch=8,
      size=32,
      lr=2e-3,
      latent_channels=7,
      width=16,
      perturb=0.2,
      seed=0,
      eval_images=32,
      shape_channels=3,
      color_channels=3,
  )
  return str(out / 'params'), summary


def test_autoencoder_folder_round_trips_and_serves_as_a_vae(tiny_ae):
  from digen_jax.tasks.shapes import autoencoder as shapes_ae
  from digen_jax.models.vae import qwen_vae as vae_lib

  folder, summary = tiny_ae
  assert summary['strict_ground_truth'] == 1.0 and np.isfinite(summary['recon_mse'])
  assert 0.0 <= summary['strict_reconstructed'] <= 1.0
  cfg = shapes_ae.read_vae_config(folder)
  assert (cfg.latent_channels, cfg.spatial_compression, cfg.shape_channels) == (7, 4, 3)
  assert cfg.color_channels == 3 and cfg.semantic_channels == 6
  assert np.allclose(cfg.latent_std, summary['latent_std'])
  model = params_io.load_model(folder)
  assert isinstance(model, shapes_ae.ShapesAE)
  images = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)), jnp.float32)
  tokens = vae_lib.encode_packed(model, images, 1)
  assert tokens.shape == (2, 64, 7)
  out = vae_lib.decode_packed(model, tokens, (8, 8), 1)
  assert out.shape == (2, 32, 32, 3) and float(jnp.abs(out).max()) <= 1.0
  # normalize/denormalize invert each other with the stored statistics.
  z = model.encode(images)
  np.testing.assert_allclose(
      np.asarray(model.denormalize(model.normalize(z))), np.asarray(z), rtol=1e-5, atol=1e-5
  )
  with pytest.raises(ValueError, match='not a ShapesBench autoencoder'):
    shapes_ae.read_vae_config(SHIPPED)
  with pytest.raises(ValueError, match='shape_channels=3 must be 0 or 3'):
    shapes_ae.ShapesAEConfig(latent_channels=2, shape_channels=3)
  with pytest.raises(ValueError, match='color_channels=3 must be 0 or 3'):
    shapes_ae.ShapesAEConfig(latent_channels=5, shape_channels=3, color_channels=3)
  with pytest.raises(ValueError, match='color_channels=2 must be 0 or 3'):
    shapes_ae.ShapesAEConfig(latent_channels=8, color_channels=2)


def test_autoencoder_loss_teaches_the_shape_and_colour_channels_their_maps(tiny_ae):
  """The shape term is exactly the mean squared error between the leading latent channels and
  each latent cell's per-shape coverage, weighted by shape_weight; the colour term likewise for the
  next three channels and each cell's colour x coverage, weighted by color_weight."""
  from digen_jax.tasks.shapes import pretrain_ae
  from digen_jax.tasks.shapes import grammar
  from digen_jax.tasks.shapes import training as training_data

  model = params_io.load_model(tiny_ae[0])
  fresh = training_data.training_batch(
      training_data.BatchSpec(batch=16, size=32, seed=1000, shape_maps=True, color_maps=True), 1
  )
  maps_np = pretrain_ae.semantic_maps(fresh, model.config)
  assert maps_np.shape == (16, 32, 32, 6)
  x, maps = jnp.asarray(fresh.images), jnp.asarray(maps_np)
  targets = np.asarray(model.cell_means(maps))
  assert targets.shape == (16, 8, 8, 6) and targets[..., :3].max() > 0.9
  np.testing.assert_allclose(targets.mean(), maps_np.mean(), rtol=1e-5)  # pooling keeps area
  # Colour maps are coverage x the object's RGB: where one shape covers a cell fully, the colour
  # channels hold exactly one of the grammar's object colours.
  full = targets[..., :3].max(axis=-1) > 0.999
  palette = np.asarray(list(grammar.COLORS.values()), np.float32)
  dist = np.abs(targets[full][:, None, 3:] - palette[None]).max(axis=-1).min(axis=-1)
  assert full.any() and dist.max() < 1e-4, dist.max()
  z = np.asarray(model.encode(x))[..., :6]
  want_shape = float(np.mean((z[..., :3] - targets[..., :3]) ** 2))
  want_color = float(np.mean((z[..., 3:] - targets[..., 3:]) ** 2))
  key = jax.random.key(0)
  loss = lambda ws, wc: float(pretrain_ae.ae_loss(model, x, maps, key, 0.2, ws, wc))
  base = loss(0.0, 0.0)
  np.testing.assert_allclose(loss(2.5, 0.0) - base, 2.5 * want_shape, rtol=1e-4)
  np.testing.assert_allclose(loss(0.0, 1.5) - base, 1.5 * want_color, rtol=1e-4)
  for key_ in ('shape_channel_rmse', 'color_channel_rmse', 'strict_reconstructed_held_out'):
    assert np.isfinite(tiny_ae[1][key_]), key_  # reported by every training run


def test_decoder_only_training_keeps_the_latent_space_exactly(tiny_ae, tmp_path):
  """pretrain_ae --init_from --decoder_only --split=all: the decoder learns from renders of every
  composition while the encoder's params and the latent statistics stay bit-identical, so every
  generator trained on the old latents is still valid."""
  from digen_jax.tasks.shapes import pretrain_ae
  from digen_jax.tasks.shapes import autoencoder as shapes_ae

  folder, _ = tiny_ae
  summary = pretrain_ae.train(
      str(tmp_path), steps=3, batch=4, size=32, lr=1e-3, latent_channels=1, width=2,
      perturb=0.2, seed=3, eval_images=8, init_from=folder, decoder_only=True, split='all',
  )  # fmt: skip
  assert summary['decoder_only'] and summary['split'] == 'all'
  old_cfg, old, _ = params_io.load_params(folder)
  new_cfg, new, _ = params_io.load_params(str(tmp_path / 'params'))
  assert new_cfg == old_cfg  # same channels, same latent mean/std
  changed = {
      jax.tree_util.keystr(k): not np.array_equal(np.asarray(a), np.asarray(b))
      for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new))
  }
  assert not any(v for k, v in changed.items() if 'enc' in k), changed
  assert all(v for k, v in changed.items() if 'dec' in k), changed
  # One step trains too (its schedule has a warm-up of 0 and one decay step).
  one = pretrain_ae.train(
      str(tmp_path / 'one'), steps=1, batch=2, size=32, lr=1e-3, latent_channels=1, width=2,
      perturb=0.2, seed=3, eval_images=2, init_from=folder, decoder_only=True, split='all',
  )  # fmt: skip
  _, after_one, _ = params_io.load_params(str(tmp_path / 'one' / 'params'))
  assert one['steps'] == 1
  assert any(
      not np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(after_one))
  )
  with pytest.raises(ValueError, match='decoder_only needs init_from'):
    pretrain_ae.train(
        str(tmp_path), steps=1, batch=2, size=32, lr=1e-3, latent_channels=4, width=4,
        perturb=0.2, seed=0, eval_images=2, decoder_only=True,
    )  # fmt: skip
  assert isinstance(old_cfg, shapes_ae.ShapesAEConfig)


def test_shipped_autoencoder_reconstructs_ground_truth_the_checker_accepts():
  """assets/shapes_ae (the latents the ShapesBench base generators work in) keeps every shape: its
  reconstructions of fresh renders pass the strict checker as the renders do."""
  from digen_jax.tasks.shapes import training as training_data
  from digen_jax.tasks.shapes import autoencoder as shapes_ae
  from digen_jax.tasks.shapes import checker as shapes_checker

  folder = os.path.join(REPO, shapes_pretrain.configlib.SHAPES_AE_CHECKPOINT)
  cfg = shapes_ae.read_vae_config(folder)
  assert (cfg.latent_channels, cfg.shape_channels, cfg.spatial_compression) == (8, 3, 4)
  assert cfg.color_channels == 3
  model = params_io.load_model(folder)
  fresh = training_data.training_batch(
      training_data.BatchSpec(batch=96, size=32, seed=77, shape_maps=True, color_maps=True), 1
  )
  z = model.encode(jnp.asarray(fresh.images))
  recon = np.asarray(model.decode(z))
  assert shapes_checker.shapes_strict(fresh.images, fresh.truths).mean() == 1.0
  assert shapes_checker.shapes_strict(recon, fresh.truths).mean() >= 0.97
  # The shape channels hold the shape coverage (RMSE well below the targets' RMS).
  targets = np.asarray(model.cell_means(jnp.asarray(fresh.shape_maps)))
  rmse = float(np.sqrt(np.mean((np.asarray(z)[..., :3] - targets) ** 2)))
  assert rmse < 0.3 * float(np.sqrt(np.mean(targets**2))), rmse
  # ... and the colour channels the colour x coverage.
  targets = np.asarray(model.cell_means(jnp.asarray(fresh.color_maps)))
  rmse = float(np.sqrt(np.mean((np.asarray(z)[..., 3:6] - targets) ** 2)))
  assert rmse < 0.3 * float(np.sqrt(np.mean(targets**2))), rmse
  # Normalised latents are ~N(0, 1) per channel, as the generator expects.
  zn = np.asarray(model.normalize(z))
  assert np.all(np.abs(zn.mean(axis=(0, 1, 2))) < 0.3) and np.all(
      np.abs(zn.std(axis=(0, 1, 2)) - 1) < 0.3
  )


def _ae_config(folder, variant='test'):
  c = shapes_pretrain.get_config(variant)
  c.latent.space, c.latent.ae = 'ae', folder
  c.latent.height = c.latent.width = 8
  c.latent.channels = 7
  c.model.patch_size, c.model.in_channels, c.model.out_channels = 1, 7, 7
  c.pretrain.image_size = 32
  return c


@pytest.mark.slow
def test_pretrain_in_the_autoencoder_latent_space(tiny_ae, tmp_path):
  folder, _ = tiny_ae
  c = _ae_config(folder)
  c.pretrain.steps = 20
  summary = pretrain.train(c, str(tmp_path))
  assert np.all(np.isfinite(summary['losses']))
  _, _, extra = params_io.load_params(str(tmp_path / 'params'))
  assert extra['latent'] == {
      'space': 'ae',
      'ae': folder,
      'image_size': 32,
      'height': 8,
      'width': 8,
      'channels': 7,
  }
  bad = _ae_config(folder)
  bad.pretrain.image_size = 16
  with pytest.raises(
      ValueError, match='image_size=16 must equal latent.height 8 x the autoencoder'
  ):
    pretrain.validate(bad)
  bad = _ae_config(folder)
  bad.latent.ae = str(tmp_path / 'nowhere')
  with pytest.raises(ValueError, match='config.latent.ae'):
    pretrain.validate(bad)


def test_rl_rollout_decodes_with_the_autoencoder(tiny_ae, tmp_path):
  """An RL config in the autoencoder's latent space: the rollout program decodes its final
  latents to 32 px images with the autoencoder, inside the same jitted program."""
  from configs import shapes as shapes_rl
  from digen_jax import programs
  from digen_jax.parallel import mesh as mesh_lib

  folder, _ = tiny_ae
  c = shapes_rl.get_config()
  c.latent.space, c.latent.ae = 'ae', folder
  c.latent.height = c.latent.width = 8
  c.latent.channels = 7
  c.model.patch_size, c.model.in_channels, c.model.out_channels = 1, 7, 7
  c.model.init = 'random'
  c.rl.prompts_per_step, c.rl.group_size = 1, 2
  exp = experiment.build(c, str(tmp_path), 1)
  assert exp.weights.vae is not None and exp.latent_shape == (64, 7)
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  prompts = ['a red circle on a white background'] * 2
  cond = jax.tree.map(jnp.asarray, exp.conditioning(prompts))
  traj, images = programs.make_rollout(exp, mesh)(
      exp.params, cond, cond, jax.random.key(0), jnp.int32(0)
  )
  assert images.shape == (2, 32, 32, 3) and float(jnp.abs(images).max()) <= 1.0
  ae = params_io.load_model(folder)
  from digen_jax.models.vae import qwen_vae as vae_lib

  want = vae_lib.decode_packed(ae, traj.latents[-1], (8, 8), 1)
  np.testing.assert_allclose(np.asarray(images), np.asarray(want), atol=1e-5)
