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

Code: pretrain_config.py checks the config (and builds the batch spec and warm start from it),
flow_matching.py holds the programs (σ sampling, loss and train step, latent codec, samplers),
pretrain_eval.py the evals; this module runs them: set-up, the step loop, evals and saves.

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
from typing import Any, Callable

from absl import app
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from digen_jax.diffusion import sde as sde_lib
from digen_jax.experiment import build as experiment
from digen_jax.models.io import initialize
from digen_jax.models.transformers import mmdit
from digen_jax.models.io import params_io
from digen_jax.models.text import encoders as text_lib
from digen_jax.outputs import metrics as metrics_lib
from digen_jax.outputs import visualize
from digen_jax.process import cli
from digen_jax.tasks.shapes import grammar
from digen_jax.tasks.shapes import pretrain_config
from digen_jax.tasks.shapes import training as training_data

# The config checks, programs and evals live beside this module; what tests and benchmarks use
# of them stays importable from here.
from digen_jax.tasks.shapes.flow_matching import (
    LatentCodec,
    flow_matching_loss,
    latent_codec,
    make_sampler,
    make_train_step,
    sample_train_sigmas,
    zero_init_modulation,
)
from digen_jax.tasks.shapes.pretrain_config import batch_spec, validate, warm_start_params
from digen_jax.tasks.shapes.pretrain_eval import (
    eval_prompt_set,
    evaluate,
    single_count_misses,
    single_object_rates,
)

__all__ = [
    'batch_spec',
    'flow_matching_loss',
    'latent_codec',
    'make_sampler',
    'make_train_step',
    'sample_train_sigmas',
    'single_count_misses',
    'single_object_rates',
    'train',
    'validate',
    'warm_start_params',
    'zero_init_modulation',
]


@dataclasses.dataclass(frozen=True)
class _Programs:
  """What set-up builds once and every step, eval and save reads."""

  mcfg: mmdit.MMDiTConfig
  latent_shape: tuple[int, int]  # (tokens, channels) of one image
  codec: LatentCodec
  to_tokens: Callable  # jitted codec.to_tokens
  encoder: Any  # the frozen word encoder RL will build too
  lr: Callable  # step -> learning rate
  train_step: Callable  # make_train_step's
  uncond: tuple[jax.Array, jax.Array]  # the empty prompt's (text [1, L, D], mask [1, L])
  ode: Callable  # make_sampler's deterministic Euler sampler
  sde: Callable  # and its SDE sampler (GRPO's rollouts)


