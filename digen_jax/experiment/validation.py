"""Validation of a config tree (experiment/config.py's schema), before anything compiles.

`validate(config, num_devices)` runs the checks below in order and raises the first failure as a
ValueError naming the field and the fix: first every choice field and every number's type and
range (so nothing downstream divides by zero, builds an empty array or traces a NaN into a
program), then the cross-field rules of each concern: the model against its latent grid, the
model family, the checkpoint, the learning-rate schedule, the transfer host, the reward, the
real-model fields and last the schedule. num_devices: every role's device count divides it (a
batch or fragment that it does not divide is padded with weight-0 rows: fragments.py).
"""

from __future__ import annotations

import ipaddress
import math

import ml_collections

from digen_jax.experiment import fragments
from digen_jax.experiment import run as run_lib
from digen_jax.parallel import sequence
from digen_jax.parallel import tsp_grid
from digen_jax.rewards import registry as reward_registry
from digen_jax.rewards import scoring as reward_scoring

# Every field that names one of a few options, and those options.
_CHOICES = {
    'model.family': ('qwenimage', 'flux', 'wan'),
    'model.init': ('checkpoint', 'random'),
    'model.attention': ('auto', 'portable', 'fused'),
    'latent.space': ('pixel', 'vae', 'ae'),
    'text.encoder': ('word', 'qwen2.5-vl', 't5-clip', 'umt5'),
    'sampler.scheduler': ('qwenimage', 'flux', 'wan'),
    'sampler.sde': ('flow_grpo', 'dance', 'cps'),
    'sampler.logprob_reduce': ('mean', 'sum'),
    'rl.adv_std': ('group', 'global'),
    'rl.timesteps': ('all_but_last', 'random_fraction', 'fixed_window', 'sliding_window'),
    'rl.step_loop': ('auto', 'scan', 'vmap'),
    'rl.behaviour_logprobs': ('rollout', 'trainer'),
    'rl.algorithm': ('grpo', 'nft', 'awm'),
    'rl.rollout_sampler': ('ode', 'sde'),
    'rl.awm_weighting': ('Uniform', 't', 't**2', 'huber', 'ghuber'),
    'optim.compute_dtype': ('float32', 'bfloat16'),
    'model.frozen_dtype': ('float32', 'bfloat16'),
    'optim.schedule': ('constant', 'cosine', 'linear'),
    'runtime.mode': ('colocated', 'disagg'),
    'runtime.transfer_guard': ('allow', 'log', 'disallow'),
    'cluster.layout': ('auto', 'explicit'),
    'cluster.rollout.param_dtype': ('float32', 'bfloat16'),
    'cluster.rollout.param_sharding': ('replicated', 'fsdp'),
    'schedule.fragment_unit': ('group', 'sample'),
    'baseline.engine': ('torch', 'digen_jax'),
    'baseline.reshard_after_forward': ('auto', 'yes', 'no'),
}


