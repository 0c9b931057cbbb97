"""Trains the ShapesBench autoencoder (models/shapes_ae.py) on rendered images; checks it keeps shapes.

  python -m digen_jax.tasks.shapes.pretrain_ae --workdir=DIR [--steps=4000] [--batch=64] [--size=32]
  python -m digen_jax.tasks.shapes.pretrain_ae --workdir=DIR --init_from=AE/params --decoder_only --split=all

The second form trains only the decoder of an existing autoencoder, on renders of every
composition of the grammar (images only; the autoencoder never sees a caption): the latents, and so
every generator trained on them, stay exactly valid, and the decoder learns to draw the (colour,
shape) pairs the generator's captions hold out, as a pipeline's VAE is trained on images at large.

Each step renders a batch of train-split images (data.shapes.training, clean captions unused) and
takes one AdamW step on

    loss = mean |D(E(x)) - x|^2 + mean |D(E(x) + perturb * std(E(x)) * eps) - x|^2

the second term makes the decoder map slightly-off latents (what a generator produces) to clean
images. With --shape_channels (default on), a third term, `shape_weight * mean |E(x)[..., :3] -
cell_means(shape coverage)|^2`, makes the first three latent channels hold the per-cell coverage of
each shape, and with --color_channels (default on) a fourth, `color_weight * mean |E(x)[..., 3:6] -
cell_means(colour x coverage)|^2`, the next three the objects' colour (models/shapes_ae.py says
why). Afterwards the per-channel latent mean/std are measured on fresh images and stored in the
config (the generator's latents are normalised by them), and the reconstructions of fresh images
are scored by the ShapesBench checker against their prompts: the strict accuracy of reconstructed
ground truth (and of renders of the held-out pairs, which training never drew) must be near the
renderer's own (100%), or the autoencoder would cap what any generator on top of it can score.
Writes DIR/params (params_io, AE_FORMAT) and DIR/summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from digen_jax.tasks.shapes import training as training_data
from digen_jax.models.io import initialize
from digen_jax.models.io import params_io
from digen_jax.tasks.shapes import autoencoder as shapes_ae
from digen_jax.tasks.shapes import checker as shapes_checker


def ae_loss(
    model: shapes_ae.ShapesAE,
    x: jax.Array,
    maps: jax.Array,
    key: jax.Array,
    perturb: float,
    shape_weight: float,
    color_weight: float = 0.0,
) -> jax.Array:
  """The training loss of the module docstring. x [B, S, S, 3]; maps [B, S, S, K], K =
  config.semantic_channels: shape coverage then colour x coverage (`semantic_maps`)."""
  z = model.encode(x)
  std = jax.lax.stop_gradient(jnp.std(z, axis=(0, 1, 2), keepdims=True))
  z_off = z + perturb * std * jax.random.normal(key, z.shape)
  loss = jnp.mean(jnp.square(model.decode_raw(z) - x)) + jnp.mean(
      jnp.square(model.decode_raw(z_off) - x)
  )
  k, n = model.config.shape_channels, model.config.semantic_channels
  if n:
    err = jnp.square(z[..., :n] - model.cell_means(maps))
    if k:
      loss += shape_weight * jnp.mean(err[..., :k])
    if n > k:
      loss += color_weight * jnp.mean(err[..., k:])
  return loss


def semantic_maps(batch: training_data.Batch, cfg: shapes_ae.ShapesAEConfig) -> np.ndarray:
  """[B, S, S, cfg.semantic_channels]: the batch's shape then colour maps (as many as cfg has)."""
  parts = [batch.shape_maps] if cfg.shape_channels else []
  parts += [batch.color_maps] if cfg.color_channels else []
  if not parts:
    return np.zeros(batch.images.shape[:3] + (0,), np.float32)
  return np.concatenate(parts, axis=-1)


