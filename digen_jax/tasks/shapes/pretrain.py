"""Flow-matching pretraining of the ShapesBench base generator (the policy GRPO later post-trains).

  python -m digen_jax.tasks.shapes.pretrain --config=configs/shapes_pretrain.py --workdir=DIR

Each step takes a batch of (image, caption) pairs from `data.shapes.training` (train-split
prompts rendered on the fly, optionally rendered ahead by `data_workers` processes; a
`caption_noise` share of captions wrong in one attribute), encodes the captions with the frozen
cached word encoder, and takes one AdamW step on the flow-matching loss

    x_σ = (1 − σ)·x0 + σ·ε,   loss = mean ‖v_θ(x_σ, σ, text) − (ε − x0)‖²,

σ ~ logit-normal (SD3) or uniform. The jitted step takes the nnx.split state (graphdef closed
over), so the hot loop has no nnx.jit overhead. An EMA of the weights is kept (optional); evals
and saved params use it.

Evaluation (periodic and final) samples with the deterministic Euler ODE (with classifier-free
guidance when config.sampler.guidance_scale > 1, as RL's rollouts would) on the config's sampler
schedule (`experiment.build_schedule`, the one RL uses), B samples per prompt with fixed noise,
and scores them with the pure-code ShapesBench checker: strict accuracy (all atoms) and mean
partial credit, on the 'val' split (held-out relations, where settings are chosen) and on a fixed
subset of the 'train' split. The final eval adds the 'eval' split (the reported figure) and
'singles', every single-object train prompt, with strict accuracy per shape, colour and count (the
capability gate, `single_object_rates`, and why counted prompts miss it, `single_count_misses`);
it also scores SDE rollouts (the sampler GRPO uses), to show the reward spread RL starts from.

Writes under --workdir: metrics.jsonl (one row per logged step and per eval), params/ (params_io
folder: params.safetensors + config.json, refreshed every save_every steps and at the end),
samples_final.png (a grid of eval-split samples), summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from digen_jax.process import cli
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import visualize
from digen_jax.tasks.shapes import grammar
from digen_jax.tasks.shapes import training as training_data
from digen_jax.diffusion import sde as sde_lib
from digen_jax.models import initialize
from digen_jax.models import latents as latents_lib
from digen_jax.models import mmdit
from digen_jax.models import params_io
from digen_jax.tasks.shapes import autoencoder as shapes_ae
from digen_jax.models import vae as vae_lib
from digen_jax.models import text as text_lib
from digen_jax.tasks.shapes import checker as shapes_checker

_SIGMA_SAMPLING = ('logit_normal', 'uniform')


# ------------------------------------------------------------------------------------------------
# Config checks and data.


def validate(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the field and the fix; run before anything compiles."""
  configlib.validate(config, 1)
  if 'pretrain' not in config:
    raise ValueError('config has no `pretrain` section; use configs/shapes_pretrain.py')
  p, lat = config.pretrain, config.latent
  if lat.space not in ('pixel', 'ae'):
    raise ValueError(
        f"config.latent.space={lat.space!r}: pretraining renders pixels; use 'pixel' or "
        "'ae' (a digen_jax.tasks.shapes.pretrain_ae autoencoder at config.latent.ae)"
    )
  if lat.frames != 1 or lat.height != lat.width:
    raise ValueError(
        f'config.latent: frames={lat.frames}, {lat.height}x{lat.width}: ShapesBench '
        'images are square stills; use frames=1 and height == width'
    )
  if lat.space == 'pixel':
    if lat.channels != 3:
      raise ValueError(f'config.latent.channels={lat.channels}: pixel space is RGB; use 3')
    if p.image_size != lat.height:
      raise ValueError(
          f'config.pretrain.image_size={p.image_size} must equal latent.height='
          f'{lat.height} in pixel space'
      )
  else:
    acfg = shapes_ae.read_vae_config(experiment.checkpoint_folder(lat.ae, 'config.latent.ae'))
    if lat.channels != acfg.latent_channels:
      raise ValueError(
          f'config.latent.channels={lat.channels} but the autoencoder at '
          f'config.latent.ae has {acfg.latent_channels}'
      )
    if p.image_size != lat.height * acfg.spatial_compression:
      raise ValueError(
          f'config.pretrain.image_size={p.image_size} must equal latent.height '
          f'{lat.height} x the autoencoder compression {acfg.spatial_compression}'
      )
  if config.text.encoder != 'word':
    raise ValueError(
        f"config.text.encoder={config.text.encoder!r}: pretraining uses the 'word' encoder"
    )
  if p.sigma_sampling not in _SIGMA_SAMPLING:
    raise ValueError(
        f'config.pretrain.sigma_sampling={p.sigma_sampling!r} must be one of {_SIGMA_SAMPLING}'
    )
  for name in (
      'steps',
      'batch',
      'eval_prompts',
      'eval_samples',
      'final_eval_prompts',
      'final_eval_samples',
      'eval_batch',
      'log_every',
  ):
    if int(p[name]) < 1:
      raise ValueError(f'config.pretrain.{name}={p[name]} must be >= 1')
  if not 0.0 <= p.ema < 1.0:
    raise ValueError(f'config.pretrain.ema={p.ema} must be in [0, 1) (0 = off)')
  if not 0.0 <= p.text_dropout < 1.0:
    raise ValueError(f'config.pretrain.text_dropout={p.text_dropout} must be in [0, 1)')
  if config.sampler.negative_prompt.strip():
    raise ValueError(
        f'config.sampler.negative_prompt={config.sampler.negative_prompt!r}: text dropout trains '
        "the empty prompt, so CFG's unconditional branch must be it; use ' ' or ''"
    )
  if p.single_fraction > 1.0:
    raise ValueError(
        f'config.pretrain.single_fraction={p.single_fraction} must be <= 1 (< 0 = uniform)'
    )
  if not p.sigma_shift > 0:
    raise ValueError(f'config.pretrain.sigma_shift={p.sigma_shift} must be > 0 (1 = no shift)')
  if p.get('init_from'):
    experiment.checkpoint_folder(p.init_from, 'config.pretrain.init_from')
  if config.sampler.guidance_scale > 1.0 and p.text_dropout == 0:
    if not _warm_start_cfg_trained(config):
      raise ValueError(
          f'config.sampler.guidance_scale={config.sampler.guidance_scale} samples evals with CFG, '
          'but the model never learns the empty prompt; set config.pretrain.text_dropout > 0 '
          '(e.g. 0.15) or warm-start from a checkpoint trained with it'
      )
  try:
    batch_spec(config)
  except ValueError as e:
    raise ValueError(f'config.pretrain: {e}') from None
  if int(p.data_workers) < 0:
    raise ValueError(
        f'config.pretrain.data_workers={p.data_workers} must be >= 0 (0 = render in '
        'the training process)'
    )
  if p.warmup < 0 or p.warmup >= p.steps:
    raise ValueError(f'config.pretrain.warmup={p.warmup} must be in [0, steps={p.steps})')
  if not (math.isfinite(p.lr) and 0 < p.lr <= 1):  # NaN/inf would only show as a NaN loss
    raise ValueError(
        f'config.pretrain.lr={p.lr!r} must be a finite number in (0, 1] ' '(e.g. 2e-3)'
    )
  if not (math.isfinite(p.final_lr_frac) and 0 <= p.final_lr_frac <= 1):
    raise ValueError(f'config.pretrain.final_lr_frac={p.final_lr_frac!r} must be in [0, 1]')


