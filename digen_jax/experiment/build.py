"""Builds every part of a run from its config: model, text encoder, prompts, reward, schedule,
optimizer. Pure construction: nothing here compiles or runs the hot loop."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from digen_jax.experiment import abstract_weights
from digen_jax.experiment import config as configlib
from digen_jax.data import prompts as prompt_data
from digen_jax.diffusion import sigmas as sigmas_lib
from digen_jax.diffusion import sde as sde_lib
from digen_jax.experiment import folder_config
from digen_jax.experiment import run as run_lib
from digen_jax.experiment import fragments
from digen_jax.experiment import weights as weights_lib
from digen_jax.models.attention import kernels as attention_lib
from digen_jax.models import family as family_lib
from digen_jax.models.io import params_io
from digen_jax.models.text import encoders as text_lib
from digen_jax.models.text import text_cache
from digen_jax.rewards import scoring as reward_scoring
from digen_jax.rl import old_policy
from digen_jax.rl import timesteps as timesteps_lib


def model_config_from(config):
  """The architecture config (MMDiTConfig, FluxConfig) of config.model's family."""
  return family_lib.of(config).config_from(config.model)


def same_architecture(a, b) -> bool:
  """Equal up to the execution options (remat, scan_layers, attention), which change neither
  math nor params."""
  return (
      type(a) is type(b)
      and dataclasses.replace(a, remat=b.remat, scan_layers=b.scan_layers, attention=b.attention)
      == b
  )


def attention_choice(config) -> str:
  """What the transformer's attention runs in this process (models/attention/kernels.py): 'cudnn' or
  'portable'. config.model.attention='fused' where cuDNN cannot run is a ValueError naming why,
  raised before anything compiles."""
  m = config.model
  dtype = jnp.bfloat16 if config.optim.compute_dtype == 'bfloat16' else jnp.float32
  why = attention_lib.fused_unsupported(jax.default_backend(), dtype, m.attention_head_dim)
  if m.attention == 'fused' and why:
    raise ValueError(
        f"config.model.attention='fused' cannot run here: {why}; use 'auto' (fused where it "
        "can run, portable elsewhere) or 'portable'"
    )
  return attention_lib.resolve(m.attention, dtype, m.attention_head_dim)


def checkpoint_folder(path: str, field: str = 'config.model.checkpoint') -> str:
  """A checkpoint path as an existing folder (repo-relative paths such as the shipped
  assets/shapes_base work from any cwd); ValueError naming `field` otherwise."""
  path = weights_lib.repo_path(path)
  if not os.path.isdir(path):
    raise ValueError(
        f'{field}={path!r} is not a readable folder; give a params '
        'folder (params.safetensors + config.json, from digen_jax.tasks.shapes.pretrain), a diffusers '
        'QwenImage folder (config.json + *.safetensors), or run configs/qwenimage.py:tiny'
    )
  return path


def check_text_encoder(config, text_encoder) -> None:
  """A checkpoint trained with a frozen word encoder records its table digest; a run whose
  encoder differs (e.g. another config.text.seed, which seeds the table) would feed the generator
  embeddings it never saw, silently. Raises ValueError instead."""
  if config.model.init != 'checkpoint':
    return
  path = checkpoint_folder(config.model.checkpoint)
  if not os.path.exists(os.path.join(path, params_io.WEIGHTS_FILE)):
    return  # diffusers folder: its text encoder is not ours to check
  recorded = params_io.read_config(path).get('extra', {}).get('text_encoder', {})
  want = recorded.get('table_sha256')
  if want and want != text_lib.table_digest(text_encoder):
    raise ValueError(
        f'the word text encoder of this run differs from the one {path} was trained with '
        f'(table digest mismatch): it was built with seed={recorded.get("seed")}, '
        f'dim={recorded.get("dim")}, max_length={recorded.get("max_length")}; this run has '
        f'config.text.seed={config.text.seed}, config.model.joint_attention_dim='
        f'{config.model.joint_attention_dim}, config.text.max_length={config.text.max_length}. '
        f'Set config.text.seed={recorded.get("seed")} (the table is seeded by it)'
    )


def selection_of(config) -> timesteps_lib.TimestepSelection:
  """Which sampler steps a trajectory trains (config.rl.timesteps and its window fields)."""
  r = config.rl
  return timesteps_lib.TimestepSelection(
      kind=r.timesteps,
      fraction=r.timestep_fraction,
      window_start=r.window_start,
      window_size=r.window_size,
      slide_every=r.slide_every,
  )