# Every numeric field's type and range (checked first, so nothing downstream divides by zero,
# builds an empty array or traces a NaN into a program): ints >= a minimum; floats finite within
# [lo or (lo, hi] or hi). A fix hint follows where the range alone does not say it.
_INT_MIN = {
    'seed': 0,
    'text.seed': 0,
    'total_steps': 1,
    'rl.prompts_per_step': 1,
    'rl.group_size': 2,
    'rl.inner_epochs': 1,
    'rl.window_start': 0,
    'rl.window_size': 1,
    'rl.slide_every': 1,
    'rl.train_noise_levels': 0,
    'rl.old_policy_flat': 0,
    'sampler.num_steps': 2,
    'latent.height': 1,
    'latent.width': 1,
    'latent.image_height': 0,
    'latent.image_width': 0,
    'latent.frames': 1,
    'latent.channels': 1,
    'latent.vae_batch_chunk': 0,
    'latent.vae_tile': 0,
    'model.patch_size': 1,
    'model.in_channels': 1,
    'model.out_channels': 1,
    'model.num_layers': 0,
    'model.num_single_layers': 0,
    'model.num_attention_heads': 1,
    'model.attention_head_dim': 1,
    'model.joint_attention_dim': 1,
    'model.pooled_projection_dim': 1,
    'model.ffn_dim': 1,
    'model.lora.rank': 0,
    'text.max_length': 2,
    'eval.every': 0,
    'eval.num_prompts': 0,
    'eval.samples_per_prompt': 1,
    'eval.batch_size': 1,
    'eval.seed': 0,
    'optim.warmup_steps': 0,
    'runtime.num_devices': 0,
    'runtime.max_consecutive_skips': 1,
    'schedule.fragments': 1,
    'schedule.tsp_steps_axis': 0,
    'parallel.sequence': 1,
    'log_every': 1,
    'checkpoint_every': 1,
    'keep_checkpoints': 1,
    'sample_grid_every': 0,
    'baseline.mini_batches': 1,
    'baseline.micro_batch': 1,
    'baseline.fsdp_size': 0,
    'data.max_prompt_chars': 1,
}
_INT_HINTS = {
    'rl.group_size': 'GRPO needs at least 2 samples per prompt',
    'runtime.num_devices': '0 = all local devices',
    'baseline.fsdp_size': "0 = one node's devices (veRL-Omni's multi-node guide)",
    'eval.num_prompts': '0 = the whole split',
    'eval.every': '0 = off',
    'schedule.tsp_steps_axis': '0 = auto',
    'parallel.sequence': '1 = no split',
    'sample_grid_every': '0 = off',
    'model.lora.rank': '0 = full fine-tuning',
    'rl.train_noise_levels': 'nft/awm: 0 = int(0.99 * sampler.num_steps)',
    'latent.image_height': 'pixels; 0 = latent.height as given',
    'latent.image_width': 'pixels; 0 = latent.width as given',
    'runtime.max_consecutive_skips': 'updates skipped in a row for NaN/inf before the run stops',
}
_INF = float('inf')
_FLOAT_RANGES = {  # field: (lo, lo_inclusive, hi, hi_inclusive, hint)
    'optim.lr': (
        0.0,
        False,
        1.0,
        True,
        'Adam moves each weight by about lr per step; 1e-4 is ' 'typical for fine-tuning',
    ),
    'optim.b1': (0.0, True, 1.0, False, ''),
    'optim.b2': (0.0, True, 1.0, False, ''),
    'optim.eps': (0.0, False, _INF, False, ''),
    'optim.weight_decay': (0.0, True, _INF, False, ''),
    'optim.grad_clip': (0.0, False, _INF, False, 'the global-norm clip'),
    'optim.final_lr_frac': (0.0, True, 1.0, True, ''),
    'rl.adv_eps': (0.0, True, _INF, False, ''),
    'rl.adv_clip': (0.0, False, _INF, False, ''),
    'rl.clip_range': (0.0, False, _INF, False, 'the PPO epsilon'),
    'rl.kl_beta': (0.0, True, _INF, False, '0 = no KL'),
    'rl.timestep_fraction': (0.0, False, 1.0, True, ''),
    'rl.nft_beta': (0.0, False, _INF, False, 'DiffusionNFT: 1.0 (0.1 for OCR)'),
    'rl.old_policy_uprate': (0.0, True, _INF, False, '0 = the old policy is the current one'),
    'rl.old_policy_uphold': (0.0, True, 1.0, False, 'the largest decay; DiffusionNFT: 0.5'),
    'rl.awm_ghuber_power': (0.0, False, _INF, False, 'AWM: 0.25'),
    'rl.awm_advantage_max': (0.0, False, _INF, False, 'AWM: 1.0'),
    'rl.awm_ema_kl_beta': (0.0, True, _INF, False, 'AWM: 1.0; 0 = no EMA KL'),
    'rl.awm_timestep_fraction': (0.0, False, 1.0, True, 'AWM: 0.9'),
    'sampler.noise_level': (0.0, True, _INF, False, ''),
    'sampler.shift': (0.0, True, _INF, False, "0 = the scheduler's dynamic shift"),
    'sampler.guidance_scale': (0.0, True, _INF, False, '<= 1 = no CFG'),
    'sampler.distilled_guidance': (0.0, True, _INF, False, ''),
    'model.rope_theta': (0.0, False, _INF, False, 'diffusers: 10000.0'),
    'model.lora.alpha': (0.0, True, _INF, False, '0 = rank'),
    'reward.timeout_s': (0.0, True, _INF, False, '0 = no limit'),
    'reward.device_s_per_sample': (0.0, True, _INF, False, '0 = scored on the host'),
    'runtime.shutdown_timeout_s': (0.0, False, _INF, False, 'SIGTERM/SIGINT -> exit, default 60'),
    'schedule.tcss_fraction': (0.0, True, 1.0, True, ''),
    'cluster.trainer.speed': (0.0, False, _INF, False, ''),
    'cluster.rollout.speed': (0.0, False, _INF, False, ''),
}