def make_step(graphdef, optimizer, perturb: float, shape_weight: float, color_weight: float = 0.0):
  def loss_fn(params, x, maps, key):
    return ae_loss(nnx.merge(graphdef, params), x, maps, key, perturb, shape_weight, color_weight)

  @jax.jit
  def step(params, opt_state, x, maps, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, maps, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def train(
    workdir: str,
    *,
    steps: int,
    batch: int,
    size: int,
    lr: float,
    latent_channels: int,
    width: int,
    perturb: float,
    seed: int,
    eval_images: int,
    shape_channels: int = 0,
    shape_weight: float = 1.0,
    color_channels: int = 0,
    color_weight: float = 1.0,
    workers: int = 0,
    init_from: str = '',
    decoder_only: bool = False,
    split: str = 'train',
) -> dict:
  """Trains (or, with init_from, continues) an autoencoder; see the module docstring.

  decoder_only: only the decoder's params change (needs init_from): the latent space, and so every
  generator trained in it, stays valid, and the latent statistics are kept. split: the prompts the
  training renders are drawn from ('all' = every composition of the grammar; captions are unused).
  """
  t0 = time.time()
  new_model = {
      'latent_channels': latent_channels,
      'width': width,
      'shape_channels': shape_channels,
      'color_channels': color_channels,
  }
  cfg, graphdef, params = _initial_model(init_from, decoder_only, new_model, seed)
  optimizer = _optimizer(params, lr, steps, decoder_only)
  spec = training_data.BatchSpec(
      batch=batch,
      size=size,
      seed=seed,
      split=split,
      shape_maps=bool(cfg.shape_channels),
      color_maps=bool(cfg.color_channels),
  )
  step = make_step(graphdef, optimizer, perturb, shape_weight, color_weight)
  params, losses = _train_steps(step, params, optimizer.init(params), cfg, spec, steps, workers)
  cfg, checks = _latent_stats_and_checks(
      graphdef, params, cfg, size, seed, eval_images, perturb, decoder_only
  )
  settings = {
      'steps': steps,
      'batch': batch,
      'size': size,
      'lr': lr,
      'perturb': perturb,
      'seed': seed,
      'init_from': init_from,
      'decoder_only': decoder_only,
      'split': split,
  }
  weights = {'shape_weight': shape_weight, 'color_weight': color_weight}
  summary = _summary(settings, cfg, weights, params, losses, checks)
  summary['wall_s'] = time.time() - t0
  params_io.save_params(os.path.join(workdir, 'params'), params, cfg, extra=summary)
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  return summary


def _initial_model(
    init_from: str, decoder_only: bool, new_model: dict[str, int], seed: int
) -> tuple[shapes_ae.ShapesAEConfig, Any, nnx.State]:
  """(config, graphdef, params) to start from: init_from's autoencoder (its config wins over
  `new_model`, which is then never built), else a new one with `new_model`'s ShapesAEConfig
  fields, seeded by `seed`."""
  if init_from:
    cfg, params, _ = params_io.load_params(init_from)
    if not isinstance(cfg, shapes_ae.ShapesAEConfig):
      raise ValueError(f'init_from={init_from!r} is not a ShapesBench autoencoder folder')
    return cfg, shapes_ae.abstract_vae(cfg)[0], params
  if decoder_only:
    raise ValueError('decoder_only needs init_from (an autoencoder whose decoder to train)')
  cfg = shapes_ae.ShapesAEConfig(**new_model)
  graphdef, params = nnx.split(initialize.build(shapes_ae.ShapesAE, cfg, seed))
  return cfg, graphdef, params


def _optimizer(
    params: nnx.State, lr: float, steps: int, decoder_only: bool
) -> optax.GradientTransformation:
  """AdamW after a global-norm clip, warm-up then cosine decay to 10% of lr; with decoder_only
  the encoder's params are frozen. The warm-up is a tenth of the run (at most 200 steps) and
  the decay at least one step past it, so a run of 1 or 2 steps trains too."""
  warmup = min(200, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  if decoder_only:
    # The encoder's params get no update at all (not even weight decay): the latents stay exact.
    labels = nnx.map_state(
        lambda path, _: 'train' if path[0].startswith('dec') else 'freeze', params
    )
    optimizer = optax.multi_transform({'train': optimizer, 'freeze': optax.set_to_zero()}, labels)
  return optimizer


def _train_steps(
    step: Callable,
    params: nnx.State,
    opt_state: Any,
    cfg: shapes_ae.ShapesAEConfig,
    spec: training_data.BatchSpec,
    steps: int,
    workers: int,
) -> tuple[nnx.State, list[float]]:
  """The step loop over the rendered batches; returns the params and the loss every 200 steps."""
  key = jax.random.key(spec.seed + 1)
  losses = []
  with training_data.BatchStream(spec, workers=workers) as stream:
    for i in range(1, steps + 1):
      key, sub = jax.random.split(key)
      b = next(stream)
      maps = semantic_maps(b, cfg)
      params, opt_state, loss = step(
          params, opt_state, jnp.asarray(b.images), jnp.asarray(maps), sub
      )
      if i % 200 == 0 or i == steps:
        losses.append(float(loss))
        if not np.isfinite(losses[-1]):
          raise FloatingPointError(f'pretrain_ae: non-finite loss at step {i}; lower --lr')
        logging.info('step %d  loss %.5f', i, losses[-1])
  return params, losses


def _latent_stats_and_checks(
    graphdef,
    params: nnx.State,
    cfg: shapes_ae.ShapesAEConfig,
    size: int,
    seed: int,
    eval_images: int,
    perturb: float,
    decoder_only: bool,
) -> tuple[shapes_ae.ShapesAEConfig, dict[str, Any]]:
  """Latent statistics and the checks, on images the training never drew (another seed).

  Returns the config with the measured latent mean / std (with decoder_only, the ones it had)
  and the measurements: per-channel RMS error of the semantic channels, reconstruction MSE and
  the strict accuracy of ground truth, reconstructions, reconstructions of perturbed latents and
  of held-out pairs."""
  model = nnx.merge(graphdef, params)
  fresh = training_data.training_batch(
      training_data.BatchSpec(
          batch=eval_images, size=size, seed=seed + 1000, shape_maps=True, color_maps=True
      ),
      1,
  )
  encode = jax.jit(lambda p, x: nnx.merge(graphdef, p).encode(x))
  decode = jax.jit(lambda p, z: nnx.merge(graphdef, p).decode(z))
  z = np.asarray(encode(params, jnp.asarray(fresh.images)))
  if decoder_only:  # the generator's normalisation stays exactly what it was trained with
    mean, std = np.asarray(cfg.latent_mean), np.asarray(cfg.latent_std)
  else:
    mean, std = z.mean(axis=(0, 1, 2)), z.std(axis=(0, 1, 2))
    cfg = dataclasses.replace(cfg, latent_mean=tuple(mean.tolist()), latent_std=tuple(std.tolist()))
  n = cfg.semantic_channels
  semantic_err = (
      np.sqrt(
          np.mean(
              np.square(
                  z[..., :n] - np.asarray(model.cell_means(jnp.asarray(semantic_maps(fresh, cfg))))
              ),
              axis=(0, 1, 2),
          )
      )
      if n
      else np.zeros(0)
  )
  # Images of the held-out (colour, shape) pairs (the eval split), which the training never drew:
  # the decoder must render them too, or no generator on top could pass the eval split.
  held_out = training_data.training_batch(
      training_data.BatchSpec(batch=eval_images, size=size, seed=seed + 2000, split='eval'), 1
  )
  held_out_recon = np.asarray(decode(params, encode(params, jnp.asarray(held_out.images))))
  recon = np.asarray(decode(params, jnp.asarray(z)))
  eps = np.random.default_rng(seed).standard_normal(z.shape).astype(np.float32)
  noisy = np.asarray(decode(params, jnp.asarray(z + perturb * std * eps)))
  strict = lambda images, truths: float(shapes_checker.shapes_strict(images, truths).mean())
  return cfg, {
      'semantic_err': semantic_err,
      'recon_mse': float(np.mean((recon - fresh.images) ** 2)),
      'strict_ground_truth': strict(fresh.images, fresh.truths),
      'strict_reconstructed': strict(recon, fresh.truths),
      'strict_reconstructed_perturbed': strict(noisy, fresh.truths),
      'strict_reconstructed_held_out': strict(held_out_recon, held_out.truths),
      'latent_mean': mean.tolist(),
      'latent_std': std.tolist(),
  }


def _summary(
    settings: dict[str, Any],
    cfg: shapes_ae.ShapesAEConfig,
    weights: dict[str, float],
    params: nnx.State,
    losses: list[float],
    checks: dict[str, Any],
) -> dict[str, Any]:
  """summary.json (and the params folder's extra): the run's settings, the autoencoder's config,
  the final loss and the checks."""
  semantic_err = checks['semantic_err']
  k = cfg.shape_channels
  return {
      **settings,
      'config': {
          'latent_channels': cfg.latent_channels,
          'width': cfg.width,
          'shape_channels': cfg.shape_channels,
          'shape_weight': weights['shape_weight'],
          'color_channels': cfg.color_channels,
          'color_weight': weights['color_weight'],
      },
      'shape_channel_rmse': (
          float(np.sqrt(np.mean(np.square(semantic_err[:k])))) if cfg.shape_channels else None
      ),
      'color_channel_rmse': (
          float(np.sqrt(np.mean(np.square(semantic_err[k:])))) if cfg.color_channels else None
      ),
      'num_params': int(sum(x.size for x in jax.tree.leaves(params))),
      'final_loss': losses[-1] if losses else None,
      **{name: v for name, v in checks.items() if name != 'semantic_err'},
  }


def define_flags() -> None:
  """The command line (defined by __main__ only: tests import train() beside other modules'
  flags)."""
  flags.DEFINE_string('workdir', None, 'Output folder (params/, summary.json).')
  flags.DEFINE_integer('steps', 4000, 'Training steps.')
  flags.DEFINE_integer('batch', 64, 'Images per step.')
  flags.DEFINE_integer('size', 32, 'Image size (pixels).')
  flags.DEFINE_float('lr', 2e-3, 'Peak AdamW learning rate (cosine decay to 10%).')
  flags.DEFINE_integer('latent_channels', 8, 'Latent channels.')
  flags.DEFINE_integer(
      'shape_channels',
      3,
      'Leading latent channels that hold per-cell shape '
      'coverage (0 = a purely reconstructive latent).',
  )
  flags.DEFINE_float('shape_weight', 1.0, 'Weight of the shape-channel term.')
  flags.DEFINE_integer(
      'color_channels',
      3,
      'Latent channels after the shape channels that hold per-cell '
      'colour x coverage (0 = none; 3 = RGB).',
  )
  flags.DEFINE_float('color_weight', 1.0, 'Weight of the colour-channel term.')
  flags.DEFINE_integer('workers', 0, 'Processes rendering batches ahead (0 = in this process).')
  flags.DEFINE_string(
      'init_from',
      '',
      'An autoencoder params folder to continue from (its config '
      'replaces --latent_channels/--width/--shape_channels/--color_channels).',
  )
  flags.DEFINE_bool(
      'decoder_only',
      False,
      'Train only the decoder (needs --init_from): the latent space, '
      'and every generator trained in it, stays valid.',
  )
  flags.DEFINE_enum(
      'split',
      'train',
      ['train', 'all'],
      'Prompts the training images are rendered from: the train split, '
      'or every composition (images only; captions are never used).',
  )
  flags.DEFINE_integer('width', 64, 'Channels of the inner stages.')
  flags.DEFINE_float(
      'perturb', 0.2, 'Latent perturbation (in latent std units) the decoder ' 'learns to ignore.'
  )
  flags.DEFINE_integer('seed', 0, 'Seed of the init and the data.')
  flags.DEFINE_integer('eval_images', 512, 'Fresh images for the final checks.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  f = flags.FLAGS
  for name in ('steps', 'batch', 'eval_images', 'latent_channels', 'width'):
    if f[name].value < 1:
      raise SystemExit(f'digen_jax.tasks.shapes.pretrain_ae: --{name}={f[name].value} must be >= 1')
  if f.size % 4 or f.size < 16:
    raise SystemExit(
        f'digen_jax.tasks.shapes.pretrain_ae: --size={f.size} must be a multiple of 4, >= 16'
    )
  os.makedirs(f.workdir, exist_ok=True)
  s = train(
      f.workdir,
      steps=f.steps,
      batch=f.batch,
      size=f.size,
      lr=f.lr,
      latent_channels=f.latent_channels,
      width=f.width,
      perturb=f.perturb,
      seed=f.seed,
      eval_images=f.eval_images,
      shape_channels=f.shape_channels,
      shape_weight=f.shape_weight,
      color_channels=f.color_channels,
      color_weight=f.color_weight,
      workers=f.workers,
      init_from=f.init_from,
      decoder_only=f.decoder_only,
      split=f.split,
  )
  print(
      f"pretrain_ae: {s['steps']} steps in {s['wall_s']:.0f}s; strict accuracy of ground truth "
      f"{s['strict_ground_truth']:.3f}, reconstructed {s['strict_reconstructed']:.3f}, with "
      f"perturbed latents {s['strict_reconstructed_perturbed']:.3f}, held-out pairs "
      f"{s['strict_reconstructed_held_out']:.3f}; recon mse {s['recon_mse']:.5f}"
  )


if __name__ == '__main__':
  define_flags()
  app.run(main)