def resolved_checkpoint(config) -> str:
  """config.model.checkpoint as the folder the run reads ('' unchanged for a random init, whose
  checkpoint field is unused)."""
  if config.model.init == 'random':
    return config.model.checkpoint
  return checkpoint_folder(config.model.checkpoint)


def build_weights(config) -> tuple[Any, weights_lib.Weights]:
  """(model config, the run's Weights): checkpoints are opened and checked, not read whole."""
  mcfg = model_config_from(config)
  family = family_lib.of(config)
  return mcfg, weights_lib.build(
      config, family, mcfg, same_architecture, checkpoint=resolved_checkpoint(config)
  )


def build_model(config) -> tuple[Any, Any, Any]:
  """(model config, the transformer's graphdef, initial trainable params): build_weights, unpacked."""
  mcfg, weights = build_weights(config)
  return mcfg, weights.graphdef, weights.params


def build_text_encoder(config):
  """The frozen word encoder, or the embedding cache of a real encoder (no torch here)."""
  if config.text.encoder == 'word':
    enc = text_lib.WordEncoder(
        text_lib.vocabulary(config.text.encoder),
        dim=config.model.joint_attention_dim,
        max_length=config.text.max_length,
        seed=config.text.seed,
    )
    return text_lib.CachedEncoder(enc)
  cache = text_cache.EmbeddingCache(config.text.cache, config.text.max_length)
  if cache.dim != config.model.joint_attention_dim:
    raise ValueError(
        f'config.text.cache={config.text.cache!r} holds {cache.dim}-dim embeddings but '
        f'config.model.joint_attention_dim={config.model.joint_attention_dim}'
    )
  wants_pooled = config.text.encoder == 't5-clip'
  if wants_pooled and cache.pooled_dim != config.model.pooled_projection_dim:
    raise ValueError(
        f'config.text.cache={config.text.cache!r} holds pooled vectors of dim '
        f"{cache.pooled_dim} (None: a cache without them, e.g. Qwen-Image's) but "
        f'config.model.pooled_projection_dim={config.model.pooled_projection_dim}; '
        'encode the prompts with the FLUX pipeline folder (digen_jax.encode_prompts)'
    )
  if not wants_pooled and cache.pooled_dim is not None:
    raise ValueError(
        f'config.text.cache={config.text.cache!r} was made by a FLUX pipeline (T5 + '
        f'CLIP) but config.text.encoder={config.text.encoder!r}; use configs/flux.py '
        "or set config.text.encoder='t5-clip'"
    )
  return cache


def check_prompt_cache(config, text_encoder, prompt_lists) -> None:
  """A real encoder's cache must hold every prompt the run can draw (train and eval splits, the
  negative prompt) and come from the pipeline folder's own encoder: else one clear error now,
  before anything compiles."""
  if config.text.encoder == 'word':
    return
  prompts = list(
      dict.fromkeys([config.sampler.negative_prompt] + [p for ps in prompt_lists for p in ps])
  )
  command = text_cache.encode_command(sys.argv[1:], config.text.cache)
  expected = None
  folder = config.model.checkpoint
  if folder and weights_lib.is_pipeline_folder(folder):
    if not os.path.isdir(os.path.join(folder, 'text_encoder')):
      # Training reads only the cache; the encoder is needed to encode what it lacks and to
      # check that it came from this folder's encoder.
      try:
        text_encoder.check(prompts, None, command=command)
      except ValueError as e:
        raise ValueError(
            f'config.model.checkpoint={folder!r} has no text_encoder/, so the prompts '
            f'config.text.cache={config.text.cache!r} lacks cannot be encoded here: {e} (or '
            "copy the release's text_encoder/ and tokenizer/ into the folder)"
        ) from None
      logging.warning(
          '%s has no text_encoder/: config.text.cache holds every prompt of the run and is used '
          "as it is, its record of the encoder that made it not checked against the folder's",
          folder,
      )
      return
    # A FLUX cache's T5 sequences are padded to the run's text length (unused for Qwen-Image).
    expected = text_cache.encoder_fingerprint(folder, max_sequence_length=config.text.max_length)
  text_encoder.check(prompts, expected, command=command)


SCHEDULER_CONFIG = os.path.join('scheduler', 'scheduler_config.json')