def _warm_start_cfg_trained(config: ml_collections.ConfigDict) -> bool:
  """Whether config.pretrain.init_from's checkpoint learnt the empty prompt (text dropout)."""
  if not config.pretrain.get('init_from'):
    return False
  folder = experiment.checkpoint_folder(config.pretrain.init_from, 'config.pretrain.init_from')
  return bool(params_io.read_config(folder).get('extra', {}).get('cfg_trained'))


def batch_spec(config: ml_collections.ConfigDict) -> training_data.BatchSpec:
  """The training-pair stream config.pretrain describes."""
  p = config.pretrain
  kinds = tuple(k.strip() for k in str(p.caption_noise_kinds).split(',') if k.strip())
  count_weights = None
  if str(p.single_count_weights).strip():
    try:
      count_weights = tuple(float(w) for w in str(p.single_count_weights).split(','))
    except ValueError:
      raise ValueError(
          f'single_count_weights={p.single_count_weights!r}: give comma-separated numbers, '
          "e.g. '1,2,3' ('' = equal weights)"
      ) from None
  return training_data.BatchSpec(
      batch=int(p.batch),
      size=int(p.image_size),
      seed=int(config.seed),
      single_fraction=float(p.single_fraction),
      single_count_weights=count_weights,
      caption_noise=float(p.caption_noise),
      noise_kinds=kinds,
  )