@dataclasses.dataclass(frozen=True)
class _TrainState:
  """What each step changes: the weights, the optimizer state and the EMA."""

  params: nnx.State
  opt_state: Any
  ema: Any  # the EMA of params; None when config.pretrain.ema == 0

  @property
  def eval_params(self) -> nnx.State:
    """What evals sample with and saves write: the EMA when one is kept."""
    return self.ema if self.ema is not None else self.params


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs pretraining; returns the summary (also written to workdir/summary.json)."""
  validate(config)
  p = config.pretrain
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  run, state = _set_up(config)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=False)
  extra = _checkpoint_extra(config, run.encoder)
  state, losses = _train_steps(config, run, state, writer, workdir, extra, t_start)
  train_wall = time.time() - t_start

  final_sets = _final_eval_sets(p)
  row, grids = _run_evals(
      config,
      run,
      state.eval_params,
      writer,
      int(p.steps),
      final_sets,
      int(p.final_eval_samples),
      t_start,
      final=True,
  )
  _save_sample_grid(workdir, *grids['eval'])
  summary = _summary(config, run.mcfg, losses, row, train_wall, t_start)
  final_extra = {
      'step': int(p.steps),
      'loss': summary['final_loss'],
      'train_wall_s': train_wall,
      'final_eval': summary['final_eval'],
  }
  _save(workdir, state.eval_params, run.mcfg, {**extra, **final_extra})
  _write_summary(workdir, summary)
  writer.close()
  summary['params'] = state.eval_params
  return summary


def _set_up(config: ml_collections.ConfigDict) -> tuple[_Programs, _TrainState]:
  """The model (random, adaLN-Zero or warm-started), its optimizer, the codec, the text encoder
  and the jitted programs."""
  p = config.pretrain
  mcfg = experiment.model_config_from(config)
  patch = int(config.model.patch_size)
  grid = int(config.latent.height)  # pixels ('pixel') or latents ('ae') per side
  img_shape = (1, grid // patch, grid // patch)
  codec = latent_codec(config)
  latent_shape = (img_shape[1] * img_shape[2], int(config.model.in_channels))
  encoder = experiment.build_text_encoder(config)  # the exact encoder RL will build
  sigmas = experiment.build_schedule(config, latent_shape[0])
  graphdef, params = _initial_params(config, mcfg)
  lr, optimizer = _optimizer(config)
  # The empty prompt: what text dropout trains and CFG's unconditional branch (RL's negative
  # prompt encodes to it too).
  uncond = tuple(jnp.asarray(a) for a in encoder.encode([config.sampler.negative_prompt]))
  ode, sde = _eval_samplers(config, graphdef, sigmas, img_shape, codec, uncond)
  logging.info(
      'pretrain: %s  params %d  tokens %s  sigmas %s',
      mcfg,
      mmdit.count_params(mcfg),
      latent_shape,
      np.round(sigmas, 3).tolist(),
  )
  run = _Programs(
      mcfg=mcfg,
      latent_shape=latent_shape,
      codec=codec,
      to_tokens=jax.jit(codec.to_tokens),
      encoder=encoder,
      lr=lr,
      train_step=make_train_step(graphdef, optimizer, p, img_shape),
      uncond=uncond,
      ode=ode,
      sde=sde,
  )
  ema = jax.tree.map(jnp.copy, params) if p.ema > 0 else None
  return run, _TrainState(params, optimizer.init(params), ema)


def _initial_params(
    config: ml_collections.ConfigDict, mcfg: mmdit.MMDiTConfig
) -> tuple[Any, nnx.State]:
  """(graphdef, params) of the generator at step 0."""
  p = config.pretrain
  graphdef, params = nnx.split(initialize.build(mmdit.MMDiT, mcfg, config.seed))
  if p.init_from:
    # Warm start: continue from a params folder (e.g. the shipped base) with a fresh optimizer.
    params = warm_start_params(config, mcfg)
  elif p.zero_init:
    params = zero_init_modulation(params)
  return graphdef, params


def _optimizer(config: ml_collections.ConfigDict) -> tuple[Callable, optax.GradientTransformation]:
  """(learning-rate schedule, optimizer): warm-up then cosine decay; AdamW after a global-norm
  clip."""
  p = config.pretrain
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
  return lr, optimizer


def _eval_samplers(
    config: ml_collections.ConfigDict,
    graphdef,
    sigmas: np.ndarray,
    img_shape: tuple[int, int, int],
    codec: LatentCodec,
    uncond: tuple[jax.Array, jax.Array],
) -> tuple[Callable, Callable]:
  """(ODE, SDE) samplers of the evals, with CFG as RL's rollouts apply it when guidance_scale > 1."""
  s = config.sampler
  sde_cfg = sde_lib.SDEConfig(
      kind=s.sde, noise_level=s.noise_level, logprob_reduce=s.logprob_reduce
  )
  guidance = None
  if s.guidance_scale > 1.0:
    guidance = (float(s.guidance_scale), bool(s.norm_rescale), uncond)
  ode = make_sampler(graphdef, sigmas, img_shape, codec.to_images, guidance=guidance)
  sde = make_sampler(graphdef, sigmas, img_shape, codec.to_images, sde_cfg, guidance=guidance)
  return ode, sde


def _checkpoint_extra(config: ml_collections.ConfigDict, encoder) -> dict[str, Any]:
  """What every save records beside the params: how RL must encode text, decode latents and
  sample to use them."""
  p = config.pretrain
  grid = int(config.latent.height)
  return {
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
          'image_size': int(p.image_size),
          'height': grid,
          'width': grid,
          'channels': int(config.latent.channels),
      },
      'sampler': {
          'scheduler': config.sampler.scheduler,
          'shift': float(config.sampler.shift),
          'num_steps': int(config.sampler.num_steps),
      },
      'cfg_trained': bool(p.text_dropout > 0) or pretrain_config.warm_start_cfg_trained(config),
      'weights': 'ema' if p.ema > 0 else 'raw',
  }