def scheduler_config(config) -> sigmas_lib.SchedulerConfig:
  """The FlowMatchEulerDiscreteScheduler settings of the run: a pipeline folder's own
  scheduler/scheduler_config.json (shift, dynamic shifting and its base/max shift and sequence
  lengths, shift_terminal, ...), else config.sampler.scheduler's built-in release settings
  (random init, our params folders). ValueError naming the file otherwise."""
  path = weights_lib.repo_path(config.model.checkpoint) if config.model.checkpoint else ''
  if config.model.init != 'checkpoint' or not (path and weights_lib.is_pipeline_folder(path)):
    if config.sampler.scheduler == 'qwenimage':
      return sigmas_lib.qwenimage_scheduler_config()
    return sigmas_lib.flux_scheduler_config()
  file = os.path.join(path, SCHEDULER_CONFIG)
  if not os.path.isfile(file):
    raise ValueError(
        f'config.model.checkpoint={path!r} has no {SCHEDULER_CONFIG}: a pipeline folder holds '
        "the scheduler its model was trained with; copy the release's scheduler/ folder into it"
    )
  try:
    with open(file) as f:
      raw = json.load(f)
    if not isinstance(raw, dict):
      raise ValueError(f'expected a JSON object, got {type(raw).__name__}')
    return sigmas_lib.scheduler_config_from_diffusers(raw)
  except (OSError, ValueError, TypeError) as e:
    raise ValueError(f'{file}: {e}') from None


def build_schedule(config, num_tokens: int) -> np.ndarray:
  """The sampler's sigmas [T + 1] for images of `num_tokens` tokens: diffusers' for the run's
  scheduler settings (scheduler_config), a positive config.sampler.shift overriding its
  shifting; Wan's flow sigmas for sampler.scheduler='wan'."""
  s = config.sampler
  if s.scheduler == 'wan':  # Wan2.1's UniPC flow grid, static flow shift (validated > 0)
    return sigmas_lib.flow_sigmas(s.num_steps, s.shift)
  base = scheduler_config(config)
  shift = s.shift if s.shift > 0 else None
  return np.asarray(
      sigmas_lib.sigmas(base, s.num_steps, image_seq_len=num_tokens, shift=shift), np.float32
  )


def learning_rate(config) -> optax.Schedule:
  """config.optim's schedule as a function of the optimizer's update count."""
  o = config.optim
  updates = config.total_steps * config.rl.inner_epochs
  warmup, end = int(o.warmup_steps), o.lr * o.final_lr_frac
  decay = {
      'constant': lambda n: optax.constant_schedule(o.lr),
      'cosine': lambda n: optax.cosine_decay_schedule(o.lr, n, alpha=o.final_lr_frac),
      'linear': lambda n: optax.linear_schedule(o.lr, end, n),
  }[o.schedule](max(updates - warmup, 1))
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), decay], [warmup])