def eval_prompt_set(split: str, n: int, seed: int = 0) -> list[str]:
  """A fixed set of min(n, |split|) distinct prompts (the whole eval split when n >= 100)."""
  pool = [p.to_text() for p in grammar.split_prompts()[split]]
  if n >= len(pool):
    return pool
  idx = np.sort(np.random.default_rng(seed).choice(len(pool), n, replace=False))
  return [pool[i] for i in idx]


# ------------------------------------------------------------------------------------------------
# Pure math (jit-able).


def sample_train_sigmas(
    key: jax.Array, batch: int, kind: str, mean: float = 0.0, std: float = 1.0, shift: float = 1.0
) -> jax.Array:
  """[batch] float32 σ in (0, 1): u ~ logit-normal (sigmoid(mean + std·z)) or uniform, then the
  static shift σ = s·u / (1 + (s − 1)·u) — the sampler's, so training covers the high-noise steps
  where a shifted schedule spends most of its steps (and where the layout is decided)."""
  if kind == 'logit_normal':
    u = jax.nn.sigmoid(mean + std * jax.random.normal(key, (batch,), jnp.float32))
  elif kind == 'uniform':
    u = jax.random.uniform(key, (batch,), jnp.float32, 1e-4, 1.0)
  else:
    raise ValueError(f'sigma sampling kind={kind!r} must be one of {_SIGMA_SAMPLING}')
  return shift * u / (1.0 + (shift - 1.0) * u)


# The output layer of the pooled-text projection (MMDiTConfig.pooled_text): zero at init and when
# warm-starting a checkpoint without it, so the pooled offset to the timestep embedding starts at 0.
POOLED_TEXT_OUTPUT = ('text_pool', 'linear_2')


def zero_init_modulation(params: nnx.State) -> nnx.State:
  """adaLN-Zero (DiT): zero the block modulations, the output modulation and the output projection.

  Every block then starts as the identity (gates 0) and the model outputs v = 0; in our runs this
  learns spatially coherent images much sooner than the default (random-gate) init. Returns a new
  State; the others' params are untouched.
  """
  zero = {
      ('blocks', 'img_mod'),
      ('blocks', 'txt_mod'),
      ('norm_out',),
      ('proj_out',),
      POOLED_TEXT_OUTPUT,
  }
  flat = []
  for path, var in nnx.to_flat_state(params):
    if path[:-1] in zero:
      var = var.replace(jnp.zeros_like(var[...]))
    flat.append((path, var))
  return nnx.from_flat_state(flat)


def flow_matching_loss(
    model: mmdit.MMDiT,
    x0: jax.Array,
    noise: jax.Array,
    sigma: jax.Array,
    text: jax.Array,
    mask: jax.Array,
    img_shape: tuple[int, int, int],
) -> jax.Array:
  """Scalar mean squared error of v_θ(x_σ) against ε − x0.

  x0, noise: [B, N, C] packed tokens; sigma [B]; text [B, L, D]; mask [B, L].
  """
  s = sigma[:, None, None]
  x_t = (1.0 - s) * x0 + s * noise
  v = model(x_t, sigma, text, mask, img_shape=img_shape)
  return jnp.mean(jnp.square(v - (noise - x0)))


def make_train_step(
    graphdef, optimizer: optax.GradientTransformation, pcfg, img_shape: tuple[int, int, int]
) -> Callable:
  """jitted (params, opt_state, ema, step, x0 [B,N,C], text, mask, uncond (text [1,L,D], mask [1,L]),
  key) -> (params, opt_state, ema, loss). `ema` is None when pcfg.ema == 0."""
  kind, mean, std = pcfg.sigma_sampling, float(pcfg.logit_mean), float(pcfg.logit_std)
  shift = float(pcfg.sigma_shift)
  drop, ema_decay = float(pcfg.text_dropout), float(pcfg.ema)

  def step_fn(params, opt_state, ema, step, x0, text, mask, uncond, key):
    k_sigma, k_noise, k_drop = jax.random.split(key, 3)
    b = x0.shape[0]
    sigma = sample_train_sigmas(k_sigma, b, kind, mean, std, shift)
    noise = jax.random.normal(k_noise, x0.shape, jnp.float32)
    if drop > 0:
      # Replace a random subset of prompts with the empty prompt, so v(x, σ, "") is learnt for CFG.
      keep = jax.random.uniform(k_drop, (b,)) >= drop
      text = jnp.where(keep[:, None, None], text, uncond[0])
      mask = jnp.where(keep[:, None], mask, uncond[1])

    def loss_fn(p):
      return flow_matching_loss(nnx.merge(graphdef, p), x0, noise, sigma, text, mask, img_shape)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if ema is not None:
      # Warm-started EMA: early on the average should follow the weights, not the random init.
      d = jnp.minimum(ema_decay, (1.0 + step) / (10.0 + step))
      ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, ema, params)
    return params, opt_state, ema, loss

  return jax.jit(step_fn, donate_argnums=(0, 1, 2))


