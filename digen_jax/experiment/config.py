"""The full default config tree every config file starts from, and its validation.

Config files in configs/ call `base_config()` and override fields; the tree is locked, so a
command-line override of a key that does not exist (`--config.rl.grup_size=4`) fails at parse
time. `validate(config, num_devices)` checks cross-field consistency before anything compiles.
"""

from __future__ import annotations

import ipaddress
import math

import ml_collections

from digen_jax.rewards import registry as reward_registry


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 4  # optimizer steps (one per logical batch)

  # --- the generator -------------------------------------------------------------------------
  c.model = ml_collections.ConfigDict()
  c.model.checkpoint = ''  # diffusers folder / our pretrained checkpoint; '' = random init
  c.model.init = 'checkpoint'  # 'checkpoint' (needs model.checkpoint) or 'random'
  c.model.patch_size = 2
  c.model.in_channels = 64  # latent channels * patch_size**2 (packed)
  c.model.out_channels = 16
  c.model.num_layers = 60
  c.model.attention_head_dim = 128
  c.model.num_attention_heads = 24
  c.model.joint_attention_dim = 3584
  c.model.axes_dims_rope = (16, 56, 56)
  c.model.rope_theta = (
      10000.0  # diffusers' QwenEmbedRope theta; smaller = finer position code on small grids
  )
  c.model.pooled_text = False  # FLUX-style pooled prompt in the timestep embedding (not QwenImage)
  c.model.family = 'qwenimage'  # 'qwenimage' (MMDiT) | 'flux' (models/family.py)
  # FLUX only: single-stream blocks after the num_layers double-stream ones, the CLIP pooled
  # vector's size, and FLUX.1-dev's guidance embedding (guidance distillation; -schnell has none).
  c.model.num_single_layers = 0
  c.model.pooled_projection_dim = 768
  c.model.guidance_embeds = False
  # Execution options (same math, same params): jax.checkpoint each block in the update's backward
  # pass, and run the blocks under lax.scan (False: unrolled; compile time grows with layers).
  c.model.remat = False
  c.model.scan_layers = True
  # Attention kernel (models/attention.py): 'auto' = cuDNN's fused flash attention on a GPU with
  # bf16 compute, the portable XLA path elsewhere; 'portable' forces the XLA path everywhere;
  # 'fused' demands cuDNN (a clear error at start where it cannot run). Same math either way.
  c.model.attention = 'auto'
  # Frozen weights (the LoRA base and the VAE) are held in this dtype on every mesh; trainable
  # weights are always float32 masters (optim.compute_dtype casts them inside the programs).
  c.model.frozen_dtype = 'float32'  # 'float32' | 'bfloat16'
  # LoRA: rank 0 trains every weight; rank >= 1 trains only adapters W + alpha/rank * A @ B on the
  # Linear layers whose diffusers module name (e.g. 'transformer_blocks.3.attn.to_q') matches
  # the regex `targets` (re.search, PEFT-style). Dropout is not supported (always 0).
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0
  c.model.lora.alpha = 0.0  # 0 = rank (scale 1)
  c.model.lora.targets = (
      r'attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$'
  )

  # --- what the generator works in: latent grid and decoder ----------------------------------
  c.latent = ml_collections.ConfigDict()
  c.latent.space = 'vae'  # 'pixel' (identity decoder, tiny configs), 'vae' (the pipeline
  # folder's VAE) or 'ae' (our autoencoder at latent.ae)
  c.latent.ae = ''  # 'ae' space: a digen_jax.tasks.shapes.pretrain_ae params folder
  c.latent.channels = 16  # unpacked latent channels (3 for pixel space)
  c.latent.height = 166  # latent grid (pixels for 'pixel' space)
  c.latent.width = 166
  c.latent.frames = 1
  # 'vae' space: the pipeline folder's VAE decodes inside the rollout program. Memory bounds for
  # large images: decode `vae_batch_chunk` images at a time (0 = all at once), and/or in
  # overlapping spatial tiles of `vae_tile` pixels (0 = whole images; diffusers' tiled decode).
  c.latent.vae_batch_chunk = 0
  c.latent.vae_tile = 0

  # --- text conditioning ---------------------------------------------------------------------
  c.text = ml_collections.ConfigDict()
  c.text.encoder = (
      'qwen2.5-vl'  # 'word' (small frozen word-level encoder), 'qwen2.5-vl', 't5-clip' (FLUX)
  )
  c.text.max_length = 1024
  # Real encoders ('qwen2.5-vl') are read from an embedding cache written by
  # `python -m digen_jax.encode_prompts --config=... --prompts=... --out=DIR`; torch never runs
  # in the training process.
  c.text.cache = ''
  # 'word' encoder: its frozen table's seed, apart from config.seed (which seeds the rollouts and
  # the prompt order), so an RL run can change its seed and keep the table a checkpoint was
  # trained with (the checkpoint records its digest).
  c.text.seed = 0

  # --- prompts -------------------------------------------------------------------------------
  c.data = ml_collections.ConfigDict()
  c.data.prompts = 'shapes'  # 'shapes' (ShapesBench) or a path to a text file, one prompt per line
  c.data.split = 'train'
  c.data.data_dir = ''  # tfds data_dir; '' = $DIGEN_DATA_DIR, else <workdir>/data

  # --- sampling ------------------------------------------------------------------------------
  c.sampler = ml_collections.ConfigDict()
  c.sampler.num_steps = 50
  c.sampler.scheduler = 'qwenimage'  # 'qwenimage' | 'flux' (the diffusers scheduler configs)
  c.sampler.shift = 0.0  # > 0: static shift overriding the scheduler's dynamic shift
  c.sampler.sde = 'flow_grpo'  # 'flow_grpo' | 'dance' | 'cps'
  c.sampler.noise_level = 0.7
  c.sampler.logprob_reduce = 'mean'  # 'mean' | 'sum' over latent dims
  c.sampler.guidance_scale = 0.0  # > 1 turns on CFG (rollout and training alike)
  c.sampler.norm_rescale = True  # QwenImage "true CFG" norm rescale
  c.sampler.negative_prompt = ' '  # CFG's unconditional branch (the QwenImage pipelines' ' ')
  c.sampler.distilled_guidance = 3.5  # FLUX.1-dev's guidance input (model.guidance_embeds), not CFG

  # --- GRPO ----------------------------------------------------------------------------------
  c.rl = ml_collections.ConfigDict()
  c.rl.prompts_per_step = 2
  c.rl.group_size = 4
  c.rl.adv_std = 'group'  # 'group' | 'global'
  c.rl.adv_eps = 1e-4
  c.rl.adv_clip = 5.0
  c.rl.clip_range = 1e-4  # PPO epsilon (small: log-probs are means over latent dims)
  c.rl.kl_beta = 0.0
  c.rl.inner_epochs = 1
  c.rl.timesteps = (
      'all_but_last'  # 'all_but_last' | 'random_fraction' | 'fixed_window' | 'sliding_window'
  )
  c.rl.timestep_fraction = 0.5
  c.rl.window_start = 0
  c.rl.window_size = 2
  c.rl.slide_every = 1
  # How the update runs its K trained timesteps (same loss and gradient): 'scan' one after another
  # (B-sized forwards, like the rollout's; with model.remat the least memory and, on CPUs, the
  # fastest), 'vmap' as one K*B batch; 'auto': scan on a 1-device trainer mesh, vmap on more
  # (programs.step_loop_for: why). TSP always shards a vmap over the trainer mesh.
  c.rl.step_loop = 'auto'
  # Whose behaviour log-probs the importance ratio uses: the rollout's (stored with the
  # trajectory), or the trainer's own forward under stop_gradient (one on-policy epoch: the
  # ratio is exactly 1, at no extra cost). With bf16 compute the rollout's and the trainer's
  # programs round differently and |ratio - 1| reaches ~3e-3 (tests/test_ratio_mmdit.py), far
  # beyond a 1e-4 clip range; metrics.jsonl's rollout_ratio_max_dev keeps reporting that gap.
  # Needs rl.inner_epochs = 1 and no TCSS (stale fragments need their own version's log-probs).
  c.rl.behaviour_logprobs = 'rollout'

  # --- reward --------------------------------------------------------------------------------
  c.reward = ml_collections.ConfigDict()
  # 'name[:weight],...' over the registered rewards (digen_jax/rewards/registry.py), e.g.
  # --config.reward.weights=shapes_dense or 'shapes:1,shapes_strict:0.5'; their weighted sum.
  c.reward.weights = 'jpeg_compressibility'
  # A user's own rewards, without editing the package: 'name=module.path:function,...' or
  # 'name=/path/to/file.py:function'. Each function takes (uint8 images [B, H, W, 3], prompts)
  # and returns [B] scores; `name` can then be used in reward.weights.
  c.reward.callables = ''
  # A reward call (one batch) that takes longer is abandoned: its samples score NaN and the update
  # is skipped (0 = no limit). A reward that raises or returns NaN is treated the same way, with
  # the prompt that caused it in the log (rewards/registry.py: guarded).
  c.reward.timeout_s = 600.0

  # --- optimizer -----------------------------------------------------------------------------
  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-4
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.weight_decay = 1e-4
  c.optim.grad_clip = 1.0
  # Learning-rate schedule over the run's optimizer updates (total_steps * rl.inner_epochs):
  # linear warm-up for warmup_steps, then 'constant', or 'cosine' / 'linear' decay to
  # lr * final_lr_frac at the last update.
  c.optim.schedule = 'constant'
  c.optim.warmup_steps = 0
  c.optim.final_lr_frac = 0.0
  c.optim.compute_dtype = 'float32'  # 'bfloat16': bf16 forward/backward, float32 master weights

  # --- execution -----------------------------------------------------------------------------
  c.runtime = ml_collections.ConfigDict()
  c.runtime.mode = 'colocated'  # 'colocated' (one mesh) | 'disagg' (rollout and trainer meshes)
  c.runtime.num_devices = 0  # colocated: 0 = all local devices (disagg: see cluster)
  c.runtime.transfer_guard = (
      'disallow'  # jax.transfer_guard around the hot loop: no implicit copies
  )
  # An update whose rewards, advantages, loss, gradient or new weights hold NaN/inf is skipped
  # (weights and optimizer state unchanged, counted in metrics.jsonl); this many in a row stop
  # the run with an error, the last checkpoint holding the last good weights.
  c.runtime.max_consecutive_skips = 3
  # SIGTERM/SIGINT: the trainer checkpoints its last completed step and every process exits
  # within this many seconds (after it, a process still busy exits anyway; see interrupt.py).
  c.runtime.shutdown_timeout_s = 60.0

  # --- cluster: roles and meshes of runtime.mode='disagg' (colocated ignores it) -------------
  # layout 'auto': 2 processes -> process 0 trains, process 1 rolls out; 1 process -> the first
  # half of its devices train, the second half roll out. 'explicit': the roles' fields below.
  # See set_disagg().
  c.cluster = ml_collections.ConfigDict()
  c.cluster.layout = 'auto'
  for role in ('trainer', 'rollout'):
    r = c.cluster[role] = ml_collections.ConfigDict()
    r.devices = ()  # positions in jax.devices(), e.g. (0, 1)
    r.processes = ()  # or process ids: every device of those processes
    r.mesh_shape = ()  # () = 1-D over the role's devices; else e.g. (2, 2)
    r.axis_names = ('data',)  # one name per mesh axis ('data,fsdp' on the command line)
    r.speed = 1.0  # relative device speed label (heterogeneous clusters)
  # The one interface each process's transfer server (weights and batches across processes)
  # listens on: an IP address, or 'hostname' (the address this machine's name resolves to) for a
  # job over several machines. The default keeps it off every network.
  c.cluster.transfer_host = '127.0.0.1'
  c.cluster.rollout.param_dtype = 'float32'  # 'bfloat16': lower-precision rollout copy
  c.cluster.rollout.param_sharding = 'replicated'  # 'replicated' (data-parallel) | 'fsdp'

  # --- scheduling (DESIGN.md §3; runtime/pipeline.py). Defaults = the synchronous schedule -----
  c.schedule = ml_collections.ConfigDict()
  c.schedule.fragments = 1  # M: GAP fragments per logical batch (1 = no GAP)
  c.schedule.fragment_unit = 'group'  # 'group' | 'sample'
  c.schedule.tsp = False  # timestep axis of the update sharded over the trainer mesh
  c.schedule.tag = False  # trainer-assisted generation, insertions decided by BTS
  c.schedule.tcss_fraction = 0.0  # phi: share of next batch's fragments allowed one-version-stale
  c.schedule.trace = True  # write trace.json + timeline.png under the workdir
  # Across processes, True makes the rollout wait until the trainer has pulled each fragment
  # before it samples the next (no run-ahead). A process busy with a program may serve the
  # trainer's pull late (pinned CPU processes here: a fragment arrived 1-3 fragments late), so
  # handing over between programs is faster here: GAP+TSP+TAG 1.36x -> 1.48x naive disagg on a
  # balanced config; only a rollout-bound GAP-only run lost (-9%) (benchmarks/RESULTS.md).
  c.schedule.wait_for_pull = True

  # --- evaluation (deterministic ODE sampling; strict accuracy for ShapesBench prompts) ---------
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0  # evaluate every N optimizer steps (0 = off); also at start/end
  c.eval.split = 'eval'
  c.eval.num_prompts = 0  # 0 = the whole split
  c.eval.samples_per_prompt = 4
  c.eval.batch_size = 32
  c.eval.seed = 1234

  # --- bookkeeping ---------------------------------------------------------------------------
  c.log_every = 1
  c.checkpoint_every = 1
  c.keep_checkpoints = 2
  c.sample_grid_every = 0  # write samples/ PNG grids every N steps (0 = off)
  return c