@dataclasses.dataclass
class _LossLog:
  """The step losses: device scalars since the last metrics row (fetched together, one host sync
  per log interval) and every value fetched so far."""

  t_start: float
  t_log: float = dataclasses.field(default_factory=time.time)
  window: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)
  seen: int = 0  # samples since the last row
  last: float = float('nan')  # the last row's mean loss

  def add(self, loss: jax.Array, samples: int) -> None:
    self.window.append(loss)
    self.seen += samples

  def row(self, step: int, lr: float) -> dict[str, float]:
    """The metrics row of the losses since the last one; FloatingPointError if one is not
    finite."""
    vals = [float(l) for l in jax.device_get(self.window)]
    self.window = []
    self.losses.extend(vals)
    if not all(math.isfinite(v) for v in vals):
      raise FloatingPointError(
          f'pretrain: non-finite loss at step {step}: {vals[-5:]}; lower config.pretrain.lr'
      )
    self.last = float(np.mean(vals))
    now = time.time()
    row = {
        'step': step,
        'loss': self.last,
        'lr': lr,
        'samples_per_s': self.seen / max(now - self.t_log, 1e-9),
        'wall_s': now - self.t_start,
    }
    self.t_log, self.seen = now, 0
    return row


def _train_steps(
    config: ml_collections.ConfigDict,
    run: _Programs,
    state: _TrainState,
    writer: metrics_lib.MetricsWriter,
    workdir: str,
    extra: dict[str, Any],
    t_start: float,
) -> tuple[_TrainState, list[float]]:
  """The step loop: one AdamW step per batch of the stream; a metrics row every log_every steps,
  evals every eval_every and a save every save_every (but the last step's: train() makes them).
  Returns the final state and every step's loss."""
  p = config.pretrain
  steps = int(p.steps)
  key = jax.random.key(config.seed + 2)
  # Periodic evals watch val (held-out relations, where settings are chosen) and train; the eval
  # split is scored once, at the end, for the report.
  eval_sets = {
      'val': eval_prompt_set('val', int(p.eval_prompts)),
      'train': eval_prompt_set('train', int(p.eval_prompts)),
  }
  log = _LossLog(t_start)
  stream = training_data.BatchStream(batch_spec(config), first_step=1, workers=int(p.data_workers))
  with stream:
    for step in range(1, steps + 1):
      batch = next(stream)
      key, sub = jax.random.split(key)
      state, loss = _train_step(run, state, batch, step, sub)
      log.add(loss, len(batch.captions))
      if step % int(p.log_every) == 0 or step == steps:
        _write_loss_row(writer, log.row(step, float(run.lr(step))))
      if p.eval_every and step % int(p.eval_every) == 0 and step != steps:
        _run_evals(
            config, run, state.eval_params, writer, step, eval_sets, int(p.eval_samples), t_start
        )
      if p.save_every and step % int(p.save_every) == 0 and step != steps:
        _save(workdir, state.eval_params, run.mcfg, {**extra, 'step': step, 'loss': log.last})
  return state, log.losses


def _train_step(
    run: _Programs, state: _TrainState, batch: training_data.Batch, step: int, key: jax.Array
) -> tuple[_TrainState, jax.Array]:
  """One optimizer step on a batch of (image, caption) pairs; the loss stays on the device."""
  x0 = run.to_tokens(run.codec.params, jnp.asarray(batch.images))
  emb, mask = run.encoder.encode(batch.captions)
  params, opt_state, ema, loss = run.train_step(
      state.params,
      state.opt_state,
      state.ema,
      jnp.float32(step),
      x0,
      jnp.asarray(emb),
      jnp.asarray(mask),
      run.uncond,
      key,
  )
  return _TrainState(params, opt_state, ema), loss


def _write_loss_row(writer: metrics_lib.MetricsWriter, row: dict[str, float]) -> None:
  writer.write(row)
  logging.info(
      'step %d  loss %.4f  lr %.2e  %.1f samples/s',
      row['step'],
      row['loss'],
      row['lr'],
      row['samples_per_s'],
  )