@dataclasses.dataclass(frozen=True)
class LatentCodec:
  """images [B, S, S, 3] <-> generator tokens [B, N, C] of config.latent, as pure functions of
  `params` (the autoencoder's weights, None in pixel space). Programs take `params` as an
  argument: a device array closed over would be a captured constant, which a GPU's transfer
  guard refuses to lower."""

  params: Any
  to_tokens: Callable  # (params, images) -> tokens
  to_images: Callable  # (params, tokens) -> images


def latent_codec(config: ml_collections.ConfigDict) -> LatentCodec:
  """The LatentCodec of config.latent: 'pixel', the identity (patch packing); 'ae', the
  autoencoder at config.latent.ae (normalised latents, packed as the pipelines pack theirs)."""
  lat, patch = config.latent, int(config.model.patch_size)
  if lat.space == 'pixel':
    size = int(lat.height)
    return LatentCodec(
        None,
        lambda _, im: latents_lib.pack(im, patch),
        lambda _, tok: latents_lib.decode_pixels(tok, size, size, patch),
    )
  ae_graph, ae_params = nnx.split(
      params_io.load_model(experiment.checkpoint_folder(lat.ae, 'config.latent.ae'))
  )
  hw = (int(lat.height), int(lat.width))
  return LatentCodec(
      ae_params,
      lambda p, im: vae_lib.encode_packed(nnx.merge(ae_graph, p), im, patch),
      lambda p, tok: vae_lib.decode_packed(nnx.merge(ae_graph, p), tok, hw, patch),
  )


def make_sampler(
    graphdef,
    sigmas: np.ndarray,
    img_shape: tuple[int, int, int],
    to_images: Callable,
    sde_cfg: sde_lib.SDEConfig | None = None,
    guidance: tuple[float, bool, tuple[jax.Array, jax.Array]] | None = None,
) -> Callable:
  """jitted (params, codec_params, x1 [B,N,C] initial noise, text, mask, key) -> images
  [B, S, S, 3] (to_images(codec_params, tokens): LatentCodec's decoder).

  guidance None: the conditional velocity. Otherwise (scale, norm_rescale, (text [1,L,D], mask
  [1,L]) of the negative prompt): classifier-free guidance as RL's rollouts apply it
  (sde.cfg_velocity).

  sde_cfg None: deterministic Euler ODE over `sigmas` (key unused). Otherwise steps 0 … T−2 are SDE
  steps of that kind and the last one (σ → 0) is Euler, as in GRPO rollouts (rl.timesteps never
  makes the last step stochastic: noise added there would stay in the image); step noise from
  fold_in(key, t).
  """
  # numpy (staged as literals), never device arrays closed over (LatentCodec says why).
  sig_host = np.asarray(sigmas, np.float32)
  t_steps = int(sig_host.shape[0]) - 1
  if guidance:
    guidance = (guidance[0], guidance[1], tuple(np.asarray(u) for u in guidance[2]))

  def run(params, codec_params, x1, text, mask, key):
    model = nnx.merge(graphdef, params)
    b = x1.shape[0]
    sig = jnp.asarray(sig_host)  # inside the trace: a literal of this program

    def velocity(_, x, s, cond):
      return model(x, s, cond[0], cond[1], img_shape=img_shape)

    scale, rescale, uncond = guidance if guidance else (None, False, None)
    if uncond is not None:
      uncond = tuple(jnp.broadcast_to(u, c.shape) for u, c in zip(uncond, (text, mask)))

    def body(x, t):
      s = jnp.broadcast_to(sig[t], (b,))
      sn = jnp.broadcast_to(sig[t + 1], (b,))
      v = sde_lib.cfg_velocity(velocity, None, x, s, (text, mask), uncond, scale, rescale)
      if sde_cfg is None:
        return sde_lib.euler_step(x, v, s, sn), None
      eps = jax.random.normal(jax.random.fold_in(key, t), x.shape, jnp.float32)
      x_sde = sde_lib.sde_step(x, v, s, sn, eps, sde_cfg)[0]
      return jnp.where(t < t_steps - 1, x_sde, sde_lib.euler_step(x, v, s, sn)), None

    x0, _ = jax.lax.scan(body, x1.astype(jnp.float32), jnp.arange(t_steps))
    return to_images(codec_params, x0)

  return jax.jit(run)