def apply_overrides(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """Sets dotted fields in place, as --config.a.b=v would ({'rl.group_size': 8}); returns c.
  An unknown field raises (the tree is locked)."""
  for dotted, value in overrides.items():
    *path, last = dotted.split('.')
    node = c
    for part in path:
      node = node[part]
    node[last] = value
  return c


SHAPES_BASE_CHECKPOINT = 'assets/shapes_base'
SHAPES_AE_CHECKPOINT = 'assets/shapes_ae'  # issue 16's autoencoder (assets/shapes_ae/README.md)
SHAPES_LATENT_BASE_CHECKPOINT = 'assets/shapes_latent_base'  # its generator (README beside it)


def shapes_base(c: ml_collections.ConfigDict, *, checkpoint: str = SHAPES_BASE_CHECKPOINT):
  """Sets model/latent/text/sampler/data/reward of `c` to the ShapesBench base generator's (in
  place; returns c). checkpoint '' = random init (what pretraining starts from).

  16x16 RGB pixel space, patch 2 -> 64 tokens of 12 channels, identity decoder; MMDiT with 3
  double-stream blocks, 4 heads x 32, ~1.9M params; frozen word encoder (dim 64, seeded by
  config.text.seed: keep text.seed=0 with the shipped checkpoints); no CFG."""
  c.model.checkpoint = checkpoint
  c.model.init = 'checkpoint' if checkpoint else 'random'
  c.model.patch_size = 2
  c.model.in_channels = 12  # 3 channels * 2 * 2
  c.model.out_channels = 3
  c.model.num_layers = 3
  c.model.attention_head_dim = 32
  c.model.num_attention_heads = 4
  c.model.joint_attention_dim = 64
  c.model.axes_dims_rope = (8, 12, 12)
  c.latent.space = 'pixel'
  c.latent.channels = 3
  c.latent.height = c.latent.width = 16
  c.latent.frames = 1
  c.text.encoder = 'word'
  c.text.max_length = 16  # longest ShapesBench prompt is 12 words + <bos>
  c.sampler.scheduler = 'flux'  # no shift_terminal: the ODE ends exactly at sigma 0
  c.sampler.shift = 3.0  # static shift (64 tokens make dynamic shift meaningless)
  c.sampler.num_steps = 10
  c.sampler.guidance_scale = 0.0
  c.data.prompts = 'shapes'
  c.reward.weights = 'shapes'
  return c


def shapes_latent_base(
    c: ml_collections.ConfigDict,
    *,
    checkpoint: str = SHAPES_LATENT_BASE_CHECKPOINT,
    autoencoder: str = SHAPES_AE_CHECKPOINT,
):
  """`shapes_base` in the latent space of the ShapesBench autoencoder (in place; returns c): the
  same MMDiT at patch 1 on 8 x 8 latents of 8 channels (3 shape, 3 colour, 2 free;
  models/shapes_ae.py), decoded to 32 px RGB for the rewards. checkpoint '' = random init."""
  shapes_base(c, checkpoint=checkpoint)
  c.model.patch_size = 1
  c.model.in_channels = c.model.out_channels = 8
  c.latent.space = 'ae'
  c.latent.ae = autoencoder
  c.latent.channels = 8
  c.latent.height = c.latent.width = 8
  return c


_CHOICES = {
    'model.family': ('qwenimage', 'flux'),
    'model.init': ('checkpoint', 'random'),
    'model.attention': ('auto', 'portable', 'fused'),
    'latent.space': ('pixel', 'vae', 'ae'),
    'text.encoder': ('word', 'qwen2.5-vl', 't5-clip'),
    'sampler.scheduler': ('qwenimage', 'flux'),
    'sampler.sde': ('flow_grpo', 'dance', 'cps'),
    'sampler.logprob_reduce': ('mean', 'sum'),
    'rl.adv_std': ('group', 'global'),
    'rl.timesteps': ('all_but_last', 'random_fraction', 'fixed_window', 'sliding_window'),
    'rl.step_loop': ('auto', 'scan', 'vmap'),
    'rl.behaviour_logprobs': ('rollout', 'trainer'),
    'optim.compute_dtype': ('float32', 'bfloat16'),
    'model.frozen_dtype': ('float32', 'bfloat16'),
    'optim.schedule': ('constant', 'cosine', 'linear'),
    'runtime.mode': ('colocated', 'disagg'),
    'runtime.transfer_guard': ('allow', 'log', 'disallow'),
    'cluster.layout': ('auto', 'explicit'),
    'cluster.rollout.param_dtype': ('float32', 'bfloat16'),
    'cluster.rollout.param_sharding': ('replicated', 'fsdp'),
    'schedule.fragment_unit': ('group', 'sample'),
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
    'sampler.num_steps': 2,
    'latent.height': 1,
    'latent.width': 1,
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
    'log_every': 1,
    'checkpoint_every': 1,
    'keep_checkpoints': 1,
    'sample_grid_every': 0,
}
_INT_HINTS = {
    'rl.group_size': 'GRPO needs at least 2 samples per prompt',
    'runtime.num_devices': '0 = all local devices',
    'eval.num_prompts': '0 = the whole split',
    'eval.every': '0 = off',
    'sample_grid_every': '0 = off',
    'model.lora.rank': '0 = full fine-tuning',
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
    'sampler.noise_level': (0.0, True, _INF, False, ''),
    'sampler.shift': (0.0, True, _INF, False, "0 = the scheduler's dynamic shift"),
    'sampler.guidance_scale': (0.0, True, _INF, False, '<= 1 = no CFG'),
    'sampler.distilled_guidance': (0.0, True, _INF, False, ''),
    'model.rope_theta': (0.0, False, _INF, False, 'diffusers: 10000.0'),
    'model.lora.alpha': (0.0, True, _INF, False, '0 = rank'),
    'reward.timeout_s': (0.0, True, _INF, False, '0 = no limit'),
    'runtime.shutdown_timeout_s': (0.0, False, _INF, False, 'SIGTERM/SIGINT -> exit, default 60'),
    'schedule.tcss_fraction': (0.0, True, 1.0, True, ''),
    'cluster.trainer.speed': (0.0, False, _INF, False, ''),
    'cluster.rollout.speed': (0.0, False, _INF, False, ''),
}


def _check_numbers(config) -> None:
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


def _get(config, dotted):
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ValueError naming the field and the fix; called before anything compiles."""
  for field, choices in _CHOICES.items():
    if _get(config, field) not in choices:
      raise ValueError(f'config.{field}={_get(config, field)!r} is not one of {choices}')
  _check_numbers(config)
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
  if sum(m.axes_dims_rope) != m.attention_head_dim:
    raise ValueError(
        f'sum(config.model.axes_dims_rope)={sum(m.axes_dims_rope)} must equal '
        f'config.model.attention_head_dim={m.attention_head_dim}'
    )
  if not m.rope_theta > 0:
    raise ValueError(f'config.model.rope_theta={m.rope_theta!r} must be > 0 (diffusers: 10000.0)')
  if m.family != 'flux' and m.num_layers < 1:
    raise ValueError(f'config.model.num_layers={m.num_layers} must be >= 1')
  if m.family == 'flux':
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
  elif config.text.encoder == 't5-clip':
    raise ValueError(
        f"config.text.encoder='t5-clip' is FLUX's; config.model.family={m.family!r} "
        "reads 'word' or 'qwen2.5-vl'"
    )
  elif m.guidance_embeds or m.num_single_layers:
    raise ValueError(
        f"config.model.guidance_embeds / num_single_layers are FLUX's; with "
        f'config.model.family={m.family!r} leave them False / 0'
    )
  if config.rl.group_size < 2:
    raise ValueError(
        f'config.rl.group_size={config.rl.group_size}: GRPO needs at least 2 samples ' 'per prompt'
    )
  batch = config.rl.prompts_per_step * config.rl.group_size
  if batch % num_devices:
    raise ValueError(
        f'batch = rl.prompts_per_step * rl.group_size = {batch} is not divisible by '
        f'the {num_devices} devices; change rl.prompts_per_step or runtime.num_devices'
    )
  if config.sampler.num_steps < 2:
    raise ValueError(f'config.sampler.num_steps={config.sampler.num_steps} must be >= 2')
  if config.total_steps < 1:
    raise ValueError(f'config.total_steps={config.total_steps} must be >= 1')
  if config.rl.inner_epochs < 1:
    raise ValueError(f'config.rl.inner_epochs={config.rl.inner_epochs} must be >= 1')
  if config.model.init == 'checkpoint' and not config.model.checkpoint:
    raise ValueError(
        'config.model.checkpoint is empty: give a diffusers pipeline folder (e.g. '
        'Qwen/Qwen-Image, black-forest-labs/FLUX.1-dev) with '
        '--config.model.checkpoint=PATH, or run a random-initialised tiny variant '
        '(configs/qwenimage.py:tiny, configs/flux.py:tiny)'
    )
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
  k = config.runtime.max_consecutive_skips
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(
        f'config.runtime.max_consecutive_skips={k!r} must be an int >= 1 (updates '
        'skipped in a row for NaN/inf before the run stops; default 3)'
    )
  t = config.reward.timeout_s
  if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < float('inf')):
    raise ValueError(
        f'config.reward.timeout_s={t!r} must be a finite number of seconds >= 0 ' '(0 = no limit)'
    )
  if config.eval.samples_per_prompt < 1:
    raise ValueError(
        f'config.eval.samples_per_prompt={config.eval.samples_per_prompt} must be >= 1'
    )
  check_transfer_host(config.cluster.transfer_host)
  reward_registry.register_callables(config.reward.callables)  # errors name the field
  try:
    reward_registry.build_reward(reward_registry.parse_weights(config.reward.weights))
  except ValueError as e:
    raise ValueError(f'config.reward.weights: {e}') from None
  _validate_real_model(config)
  _validate_schedule(config, num_devices)


def _validate_real_model(config: ml_collections.ConfigDict) -> None:
  """LoRA, text cache and VAE fields (the pipeline folder itself is read by experiment.build)."""
  lo = config.model.lora
  if lo.rank < 0 or lo.alpha < 0:
    raise ValueError(
        f'config.model.lora: rank={lo.rank} and alpha={lo.alpha} must be >= 0 '
        '(rank 0 = full fine-tuning; alpha 0 = rank)'
    )
  if config.text.encoder != 'word' and not config.text.cache:
    raise ValueError(
        f'config.text.encoder={config.text.encoder!r} reads an embedding cache: set '
        '--config.text.cache=DIR, made by `python -m digen_jax.encode_prompts '
        '--config=<this config> --prompts=<prompts> --out=DIR`'
    )
  if (
      lo.rank > 0
      and config.runtime.mode == 'disagg'
      and config.cluster.rollout.param_dtype != 'float32'
  ):
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
  if config.latent.vae_batch_chunk < 0 or config.latent.vae_tile < 0:
    raise ValueError(
        f'config.latent.vae_batch_chunk={config.latent.vae_batch_chunk} and '
        f'vae_tile={config.latent.vae_tile} must be >= 0 (0 = off)'
    )


def _validate_schedule(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """config.schedule against the batch, the devices and the mode (see runtime/pipeline.py)."""
  s, rl = config.schedule, config.rl
  m, batch = s.fragments, rl.prompts_per_step * rl.group_size
  if m < 1:
    raise ValueError(f'config.schedule.fragments={m} must be >= 1 (1 = no GAP)')
  if s.fragment_unit == 'group' and rl.prompts_per_step % m:
    raise ValueError(
        f'config.schedule.fragments={m} must divide rl.prompts_per_step='
        f"{rl.prompts_per_step} with fragment_unit='group'; change fragments or use "
        '--config.schedule.fragment_unit=sample'
    )
  if s.fragment_unit == 'sample' and batch % m:
    raise ValueError(
        f'config.schedule.fragments={m} must divide the batch rl.prompts_per_step * '
        f'rl.group_size = {batch}'
    )
  if (batch // m) % num_devices:
    raise ValueError(
        f'a fragment of config.schedule.fragments={m} holds {batch // m} samples, '
        f'not divisible by the {num_devices} devices of a role; lower '
        'schedule.fragments'
    )
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


def set_disagg(
    c: ml_collections.ConfigDict,
    *,
    trainer=None,
    rollout=None,
    by: str = 'devices',
    rollout_param_dtype: str | None = None,
    rollout_param_sharding: str | None = None,
) -> ml_collections.ConfigDict:
  """Makes `c` a disaggregated run (runtime.mode='disagg') in place and returns it.

  trainer / rollout: each role's device positions in jax.devices() (by='devices') or process
  ids (by='processes'). Both None: the 'auto' layout (2 processes: process 0 trains, process 1
  rolls out; 1 process: the first half of its devices train, the second half roll out).
  The roles are checked against the real devices by runtime.cluster.resolve, before compiling.
  """
  if by not in ('devices', 'processes'):
    raise ValueError(f"set_disagg: by={by!r} must be 'devices' or 'processes'")
  if (trainer is None) != (rollout is None):
    raise ValueError(
        'set_disagg: give both trainer= and rollout= (or neither, for the auto layout)'
    )
  c.runtime.mode = 'disagg'
  if trainer is None:
    c.cluster.layout = 'auto'
  else:
    c.cluster.layout = 'explicit'
    for name, ids in (('trainer', trainer), ('rollout', rollout)):
      role = c.cluster[name]
      role.devices, role.processes = (), ()
      role[by] = tuple(int(i) for i in ids)
  if rollout_param_dtype is not None:
    c.cluster.rollout.param_dtype = rollout_param_dtype
  if rollout_param_sharding is not None:
    c.cluster.rollout.param_sharding = rollout_param_sharding
  return c