def build_optimizer(config) -> optax.GradientTransformation:
  """AdamW after a global-norm clip; for a likelihood-free objective that keeps an old policy,
  wrapped so that its state carries it (rl/old_policy.py)."""
  o = config.optim
  optimizer = optax.chain(
      optax.clip_by_global_norm(o.grad_clip),
      optax.adamw(learning_rate(config), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
  )
  rl = run_lib.rl_spec(config)
  if not rl.keeps_old_policy:
    return optimizer
  decay = old_policy.decay_schedule(rl.old_policy_flat, rl.old_policy_uprate, rl.old_policy_uphold)
  return old_policy.with_old_policy(optimizer, decay)


def _prompts(config, split: str, split_field: str, data_dir: str):
  """(load_prompts(...), every prompt of it as a list) with the config fields named in its
  errors."""
  try:
    seq = prompt_data.load_prompts(
        config.data.prompts, split, data_dir, config.data.max_prompt_chars
    )
  except prompt_data.PromptTooLong as e:
    raise ValueError(
        f'config.data.prompts={config.data.prompts!r} ({split_field}={split!r}): {e}; shorten '
        f'it or raise config.data.max_prompt_chars (now {config.data.max_prompt_chars})'
    ) from None
  except ValueError as e:
    raise ValueError(
        f'config.data.prompts={config.data.prompts!r} ({split_field}={split!r}): ' f'{e}'
    ) from None
  # Every record once: a damaged array_record file raises, or (cut short) reads as None, here
  # rather than mid-run.
  texts = []
  try:
    texts = seq[:]
    bad = next((i for i, p in enumerate(texts) if not isinstance(p, str) or not p), None)
    why = None if bad is None else f'record {bad} is not a prompt'
  except (RuntimeError, OSError, ValueError) as e:
    why = ' '.join(str(e).split())[:200]
  if why is not None:
    raise ValueError(
        f'config.data.prompts={config.data.prompts!r} ({split_field}={split!r}): the prepared '
        f'prompt dataset under {data_dir} is unreadable ({why}); delete its folder there and '
        'rerun (shapes and prompt files given by path rebuild themselves; a prompt_file/<name> '
        'dataset needs build_prompt_file_dataset again)'
    )
  return seq, texts


def build(
    config,
    workdir: str = '',
    num_devices: int | None = None,
    explicit=frozenset(),
    *,
    abstract: bool = False,
    vae: str = 'auto',
) -> run_lib.Run:
  """The Run of `config`: reads the architecture from the model folder (folder_config.resolve:
  `explicit`, the fields the command line set, must agree with it), validates the config on
  `num_devices` (before anything compiles) and builds the run's parts.

  abstract=True: the same Run, every weight a ShapeDtypeStruct (abstract_weights; the VAE's
  configuration as `vae` chooses it) and no text encoder, prompts or reward, its fragment plan
  for `num_devices` (default 1); nothing is read but the folders' configurations and nothing
  validated against devices (the simulator's configs name hardware this process lacks)."""
  if abstract:
    return _abstract_run(config, vae, num_devices or 1)
  folder_config.resolve(config, explicit)
  plan = configlib.validate(config, num_devices)
  logging.info(
      'attention: %s (config.model.attention=%r)', attention_choice(config), config.model.attention
  )
  img_shape, num_tokens = _shapes(config)
  # Cheap parts first so their errors come before the (possibly large) model build; the reward
  # workers load now (a model that cannot load is one line), and score a probe batch once the
  # prompts are read.
  specs = run_lib.specs_of(config, resolved_checkpoint(config))
  reward_fn = reward_scoring.build(config.reward, specs['reward'].weight_map)
  try:
    return _build_parts(config, workdir, plan, reward_fn, img_shape, num_tokens, specs)
  except BaseException:
    reward_fn.close()
    raise


def _shapes(config) -> tuple[tuple[int, int, int], int]:
  """((frames, h_tokens, w_tokens), tokens) of config.latent."""
  lat = config.latent
  p = config.model.patch_size
  img_shape = (lat.frames, lat.height // p, lat.width // p)
  return img_shape, int(np.prod(img_shape))


def _common(config, num_tokens: int) -> dict:
  """The Run's fields both builds derive from the config alone."""
  return dict(
      sigmas=build_schedule(config, num_tokens),
      sde_cfg=sde_lib.SDEConfig(
          kind=config.sampler.sde,
          noise_level=config.sampler.noise_level,
          logprob_reduce=config.sampler.logprob_reduce,
      ),
      selection=selection_of(config),
      optimizer=build_optimizer(config),
      latent_shape=(num_tokens, config.model.in_channels),
  )


def _abstract_run(config, vae: str, num_devices: int) -> run_lib.Run:
  img_shape, num_tokens = _shapes(config)
  mcfg = model_config_from(config)
  path = config.model.checkpoint
  checkpoint = weights_lib.repo_path(path) if path and config.model.init != 'random' else path
  return run_lib.Run(
      model_config=mcfg,
      weights=abstract_weights.abstract_weights(config, family_lib.of(config), mcfg, vae),
      text_encoder=None,
      prompts=None,
      reward_fn=None,
      img_shape=img_shape,
      plan=fragments.plan_of(config, num_devices),
      **_common(config, num_tokens),
      **run_lib.specs_of(config, checkpoint),
  )


def respec(run: run_lib.Run, config) -> run_lib.Run:
  """`run` with the specs of `config` (its weights, parts, sigmas and plan kept): a program of
  another field value (a TSP steps axis, a sequence split) over the same built model."""
  return dataclasses.replace(run, **run_lib.specs_of(config, run.model.checkpoint))


def _build_parts(config, workdir, plan, reward_fn, img_shape, num_tokens, specs) -> run_lib.Run:
  """build's parts after the rewards: text, prompts (the rewards' probe), schedule, model."""
  text_encoder = build_text_encoder(config)
  check_text_encoder(config, text_encoder)
  data_dir = prompt_data.resolve_data_dir(config.data.data_dir, workdir)
  source, texts = _prompts(config, config.data.split, 'config.data.split', data_dir)
  eval_texts = (
      _prompts(config, config.eval.split, 'config.eval.split', data_dir)[1]
      if config.eval.every > 0
      else []
  )  # a bad eval split fails now, not mid-run
  check_prompt_cache(config, text_encoder, [texts, eval_texts])
  # A video run's rewards score videos: probe them with a few grey frames.
  reward_fn.probe(texts[:2], frames=3 if config.latent.frames > 1 else 0)
  prompts = prompt_data.PromptIterator(source, config.rl.prompts_per_step, config.seed)
  mcfg, weights = build_weights(config)
  return run_lib.Run(
      model_config=mcfg,
      weights=weights,
      text_encoder=text_encoder,
      prompts=prompts,
      reward_fn=reward_fn,
      img_shape=img_shape,
      plan=plan,
      **_common(config, num_tokens),
      **specs,
  )