# ------------------------------------------------------------------------------------------------
# Evaluation.


def evaluate(
    sample_fn: Callable,
    params,
    codec_params,
    encoder,
    prompts: Sequence[str],
    samples_per_prompt: int,
    batch: int,
    latent_shape: tuple[int, int],
    seed: int,
) -> tuple[dict[str, float], np.ndarray]:
  """Samples `samples_per_prompt` images per prompt and checks them.

  Noise is a fixed function of (seed, image index), so repeated evals of the same params agree.
  Returns (metrics, images [P*S, H, W, 3]) with metrics strict_accuracy, reward_mean, and the
  strict accuracy of single-object and relation prompts separately.
  """
  texts = [p for p in prompts for _ in range(samples_per_prompt)]
  n = len(texts)
  init_key, step_key = jax.random.split(jax.random.key(seed))
  images = []
  for start in range(0, n, batch):
    chunk = texts[start : start + batch]
    pad = batch - len(chunk)  # pad the last chunk so every call has the same (compiled) shape
    emb, mask = encoder.encode(chunk + [chunk[-1]] * pad)
    keys = jax.random.split(jax.random.fold_in(init_key, start // batch), batch)
    x1 = jax.vmap(lambda k: jax.random.normal(k, latent_shape, jnp.float32))(keys)
    out = sample_fn(
        params,
        codec_params,
        x1,
        jnp.asarray(emb),
        jnp.asarray(mask),
        jax.random.fold_in(step_key, start // batch),
    )
    images.append(np.asarray(out)[: len(chunk)])
  images = np.concatenate(images, axis=0)
  checked = shapes_checker.check_all(images, texts)
  strict = np.array([r.strict for r in checked])
  partial = np.array([r.partial for r in checked], np.float32)
  is_rel = np.array([grammar.parse(t).is_relation for t in texts])
  res = {
      'strict_accuracy': float(strict.mean()),
      'reward_mean': float(partial.mean()),
      'reward_std': float(partial.std()),
      'num_prompts': len(prompts),
      'samples_per_prompt': samples_per_prompt,
  }
  if (~is_rel).any():
    res['strict_accuracy_single'] = float(strict[~is_rel].mean())
  if is_rel.any():
    res['strict_accuracy_relation'] = float(strict[is_rel].mean())
  res.update(single_object_rates(strict, texts))
  res.update(single_count_misses(checked, texts))
  return res, images


def single_object_rates(strict: np.ndarray, texts: Sequence[str]) -> dict[str, float]:
  """Strict accuracy of the single-object prompts among `texts`, per shape, colour and count
  ('single/shape/circle', ...), and the smallest of them ('single/min'): the capability gate.

  Shapes and colours are judged on one-object prompts (count words are composition); each count
  on every single-object prompt with that count."""
  rates: dict[str, float] = {}
  parsed = [grammar.parse(t) for t in texts]
  single = np.array([not q.is_relation for q in parsed])
  if not single.any():
    return rates
  obj = [q.objects[0] for q in parsed]
  one = single & np.array([o.count == 1 for o in obj])
  for attr, values in (('shape', grammar.SHAPES), ('color', tuple(grammar.COLORS))):
    for v in values:
      sel = one & np.array([getattr(o, attr) == v for o in obj])
      if sel.any():
        rates[f'single/{attr}/{v}'] = float(strict[sel].mean())
  for n in range(1, grammar.MAX_COUNT + 1):
    sel = single & np.array([o.count == n for o in obj])
    if sel.any():
      rates[f'single/count/{n}'] = float(strict[sel].mean())
  rates['single/min'] = min(rates.values())
  return rates


def single_count_misses(
    checked: Sequence[shapes_checker.CheckResult], texts: Sequence[str]
) -> dict[str, float]:
  """Why the capability gate's counted prompts fail: among the single-object samples of each count
  n >= 2, the share whose count atom fails ('single/miss_count/n': a missing, extra or merged
  object) and the share whose shape atom fails ('single/miss_shape/n': some object not drawn as
  the prompted shape). A sample can miss both."""
  out: dict[str, float] = {}
  parsed = [grammar.parse(t) for t in texts]
  for n in range(2, grammar.MAX_COUNT + 1):
    sel = [r for r, q in zip(checked, parsed) if not q.is_relation and q.objects[0].count == n]
    if sel:
      out[f'single/miss_count/{n}'] = float(np.mean([not r.atoms['0_count'] for r in sel]))
      out[f'single/miss_shape/{n}'] = float(np.mean([not r.atoms['0_shape'] for r in sel]))
  return out


# ------------------------------------------------------------------------------------------------
# The run.


def warm_start_params(config: ml_collections.ConfigDict, mcfg: mmdit.MMDiTConfig) -> nnx.State:
  """config.pretrain.init_from's params; ValueError if its architecture is not config.model's.

  One difference is allowed: a checkpoint without pooled text conditioning warm-starts a model with
  it (config.model.pooled_text=True). The new `text_pool` projection starts with a zero output
  layer, so the warm-started model computes exactly the checkpoint's function at step 0."""
  path = experiment.checkpoint_folder(config.pretrain.init_from, 'config.pretrain.init_from')
  ckpt_cfg, params, _ = params_io.load_params(path)
  adds_pool = mcfg.pooled_text and not ckpt_cfg.pooled_text
  if not experiment.same_architecture(
      dataclasses.replace(ckpt_cfg, pooled_text=mcfg.pooled_text) if adds_pool else ckpt_cfg, mcfg
  ):
    raise ValueError(
        f'config.pretrain.init_from={config.pretrain.init_from!r} holds {ckpt_cfg}, but '
        f'config.model asks for {mcfg}; warm-start from a checkpoint of the same architecture'
    )
  if not adds_pool:
    return params
  _, fresh = nnx.split(initialize.build(mmdit.MMDiT, mcfg, config.seed))
  loaded = dict(nnx.to_flat_state(params))
  flat = []
  for path_, var in nnx.to_flat_state(fresh):
    if path_ in loaded:
      var = loaded[path_]
    elif path_[:-1] == POOLED_TEXT_OUTPUT:
      var = var.replace(jnp.zeros_like(var[...]))
    flat.append((path_, var))
  return nnx.from_flat_state(flat)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs pretraining; returns the summary (also written to workdir/summary.json)."""
  validate(config)
  p = config.pretrain
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))

  mcfg = experiment.model_config_from(config)
  size, patch = int(p.image_size), int(config.model.patch_size)
  grid = int(config.latent.height)  # pixels ('pixel') or latents ('ae') per side
  img_shape = (1, grid // patch, grid // patch)
  codec = latent_codec(config)
  to_tokens = jax.jit(codec.to_tokens)
  latent_shape = (img_shape[1] * img_shape[2], int(config.model.in_channels))
  encoder = experiment.build_text_encoder(config)  # the exact encoder RL will build
  sigmas = experiment.build_schedule(config, latent_shape[0])
  sde_cfg = sde_lib.SDEConfig(
      kind=config.sampler.sde,
      noise_level=config.sampler.noise_level,
      logprob_reduce=config.sampler.logprob_reduce,
  )

  model = initialize.build(mmdit.MMDiT, mcfg, config.seed)
  graphdef, params = nnx.split(model)
  del model
  if p.init_from:
    # Warm start: continue from a params folder (e.g. the shipped base) with a fresh optimizer.
    params = warm_start_params(config, mcfg)
  elif p.zero_init:
    params = zero_init_modulation(params)
  num_params = mmdit.count_params(mcfg)
  lr = optax.warmup_cosine_decay_schedule(
      0.0, p.lr, max(int(p.warmup), 1), int(p.steps), end_value=p.lr * p.final_lr_frac
  )
  optimizer = optax.chain(
      optax.clip_by_global_norm(p.grad_clip),
      optax.adamw(
          lr,
          b1=config.optim.b1,
          b2=config.optim.b2,
          eps=config.optim.eps,
          weight_decay=p.weight_decay,
      ),
  )
  opt_state = optimizer.init(params)
  ema = jax.tree.map(jnp.copy, params) if p.ema > 0 else None
  train_step = make_train_step(graphdef, optimizer, p, img_shape)
  # The empty prompt: what text dropout trains and CFG's unconditional branch (RL's negative
  # prompt encodes to it too).
  uncond = tuple(jnp.asarray(a) for a in encoder.encode([config.sampler.negative_prompt]))
  guidance = None
  if config.sampler.guidance_scale > 1.0:
    guidance = (float(config.sampler.guidance_scale), bool(config.sampler.norm_rescale), uncond)
  ode = make_sampler(graphdef, sigmas, img_shape, codec.to_images, guidance=guidance)
  sde = make_sampler(graphdef, sigmas, img_shape, codec.to_images, sde_cfg, guidance=guidance)

  key = jax.random.key(config.seed + 2)
  # Periodic evals watch val (held-out relations, where settings are chosen) and train; the eval
  # split is scored once, at the end, for the report.
  eval_sets = {
      'val': eval_prompt_set('val', int(p.eval_prompts)),
      'train': eval_prompt_set('train', int(p.eval_prompts)),
  }
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=False)
  logging.info(
      'pretrain: %s  params %d  tokens %s  sigmas %s',
      mcfg,
      num_params,
      latent_shape,
      np.round(sigmas, 3).tolist(),
  )

  def eval_params():
    return ema if ema is not None else params

  def run_evals(step, sets, samples, final=False):
    row = {'step': step}
    grids = {}
    for split, plist in sets.items():
      res, imgs = evaluate(
          ode,
          eval_params(),
          codec.params,
          encoder,
          plist,
          samples,
          int(p.eval_batch),
          latent_shape,
          seed=1000,
      )
      row.update({f'{split}/{k}': v for k, v in res.items()})
      grids[split] = (imgs, plist, samples)
      if final:
        res, _ = evaluate(
            sde,
            eval_params(),
            codec.params,
            encoder,
            plist,
            samples,
            int(p.eval_batch),
            latent_shape,
            seed=2000,
        )
        row.update({f'{split}_sde/{k}': v for k, v in res.items()})
    row['wall_s'] = time.time() - t_start
    writer.write(row)
    logging.info(
        'eval step %d: %s',
        step,
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
    )
    return row, grids

  def save(step, extra):
    params_io.save_params(os.path.join(workdir, 'params'), eval_params(), mcfg, extra)

  common_extra = {
      'text_encoder': {
          'kind': 'word',
          'dim': int(config.model.joint_attention_dim),
          'max_length': int(config.text.max_length),
          'seed': int(config.text.seed),
          'table_sha256': text_lib.table_digest(encoder),
      },
      'latent': {
          'space': config.latent.space,
          'ae': config.latent.ae,
          'image_size': size,
          'height': grid,
          'width': grid,
          'channels': int(config.latent.channels),
      },
      'sampler': {
          'scheduler': config.sampler.scheduler,
          'shift': float(config.sampler.shift),
          'num_steps': int(config.sampler.num_steps),
      },
      'cfg_trained': bool(p.text_dropout > 0) or _warm_start_cfg_trained(config),
      'weights': 'ema' if p.ema > 0 else 'raw',
  }

  losses, window, t_log, seen = [], [], time.time(), 0
  loss_ema = float('nan')
  stream = training_data.BatchStream(batch_spec(config), first_step=1, workers=int(p.data_workers))
  with stream:
    for step in range(1, int(p.steps) + 1):
      batch = next(stream)
      texts = batch.captions
      x0 = to_tokens(codec.params, jnp.asarray(batch.images))
      emb, mask = encoder.encode(texts)
      key, sub = jax.random.split(key)
      params, opt_state, ema, loss = train_step(
          params,
          opt_state,
          ema,
          jnp.float32(step),
          x0,
          jnp.asarray(emb),
          jnp.asarray(mask),
          uncond,
          sub,
      )
      seen += len(texts)
      window.append(loss)
      if step % int(p.log_every) == 0 or step == int(p.steps):
        vals = [float(l) for l in jax.device_get(window)]  # one host sync per log interval
        window = []
        losses.extend(vals)
        if not all(math.isfinite(v) for v in vals):
          raise FloatingPointError(
              f'pretrain: non-finite loss at step {step}: {vals[-5:]}; lower ' 'config.pretrain.lr'
          )
        loss_ema = float(np.mean(vals))
        now = time.time()
        row = {
            'step': step,
            'loss': loss_ema,
            'lr': float(lr(step)),
            'samples_per_s': seen / max(now - t_log, 1e-9),
            'wall_s': now - t_start,
        }
        writer.write(row)
        logging.info(
            'step %d  loss %.4f  lr %.2e  %.1f samples/s',
            step,
            loss_ema,
            row['lr'],
            row['samples_per_s'],
        )
        t_log, seen = now, 0
      if p.eval_every and step % int(p.eval_every) == 0 and step != int(p.steps):
        run_evals(step, eval_sets, int(p.eval_samples))
      if p.save_every and step % int(p.save_every) == 0 and step != int(p.steps):
        save(step, {**common_extra, 'step': step, 'loss': loss_ema})

  train_wall = time.time() - t_start
  final_sets = {
      'eval': eval_prompt_set('eval', int(p.final_eval_prompts)),
      'val': eval_prompt_set('val', int(p.final_eval_prompts)),
      'train': eval_prompt_set('train', int(p.final_eval_prompts)),
      # The capability gate: every single-object prompt of the train split.
      'singles': [q.to_text() for q in grammar.split_prompts()['train'] if not q.is_relation],
  }
  row, grids = run_evals(int(p.steps), final_sets, int(p.final_eval_samples), final=True)
  imgs, plist, s = grids['eval']
  pick = list(range(0, min(len(plist), 24) * s, s))  # the first sample of the first 24 prompts
  visualize.save_grid(
      os.path.join(workdir, 'samples_final.png'), imgs[pick], [plist[i // s] for i in pick], cols=6
  )
  k = max(1, min(len(losses) // 10, 20))
  summary = {
      'steps': int(p.steps),
      'batch': int(p.batch),
      'num_params': num_params,
      'train_wall_s': train_wall,
      'total_wall_s': time.time() - t_start,
      'final_loss': float(np.mean(losses[-k:])),
      'first_loss': float(np.mean(losses[:k])),
      'losses': losses,
      'final_eval': {k2: v for k2, v in row.items() if k2 not in ('step', 'wall_s')},
      'model_config': {
          f: getattr(mcfg, f)
          for f in (
              'patch_size',
              'in_channels',
              'out_channels',
              'num_layers',
              'attention_head_dim',
              'num_attention_heads',
              'joint_attention_dim',
              'axes_dims_rope',
          )
      },
      'command': ' '.join(
          [os.path.basename(sys.executable), '-m', 'digen_jax.tasks.shapes.pretrain'] + sys.argv[1:]
      ),
  }
  save(
      int(p.steps),
      {
          **common_extra,
          'step': int(p.steps),
          'loss': summary['final_loss'],
          'train_wall_s': train_wall,
          'final_eval': summary['final_eval'],
      },
  )
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump({k2: v for k2, v in summary.items() if k2 != 'losses'}, f, indent=2, default=str)
  writer.close()
  logging.info(
      'pretrain done: %s',
      json.dumps({k2: v for k2, v in summary.items() if k2 != 'losses'}, default=str),
  )
  summary['params'] = eval_params()
  return summary


def main(argv):
  del argv
  # cli's --config/--workdir and flag parser: a bad file or override is one line, as in main.
  config, workdir = cli.config_and_workdir()
  try:
    validate(config)
  except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, before compiling
    sys.exit(f'digen_jax.tasks.shapes.pretrain: {e}')
  try:
    summary = train(config, workdir)
  except FloatingPointError as e:  # diverged: its message names the step and the fix
    sys.exit(f'digen_jax.tasks.shapes.pretrain: {e}')
  ev = summary['final_eval']
  print(
      f"pretrain: {summary['steps']} steps in {summary['train_wall_s']:.0f}s, final loss "
      f"{summary['final_loss']:.4f}; strict accuracy eval {ev['eval/strict_accuracy']:.3f} "
      f"train {ev['train/strict_accuracy']:.3f} (ODE); params -> "
      f"{os.path.join(workdir, 'params')}"
  )


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