def _run_evals(
    config: ml_collections.ConfigDict,
    run: _Programs,
    params: nnx.State,
    writer: metrics_lib.MetricsWriter,
    step: int,
    sets: dict[str, list[str]],
    samples: int,
    t_start: float,
    final: bool = False,
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, list[str], int]]]:
  """Scores ODE samples of every prompt set (and SDE ones too when `final`) and writes them as
  one metrics row. Returns (row, split -> (images, prompts, samples per prompt))."""
  row = {'step': step}
  grids = {}
  for split, plist in sets.items():
    res, imgs = _evaluate(config, run, run.ode, params, plist, samples, seed=1000)
    row.update({f'{split}/{k}': v for k, v in res.items()})
    grids[split] = (imgs, plist, samples)
    if final:
      res, _ = _evaluate(config, run, run.sde, params, plist, samples, seed=2000)
      row.update({f'{split}_sde/{k}': v for k, v in res.items()})
  row['wall_s'] = time.time() - t_start
  writer.write(row)
  logging.info(
      'eval step %d: %s',
      step,
      {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
  )
  return row, grids


def _evaluate(
    config: ml_collections.ConfigDict,
    run: _Programs,
    sample_fn: Callable,
    params: nnx.State,
    prompts: list[str],
    samples: int,
    seed: int,
) -> tuple[dict[str, float], np.ndarray]:
  return evaluate(
      sample_fn,
      params,
      run.codec.params,
      run.encoder,
      prompts,
      samples,
      int(config.pretrain.eval_batch),
      run.latent_shape,
      seed=seed,
  )


def _final_eval_sets(p: ml_collections.ConfigDict) -> dict[str, list[str]]:
  """The final eval's prompt sets: the eval split (the reported figure), val, train and singles."""
  return {
      'eval': eval_prompt_set('eval', int(p.final_eval_prompts)),
      'val': eval_prompt_set('val', int(p.final_eval_prompts)),
      'train': eval_prompt_set('train', int(p.final_eval_prompts)),
      # The capability gate: every single-object prompt of the train split.
      'singles': [q.to_text() for q in grammar.split_prompts()['train'] if not q.is_relation],
  }


def _save_sample_grid(workdir: str, imgs: np.ndarray, plist: list[str], samples: int) -> None:
  """samples_final.png: the first sample of each of the first 24 prompts."""
  s = samples
  pick = list(range(0, min(len(plist), 24) * s, s))
  visualize.save_grid(
      os.path.join(workdir, 'samples_final.png'), imgs[pick], [plist[i // s] for i in pick], cols=6
  )


def _save(workdir: str, params: nnx.State, mcfg: mmdit.MMDiTConfig, extra: dict) -> None:
  params_io.save_params(os.path.join(workdir, 'params'), params, mcfg, extra)


def _summary(
    config: ml_collections.ConfigDict,
    mcfg: mmdit.MMDiTConfig,
    losses: list[float],
    final_row: dict[str, Any],
    train_wall: float,
    t_start: float,
) -> dict[str, Any]:
  """The run's summary: sizes, wall times, first and last losses and the final eval."""
  p = config.pretrain
  k = max(1, min(len(losses) // 10, 20))
  return {
      'steps': int(p.steps),
      'batch': int(p.batch),
      'num_params': mmdit.count_params(mcfg),
      'train_wall_s': train_wall,
      'total_wall_s': time.time() - t_start,
      'final_loss': float(np.mean(losses[-k:])),
      'first_loss': float(np.mean(losses[:k])),
      'losses': losses,
      'final_eval': {k2: v for k2, v in final_row.items() if k2 not in ('step', 'wall_s')},
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


def _write_summary(workdir: str, summary: dict[str, Any]) -> None:
  """summary.json: the summary without the per-step losses (metrics.jsonl holds them)."""
  short = {k: v for k, v in summary.items() if k != 'losses'}
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(short, f, indent=2, default=str)
  logging.info('pretrain done: %s', json.dumps(short, default=str))


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
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__, ('digen_jax.process.cli',))
  app.run(main, flags_parser=cli.parse_flags)