def validate(config: ml_collections.ConfigDict, num_devices: int) -> fragments.FragmentPlan:
  """Raises ValueError naming the field and the fix; called before anything compiles. Returns
  the run's fragment plan (built here, once, as part of the checks)."""
  _check_choices(config)
  _check_numbers(config)
  _check_model_against_latent(config)
  _check_model_family(config)
  _check_checkpoint(config)
  _check_scheduler(config)
  _check_lr_schedule(config)
  _check_objective(config)
  check_transfer_host(config.cluster.transfer_host)
  _check_reward(config)
  _check_real_model(config)
  return _validate_schedule(config, num_devices)


def _check_choices(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the first field of _CHOICES holding none of its choices."""
  for field, choices in _CHOICES.items():
    if _get(config, field) not in choices:
      raise ValueError(f'config.{field}={_get(config, field)!r} is not one of {choices}')


def _check_numbers(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the first numeric field of a wrong type or out of its range."""
  for field, lo in _INT_MIN.items():
    v = _get(config, field)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      hint = _INT_HINTS.get(field)
      raise ValueError(
          f'config.{field}={v!r} must be an int >= {lo}' + (f' ({hint})' if hint else '')
      )
  for field, (lo, lo_in, hi, hi_in, hint) in _FLOAT_RANGES.items():
    v = _get(config, field)
    ok = (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and (v >= lo if lo_in else v > lo)
        and (v <= hi if hi_in else v < hi)
    )
    if not ok:
      span = (
          ('[' if lo_in else '(')
          + f'{lo:g}, '
          + ('inf)' if hi == _INF else f'{hi:g}' + (']' if hi_in else ')'))
      )
      raise ValueError(
          f'config.{field}={v!r} must be a finite number in {span}' + (f' ({hint})' if hint else '')
      )


def _check_model_against_latent(config: ml_collections.ConfigDict) -> None:
  """The model's patch, channels and rotary axes fit the latent grid and its heads."""
  m, lat = config.model, config.latent
  p = m.patch_size
  if lat.height % p or lat.width % p:
    raise ValueError(
        f'config.latent.height/width ({lat.height}x{lat.width}) must be divisible by '
        f'config.model.patch_size={p}'
    )
  if m.in_channels != lat.channels * p * p:
    raise ValueError(
        f'config.model.in_channels={m.in_channels} must equal latent.channels * '
        f'patch_size**2 = {lat.channels * p * p}'
    )
  if m.out_channels != lat.channels:
    raise ValueError(
        f'config.model.out_channels={m.out_channels} must equal '
        f'config.latent.channels={lat.channels}'
    )
  if m.family != 'wan' and sum(m.axes_dims_rope) != m.attention_head_dim:  # Wan's: from the head
    raise ValueError(
        f'sum(config.model.axes_dims_rope)={sum(m.axes_dims_rope)} must equal '
        f'config.model.attention_head_dim={m.attention_head_dim}'
    )


def _check_model_family(config: ml_collections.ConfigDict) -> None:
  """Each family's own fields and text encoder: FLUX's are set only for FLUX."""
  m = config.model
  if m.family != 'flux' and m.num_layers < 1:
    raise ValueError(f'config.model.num_layers={m.num_layers} must be >= 1')
  if config.latent.frames > 1 and m.family != 'wan':
    raise ValueError(
        f"config.latent.frames={config.latent.frames}: videos are model.family='wan'; "
        f'config.model.family={m.family!r} generates images (latent.frames=1)'
    )
  if m.family == 'flux':
    _check_flux(config)
  elif m.family == 'wan':
    _check_wan(config)
  elif config.text.encoder in ('t5-clip', 'umt5'):
    raise ValueError(
        f'config.text.encoder={config.text.encoder!r} is '
        f"{'FLUX' if config.text.encoder == 't5-clip' else 'Wan'}'s; "
        f"config.model.family={m.family!r} reads 'word' or 'qwen2.5-vl'"
    )
  elif m.guidance_embeds or m.num_single_layers:
    raise ValueError(
        f"config.model.guidance_embeds / num_single_layers are FLUX's; with "
        f'config.model.family={m.family!r} leave them False / 0'
    )


def _check_flux(config: ml_collections.ConfigDict) -> None:
  """model.family='flux': its blocks, its text conditioning and no CFG."""
  m = config.model
  if m.num_single_layers < 0 or m.num_layers + m.num_single_layers < 1:
    raise ValueError(
        f'config.model.num_layers={m.num_layers}, num_single_layers='
        f'{m.num_single_layers}: FLUX needs >= 0 of each and at least one block'
    )
  if config.text.encoder not in ('t5-clip', 'word'):
    raise ValueError(
        f"config.model.family='flux' conditions on T5 tokens and the CLIP pooled "
        f"vector: config.text.encoder={config.text.encoder!r} must be 't5-clip' (an "
        'embedding cache made by digen_jax.encode_prompts from a FLUX pipeline '
        "folder) or 'word' (toy configs)"
    )
  if config.text.encoder == 'word' and m.pooled_projection_dim != m.joint_attention_dim:
    raise ValueError(
        f'config.model.pooled_projection_dim={m.pooled_projection_dim}: the word '
        "encoder's pooled vector is a mean of its tokens, so it must equal "
        f'config.model.joint_attention_dim={m.joint_attention_dim}'
    )
  if config.sampler.guidance_scale > 1.0:
    raise ValueError(
        f'config.sampler.guidance_scale={config.sampler.guidance_scale}: FLUX.1 is '
        'guidance-distilled (no CFG); set it to 0 and use '
        'config.sampler.distilled_guidance (FLUX.1-dev) instead'
    )
  if m.pooled_text:
    raise ValueError(
        "config.model.pooled_text is the MMDiT's option; FLUX always conditions on "
        'the pooled CLIP vector (model.pooled_projection_dim)'
    )


def _check_wan(config: ml_collections.ConfigDict) -> None:
  """model.family='wan': umT5 text (or the toy word encoder), true CFG without Qwen-Image's norm
  rescale, a static flow shift for the 'wan' scheduler, none of the image families' options."""
  m, s = config.model, config.sampler
  if config.text.encoder not in ('umt5', 'word'):
    raise ValueError(
        f"config.model.family='wan' conditions on umT5 tokens: config.text.encoder="
        f"{config.text.encoder!r} must be 'umt5' (an embedding cache made by "
        "digen_jax.encode_prompts from a Wan pipeline folder) or 'word' (toy configs)"
    )
  if m.guidance_embeds or m.num_single_layers or m.pooled_text:
    raise ValueError(
        'config.model.guidance_embeds / num_single_layers / pooled_text are the image '
        "families' options; with config.model.family='wan' leave them False / 0 / False"
    )
  if s.guidance_scale > 1.0 and s.norm_rescale:
    raise ValueError(
        "config.sampler.norm_rescale is Qwen-Image's true-CFG rescale; WanPipeline's CFG is "
        'plain uncond + g * (cond - uncond): set --config.sampler.norm_rescale=False'
    )


def _check_checkpoint(config: ml_collections.ConfigDict) -> None:
  """model.init='checkpoint' names a checkpoint."""
  if config.model.init == 'checkpoint' and not config.model.checkpoint:
    raise ValueError(
        'config.model.checkpoint is empty: give a diffusers pipeline folder (e.g. '
        'Qwen/Qwen-Image, black-forest-labs/FLUX.1-dev) with '
        '--config.model.checkpoint=PATH, or run a random-initialised tiny variant '
        '(configs/qwenimage.py:tiny, configs/flux.py:tiny)'
    )


def _check_scheduler(config: ml_collections.ConfigDict) -> None:
  """The 'wan' scheduler has no dynamic shift: it needs its static flow shift."""
  if config.sampler.scheduler == 'wan' and not config.sampler.shift > 0:
    raise ValueError(
        "config.sampler.scheduler='wan' (UniPC's flow sigmas) takes a static flow shift: set "
        '--config.sampler.shift (WanPipeline: 3.0 at 480p, 5.0 at 720p)'
    )


def _check_lr_schedule(config: ml_collections.ConfigDict) -> None:
  """The warm-up ends before the run's last optimizer update."""
  o = config.optim
  if not (
      o.lr > 0
      and 0 <= o.warmup_steps < config.total_steps * config.rl.inner_epochs
      and 0.0 <= o.final_lr_frac <= 1.0
  ):
    raise ValueError(
        f'config.optim: lr={o.lr} must be > 0, warmup_steps={o.warmup_steps} in '
        f'[0, total_steps * rl.inner_epochs = {config.total_steps * config.rl.inner_epochs}) '
        f'and final_lr_frac={o.final_lr_frac} in [0, 1]'
    )


def _check_objective(config: ml_collections.ConfigDict) -> None:
  """The likelihood-free objectives' fields (config.rl.algorithm 'nft' | 'awm')."""
  rl = config.rl
  if rl.algorithm == 'grpo':
    return
  t = int(config.sampler.num_steps)
  if rl.algorithm == 'awm' and rl.inner_epochs > 1:
    raise ValueError(
        f'config.rl.inner_epochs={rl.inner_epochs}: awm takes one optimizer step per rollout '
        "(AWM's recipe; its ratio is then exactly 1): set --config.rl.inner_epochs=1"
    )
  if rl.algorithm == 'nft' and int(rl.train_noise_levels) > t:
    raise ValueError(
        f'config.rl.train_noise_levels={rl.train_noise_levels}: {rl.algorithm} trains on '
        f'distinct sigmas of the {t}-step rollout grid (config.sampler.num_steps): lower it to '
        f'at most {t}, or 0 for int(0.99 * {t})'
    )


def check_transfer_host(host, field: str = 'config.cluster.transfer_host') -> str:
  """`host` if it names one interface: an IP address (not a wildcard such as 0.0.0.0, which
  would listen on every interface) or 'hostname'; else ValueError naming `field`."""
  if host == 'hostname':
    return host
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    raise ValueError(
        f"{field}={host!r} must be one interface's IP address (default "
        "127.0.0.1: this machine only) or 'hostname' (the address this machine's "
        'name resolves to, for jobs over several machines)'
    ) from None
  if ip.is_unspecified:
    raise ValueError(
        f'{field}={host!r} would listen on every interface; give the one peers '
        "reach this machine on, or 'hostname'"
    )
  return host


def _check_reward(config: ml_collections.ConfigDict) -> None:
  """The user's reward callables import and reward.weights names registered rewards."""
  # The in-process callables (errors name the field); the workers' are imported there only.
  reward_registry.register_callables(reward_scoring.split_callables(config.reward)[0])
  weights = run_lib.reward_weights(config.reward)
  # Names, weights and the worker/remote fields (rewards/scoring.py; errors name the field).
  where = reward_scoring.where_each(config.reward, weights)
  videos = [n for n in weights if where[n] == 'host' and reward_registry.takes(n) == 'videos']
  if videos and config.model.family != 'wan':
    raise ValueError(
        f'config.reward.weights={config.reward.weights!r}: {videos} score videos, but '
        f'config.model.family={config.model.family!r} makes images'
    )


def _check_real_model(config: ml_collections.ConfigDict) -> None:
  """The text cache, LoRA's publish dtype and the prompt source (the pipeline folder itself is
  read by experiment.build)."""
  if config.text.encoder != 'word' and not config.text.cache:
    raise ValueError(
        f'config.text.encoder={config.text.encoder!r} reads an embedding cache: set '
        '--config.text.cache=DIR, made by `python -m digen_jax.encode_prompts '
        '--config=<this config> --prompts=<prompts> --out=DIR`'
    )
  if config.model.lora.rank > 0 and config.cluster.rollout.param_dtype != 'float32':
    raise ValueError(
        'config.cluster.rollout.param_dtype must be float32 with LoRA '
        '(config.model.lora.rank > 0): the publish carries only the small adapters, '
        'and the rollout merges them into its own frozen base exactly as the trainer '
        'does; the base dtype is config.model.frozen_dtype'
    )
  if not config.data.prompts:
    raise ValueError(
        'config.data.prompts is empty: give a prompt file (one prompt per line), a '
        "prepared tfds prompt set, or 'shapes'"
    )


def _validate_schedule(
    config: ml_collections.ConfigDict, num_devices: int
) -> fragments.FragmentPlan:
  """config.schedule against the batch, the devices and the mode (see runtime/loop.py)."""
  s, rl = config.schedule, config.rl
  # The fragment count's own rules (FragmentPlan); a fragment that does not divide the devices
  # is padded to them with weight-0 rows (plan.rows).
  plan = fragments.plan_of(config, num_devices)
  m = plan.num
  if s.tsp_steps_axis and not s.tsp:
    raise ValueError(
        f'config.schedule.tsp_steps_axis={s.tsp_steps_axis} is the steps axis of TSP: set '
        '--config.schedule.tsp=True, or leave it 0'
    )
  if s.frozen_once_per_step and config.model.lora.rank == 0:
    raise ValueError(
        'config.schedule.frozen_once_per_step gathers the frozen LoRA base once per step; full '
        'fine-tuning (model.lora.rank=0) has none: leave it False'
    )
  if s.tsp and config.runtime.mode != 'disagg':  # disagg: runtime.cluster checks the trainer's
    tsp_grid.check_steps_axis(s.tsp_steps_axis, num_devices)
  _check_sequence_split(config, num_devices)
  if m > 1 and rl.adv_std != 'group':
    raise ValueError(
        f"config.schedule.fragments={m} needs rl.adv_std='group' (a fragment's "
        'advantages must not depend on groups not yet sampled); set '
        '--config.rl.adv_std=group or schedule.fragments=1'
    )
  if rl.inner_epochs > 1 and rl.behaviour_logprobs == 'trainer':
    raise ValueError(
        f"config.rl.behaviour_logprobs='trainer' is the on-policy, one-epoch "
        f"ratio; rl.inner_epochs={rl.inner_epochs} needs the rollout's "
        'log-probs: set --config.rl.behaviour_logprobs=rollout or inner_epochs=1'
    )
  if s.tcss_fraction > 0 and rl.behaviour_logprobs == 'trainer':
    raise ValueError(
        "config.rl.behaviour_logprobs='trainer' recomputes log-probs under the "
        'current policy, which would hide the staleness of TCSS fragments '
        "(schedule.tcss_fraction > 0): use behaviour_logprobs='rollout' with TCSS"
    )
  if not 0.0 <= s.tcss_fraction <= 1.0:
    raise ValueError(f'config.schedule.tcss_fraction={s.tcss_fraction} must be in [0, 1]')
  if s.tcss_fraction > 0 and int(m * s.tcss_fraction + 1e-9) < 1:
    raise ValueError(
        f'config.schedule.tcss_fraction={s.tcss_fraction} allows no stale fragment '
        f'of schedule.fragments={m}; raise it to at least 1/{m}'
    )
  if (s.tag or s.tcss_fraction > 0) and config.runtime.mode != 'disagg':
    raise ValueError(
        'config.schedule.tag / tcss_fraction need separate rollout and trainer '
        'meshes: set --config.runtime.mode=disagg (e.g. configs/qwenimage.py:'
        'tiny_disagg)'
    )
  return plan


def _check_sequence_split(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """config.parallel.sequence against the heads and (colocated) the devices; runtime.cluster
  checks each role of a disaggregated run."""
  split = config.parallel.sequence
  heads = config.model.num_attention_heads
  # Disaggregated: the heads now, each role's devices when runtime.cluster resolves them.
  sequence.check(split, num_devices if config.runtime.mode != 'disagg' else None, heads)
  if split > 1 and config.schedule.tsp:
    raise ValueError(
        f'config.parallel.sequence={split} splits each sample over devices; TSP '
        '(config.schedule.tsp) lays the trainer mesh out by steps and samples instead and the '
        'two do not combine yet: set one of them off'
    )


def _get(config: ml_collections.ConfigDict, dotted: str):
  """config[a][b][c] of 'a.b.c'."""
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node
