"""The full default config tree every config file starts from, and its validation.

Config files in configs/ call `base_config()` and override fields; the tree is locked, so a
command-line override of a key that does not exist (`--config.rl.grup_size=4`) fails at parse
time. `validate(config, num_devices)` checks cross-field consistency before anything compiles
(experiment/validation.py, importable from here as every caller imports it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import ml_collections

# Re-exported: configs/, the runtime and the tests call them as configlib.validate / ...


def validate(config, num_devices: int):
  """experiment/validation.validate: cross-field checks before anything compiles; returns the
  fragment plan. Imported on first use: validation imports JAX, and loading a config file (every
  command's first step, before a busy workdir is refused) need not."""
  from digen_jax.experiment import validation  # pylint: disable=g-import-not-at-top

  return validation.validate(config, num_devices)


def check_transfer_host(host, field: str = 'config.cluster.transfer_host') -> str:
  """experiment/validation.check_transfer_host (imported on first use, as validate)."""
  from digen_jax.experiment import validation  # pylint: disable=g-import-not-at-top

  return validation.check_transfer_host(host, field)


__all__ = [
    'SHAPES_AE_CHECKPOINT',
    'SHAPES_BASE_CHECKPOINT',
    'SHAPES_LATENT_BASE_CHECKPOINT',
    'apply_overrides',
    'base_config',
    'check_transfer_host',
    'set_disagg',
    'shapes_base',
    'shapes_latent_base',
    'sibling_config',
    'validate',
]


def sibling_config(this_file: str, name: str) -> types.ModuleType:
  """The config file `name`.py beside `this_file` (a config file's __file__), as a module: a
  config built on another loads wherever the checkout is and whatever the working directory
  (`from configs import ...` needs the checkout's root on sys.path)."""
  path = os.path.join(os.path.dirname(os.path.abspath(this_file)), f'{name}.py')
  module_name = f'_digen_config_{name}'
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  spec.loader.exec_module(module)
  return module


def base_config() -> ml_collections.ConfigDict:
  """The full default tree: one section per concern (each built by its own function below)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 4  # optimizer steps (one per logical batch)
  c.model = _model_section()
  c.latent = _latent_section()
  c.text = _text_section()
  c.data = _data_section()
  c.sampler = _sampler_section()
  c.rl = _rl_section()
  c.reward = _reward_section()
  c.optim = _optim_section()
  c.runtime = _runtime_section()
  c.cluster = _cluster_section()
  c.parallel = _parallel_section()
  c.schedule = _schedule_section()
  c.eval = _eval_section()
  c.baseline = _baseline_section()

  # Bookkeeping.
  c.log_every = 1
  c.checkpoint_every = 1
  c.keep_checkpoints = 2
  c.sample_grid_every = 0  # write samples/ PNG grids every N steps (0 = off)
  return c


def _model_section() -> ml_collections.ConfigDict:
  """config.model: the generator (architecture, family, execution options, LoRA)."""
  model = ml_collections.ConfigDict()
  model.checkpoint = ''  # diffusers folder / our pretrained checkpoint; '' = random init
  model.init = 'checkpoint'  # 'checkpoint' (needs model.checkpoint) or 'random'
  model.patch_size = 2
  model.in_channels = 64  # latent channels * patch_size**2 (packed)
  model.out_channels = 16
  model.num_layers = 60
  model.attention_head_dim = 128
  model.num_attention_heads = 24
  model.joint_attention_dim = 3584
  model.axes_dims_rope = (16, 56, 56)
  model.rope_theta = (
      10000.0  # diffusers' QwenEmbedRope theta; smaller = finer position code on small grids
  )
  model.pooled_text = False  # FLUX-style pooled prompt in the timestep embedding (not QwenImage)
  model.family = 'qwenimage'  # 'qwenimage' (MMDiT) | 'flux' | 'wan' (models/family.py)
  # FLUX only: single-stream blocks after the num_layers double-stream ones, the CLIP pooled
  # vector's size, and FLUX.1-dev's guidance embedding (guidance distillation; -schnell has none).
  model.num_single_layers = 0
  model.pooled_projection_dim = 768
  model.guidance_embeds = False
  # Wan only (models/transformers/wan.py): the feed-forward width (Wan2.1-14B 13824, 1.3B 8960) and the
  # affine LayerNorm before cross-attention (Wan2.1: True). Its rotary axes follow from the head
  # dim (axes_dims_rope is not read).
  model.ffn_dim = 13824
  model.cross_attn_norm = True
  # Execution options (same math, same params): jax.checkpoint each block in the update's backward
  # pass, and run the blocks under lax.scan (False: unrolled; compile time grows with layers).
  model.remat = False
  model.scan_layers = True
  # Attention kernel (models/attention/kernels.py): 'auto' = cuDNN's fused flash attention on a GPU with
  # bf16 compute, the portable XLA path elsewhere; 'portable' forces the XLA path everywhere;
  # 'fused' demands cuDNN (a clear error at start where it cannot run). Same math either way.
  model.attention = 'auto'
  # Frozen weights (the LoRA base and the VAE) are held in this dtype on every mesh; trainable
  # weights are always float32 masters (optim.compute_dtype casts them inside the programs).
  model.frozen_dtype = 'float32'  # 'float32' | 'bfloat16'
  # LoRA: rank 0 trains every weight; rank >= 1 trains only adapters W + alpha/rank * A @ B on the
  # Linear layers whose diffusers module name (e.g. 'transformer_blocks.3.attn.to_q') matches
  # the regex `targets` (re.search, PEFT-style). Dropout is not supported (always 0).
  model.lora = ml_collections.ConfigDict()
  model.lora.rank = 0
  model.lora.alpha = 0.0  # 0 = rank (scale 1)
  model.lora.targets = (
      r'attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$'
  )
  return model


def _latent_section() -> ml_collections.ConfigDict:
  """config.latent: what the generator works in: the latent grid and its decoder."""
  latent = ml_collections.ConfigDict()
  latent.space = 'vae'  # 'pixel' (identity decoder, tiny configs), 'vae' (the pipeline
  # folder's VAE) or 'ae' (our autoencoder at latent.ae)
  latent.ae = ''  # 'ae' space: a digen_jax.tasks.shapes.pretrain_ae params folder
  latent.channels = 16  # unpacked latent channels (3 for pixel space)
  latent.height = 166  # latent grid (pixels for 'pixel' space)
  latent.width = 166
  # 'vae' space with a pipeline folder: the image size in pixels (0 = the latent grid above as
  # given), a multiple of the VAE's compression x model.patch_size; it sets latent.height/width
  # (experiment/folder_config.py, which also reads model.* sizes and latent.channels from the
  # folder).
  latent.image_height = 0
  latent.image_width = 0
  # Latent frames: 1 for images; a Wan video of 1 + 4k frames has k + 1 (its VAE compresses
  # time 4x, keeping the first frame: 81 frames -> 21). Tokens are frames x (height/p) x (width/p).
  latent.frames = 1
  # 'vae' space: the pipeline folder's VAE decodes inside the rollout program. Memory bounds for
  # large images: decode `vae_batch_chunk` images at a time (0 = all at once), and/or in
  # overlapping spatial tiles of `vae_tile` pixels (0 = whole images; diffusers' tiled decode).
  latent.vae_batch_chunk = 0
  latent.vae_tile = 0
  return latent


def _text_section() -> ml_collections.ConfigDict:
  """config.text: text conditioning."""
  text = ml_collections.ConfigDict()
  # 'word' (small frozen word-level encoder), 'qwen2.5-vl', 't5-clip' (FLUX), 'umt5' (Wan)
  text.encoder = 'qwen2.5-vl'
  text.max_length = 1024
  # Real encoders ('qwen2.5-vl') are read from an embedding cache written by
  # `python -m digen_jax.encode_prompts --config=... --prompts=... --out=DIR`; torch never runs
  # in the training process.
  text.cache = ''
  # 'word' encoder: its frozen table's seed, apart from config.seed (which seeds the rollouts and
  # the prompt order), so an RL run can change its seed and keep the table a checkpoint was
  # trained with (the checkpoint records its digest).
  text.seed = 0
  return text


def _data_section() -> ml_collections.ConfigDict:
  """config.data: the prompts."""
  data = ml_collections.ConfigDict()
  data.prompts = 'shapes'  # 'shapes' (ShapesBench) or a path to a text file, one prompt per line
  data.split = 'train'
  data.data_dir = ''  # tfds data_dir; '' = $DIGEN_DATA_DIR, else <workdir>/data
  data.max_prompt_chars = 512  # a prompt file's longest allowed line, in characters
  return data


def _sampler_section() -> ml_collections.ConfigDict:
  """config.sampler: sampling (scheduler, SDE, CFG)."""
  sampler = ml_collections.ConfigDict()
  sampler.num_steps = 50
  # A pipeline folder's own scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler: shift,
  # dynamic shifting and its parameters, shift_terminal) gives the sigmas; without one (random
  # init, our params folders) 'qwenimage' | 'flux' name the releases' settings. 'wan': Wan2.1's
  # UniPC flow sigmas with the static flow shift sampler.shift (our sampler steps them Euler/SDE).
  sampler.scheduler = 'qwenimage'
  sampler.shift = 0.0  # > 0: static shift overriding the scheduler's own shifting
  sampler.sde = 'flow_grpo'  # 'flow_grpo' | 'dance' | 'cps'
  sampler.noise_level = 0.7
  sampler.logprob_reduce = 'mean'  # 'mean' | 'sum' over latent dims
  sampler.guidance_scale = 0.0  # > 1 turns on CFG (rollout and training alike)
  sampler.norm_rescale = True  # QwenImage "true CFG" norm rescale
  sampler.negative_prompt = ' '  # CFG's unconditional branch (the QwenImage pipelines' ' ')
  sampler.distilled_guidance = 3.5  # FLUX.1-dev's guidance input (model.guidance_embeds), not CFG
  return sampler


def _rl_section() -> ml_collections.ConfigDict:
  """config.rl: GRPO."""
  rl = ml_collections.ConfigDict()
  rl.prompts_per_step = 2
  rl.group_size = 4
  rl.adv_std = 'group'  # 'group' | 'global'
  rl.adv_eps = 1e-4
  rl.adv_clip = 5.0
  rl.clip_range = 1e-4  # PPO epsilon (small: log-probs are means over latent dims)
  rl.kl_beta = 0.0
  rl.inner_epochs = 1
  rl.timesteps = (
      'all_but_last'  # 'all_but_last' | 'random_fraction' | 'fixed_window' | 'sliding_window'
  )
  rl.timestep_fraction = 0.5
  rl.window_start = 0
  rl.window_size = 2
  rl.slide_every = 1
  # How the update runs its K trained timesteps (same loss and gradient): 'scan' one after another
  # (B-sized forwards, like the rollout's; with model.remat the least memory and, on CPUs, the
  # fastest), 'vmap' as one K*B batch; 'auto': scan on a 1-device trainer mesh, vmap on more
  # (programs.step_loop_for: why). TSP always shards a vmap over the trainer mesh.
  rl.step_loop = 'auto'
  # Whose behaviour log-probs the importance ratio uses: the rollout's (stored with the
  # trajectory), or the trainer's own forward under stop_gradient (one on-policy epoch: the
  # ratio is exactly 1, at no extra cost). With bf16 compute the rollout's and the trainer's
  # programs round differently and |ratio - 1| reaches ~3e-3 (tests/core/rl/test_ratio_mmdit.py), far
  # beyond a 1e-4 clip range; metrics.jsonl's rollout_ratio_max_dev keeps reporting that gap.
  # Needs rl.inner_epochs = 1 and no TCSS (stale fragments need their own version's log-probs).
  rl.behaviour_logprobs = 'rollout'
  # The objective (docs/design.md#objectives). 'grpo': the SDE trajectory's exact log-probs and
  # the fields above. 'nft' (DiffusionNFT) and 'awm' (Advantage Weighted Matching) are
  # likelihood-free: they train on the rollout's clean samples through the forward (noising)
  # process, so the rollout runs any sampler, stores no trajectory and no log-probs, and the
  # GRPO-only fields (clip_range for nft, timesteps, window_*, behaviour_logprobs) are unused
  # (so a family config's GRPO recipe switches with --config.rl.algorithm alone).
  rl.algorithm = 'grpo'  # 'grpo' | 'nft' | 'awm'
  # nft/awm: the rollout's sampler, config.sampler.num_steps steps: 'ode' (Euler) or 'sde'
  # (config.sampler.sde on every step but the last).
  rl.rollout_sampler = 'ode'
  # nft/awm: forward-process noise levels trained per sample and update, each with fresh
  # noise: nft K distinct sigmas of the rollout's grid (0: DiffusionNFT's K = int(0.99 * T)),
  # awm K stratified ones (0: AWM's K = 6).
  rl.train_noise_levels = 0
  rl.nft_beta = 1.0  # nft: beta of the implicit policies v+- (DiffusionNFT: 1.0; 0.1 for OCR)
  # nft/awm: the old (sampling) policy's soft update after every optimizer step, decay
  # min((step - flat) * uprate, uphold) after `flat` steps, 0 before (DiffusionNFT decay_type 1:
  # 0, 0.001, 0.5; uprate 0 keeps the old policy equal to the current one, no second forward).
  rl.old_policy_flat = 0
  rl.old_policy_uprate = 0.001
  rl.old_policy_uphold = 0.5
  # awm: the matching loss's weighting rho(mse, t) ('Uniform' | 't' | 't**2' | 'huber' |
  # 'ghuber') and ghuber's power; the advantage clip(A, +-adv_clip) / adv_clip * advantage_max;
  # the velocity KL to the EMA policy (the old policy above; AWM: uphold 0.3); the stratified
  # levels over the first timestep_fraction of the grid, sigma_0 included or not
  # (AWM's config/dgx_awm.py: ghuber 0.25, 1.0, 1.0, 0.9, True; rl/awm.py).
  rl.awm_weighting = 'ghuber'
  rl.awm_ghuber_power = 0.25
  rl.awm_advantage_max = 1.0
  rl.awm_ema_kl_beta = 1.0
  rl.awm_timestep_fraction = 0.9
  rl.awm_include_init = True
  return rl


def _reward_section() -> ml_collections.ConfigDict:
  """config.reward: what scores the samples."""
  reward = ml_collections.ConfigDict()
  # 'name[:weight],...' over the registered rewards (digen_jax/rewards/registry.py), e.g.
  # --config.reward.weights=shapes_dense or 'shapes:1,shapes_strict:0.5'; their weighted sum.
  reward.weights = 'jpeg_compressibility'
  # A user's own rewards, without editing the package: 'name=module.path:function,...' or
  # 'name=/path/to/file.py:function'. Each function takes (uint8 images [B, H, W, 3], prompts)
  # and returns [B] scores; `name` can then be used in reward.weights. In a video run (Wan) it
  # takes the uint8 videos [B, F, H, W, 3]; the built-in image rewards score every frame there
  # and average (rewards/registry.py).
  reward.callables = ''
  # A reward call (one batch) that takes longer is abandoned: its samples score NaN and the update
  # is skipped (0 = no limit). A reward that raises or returns NaN is treated the same way, with
  # the prompt that caused it in the log (rewards/registry.py: guarded).
  reward.timeout_s = 600.0
  # Where the rewards run (rewards/scoring.py; README "Learned rewards and reward workers").
  # Learned models ('ocr', 'clip_score', 'pickscore', 'aesthetic', 'hpsv2', 'image_reward':
  # rewards/learned.py; what each folder holds: docs/rewards.md "Preference models") and the
  # names in `in_workers` run in `workers` worker processes started by the run (torch/ONNX never
  # in the training process), on `worker_devices` ('cpu', or e.g. 'cuda:0,cuda:1': worker i gets
  # the i-th, round robin), fed `batch_size` samples at a time as fragments finish; a batch that
  # hangs past timeout_s or whose worker dies is retried `retries` times on a restarted worker;
  # a worker failing `max_restarts` times in a row stops the run. `models`: 'name=FOLDER' local
  # weights folders (nothing is downloaded). `remote`: 'name=URL' HTTP scorers
  # (rewards/remote.py), `workers` requests at a time.
  reward.workers = 1
  reward.in_workers = ''
  reward.worker_devices = 'cpu'
  reward.models = ''
  reward.remote = ''
  reward.batch_size = 8
  reward.retries = 1
  reward.max_restarts = 3
  reward.start_timeout_s = 300.0
  # A sample whose reward failed (raised, NaN, timed out, its worker died): 'mask' leaves it out
  # of its group's advantage (counted in metrics.jsonl: reward_failed); 'skip' skips the update.
  reward.failed = 'mask'
  # Several rewards: 'sum' = GRPO advantage of the weighted sum; 'advantages' = weighted sum of
  # each reward's own group-normalised advantage (multi-reward GRPO; rl/advantages.py).
  reward.combine = 'sum'
  # What scoring costs the accelerators, per sample (the planner's term; no program reads it):
  # 0 for rewards that run on the host (every registered one); a learned reward model states
  # its measured device-seconds per sample on `cost_accelerator`, and where that was measured
  # (a run records its own: metrics.jsonl's reward_s_per_sample; docs/rewards.md).
  reward.device_s_per_sample = 0.0
  reward.cost_accelerator = ''
  reward.cost_source = ''
  return reward


def _baseline_section() -> ml_collections.ConfigDict:
  """config.baseline: how the colocated system the planner compares against runs (perf/
  baseline.py; no program reads it). The defaults are veRL-Omni's colocated Qwen-Image recipe
  (its hybrid engine: torch FSDP training, a generation engine that sleeps while it trains)."""
  b = ml_collections.ConfigDict()
  b.engine = 'torch'  # whose measured efficiencies (perf/calibrations.py): 'torch' | 'digen_jax'
  b.param_offload = True  # FSDP params to host memory while it samples, back to train
  b.optimizer_offload = True  # optimizer state likewise
  b.engine_sleep = True  # the generation engine's weights to host and back (vLLM sleep level 1)
  b.layered_sync = True  # new weights gathered into the engine, layer by layer, every step
  b.behaviour_pass = True  # a forward over the trained steps for the old log-probs
  b.mini_batches = 2  # optimizer steps per batch (veRL's ppo_mini_batch_size: 16 of 32 prompts)
  b.micro_batch = 16  # samples per device per forward/backward (ppo_micro_batch_size_per_gpu)
  # FSDP as veRL-Omni's multi-node guide configures it (verl-project/verl-omni docs/start/multi_node_training.md):
  # shard groups of one node's devices (fsdp_size=$GPUS_PER_NODE; 0 here), replicated across
  # nodes; reshard_after_forward 'auto' = 'no' across nodes (the guide), 'yes' on one node (the
  # single-node scripts keep FSDP's default).
  b.fsdp_size = 0
  b.reshard_after_forward = 'auto'  # 'auto' | 'yes' | 'no'
  b.adapter_only_sync = True  # LoRA: the engine receives only the adapters each step
  return b


def _optim_section() -> ml_collections.ConfigDict:
  """config.optim: the optimizer and its learning-rate schedule."""
  optim = ml_collections.ConfigDict()
  optim.lr = 1e-4
  optim.b1 = 0.9
  optim.b2 = 0.999
  optim.eps = 1e-8
  optim.weight_decay = 1e-4
  optim.grad_clip = 1.0
  # Learning-rate schedule over the run's optimizer updates (total_steps * rl.inner_epochs):
  # linear warm-up for warmup_steps, then 'constant', or 'cosine' / 'linear' decay to
  # lr * final_lr_frac at the last update.
  optim.schedule = 'constant'
  optim.warmup_steps = 0
  optim.final_lr_frac = 0.0
  optim.compute_dtype = 'float32'  # 'bfloat16': bf16 forward/backward, float32 master weights
  return optim


def _runtime_section() -> ml_collections.ConfigDict:
  """config.runtime: execution."""
  runtime = ml_collections.ConfigDict()
  runtime.mode = 'colocated'  # 'colocated' (one mesh) | 'disagg' (rollout and trainer meshes)
  runtime.num_devices = 0  # colocated: 0 = all local devices (disagg: see cluster)
  runtime.transfer_guard = 'disallow'  # jax.transfer_guard around the hot loop: no implicit copies
  # An update whose rewards, advantages, loss, gradient or new weights hold NaN/inf is skipped
  # (weights and optimizer state unchanged, counted in metrics.jsonl); this many in a row stop
  # the run with an error, the last checkpoint holding the last good weights.
  runtime.max_consecutive_skips = 3
  # SIGTERM/SIGINT: the trainer checkpoints its last completed step and every process exits
  # within this many seconds (after it, a process still busy exits anyway; see interrupt.py).
  runtime.shutdown_timeout_s = 60.0
  # Resuming a workdir whose checkpoints were saved under other settings that change the run
  # (optimizer, batch, reward, ...) is refused; naming the fields here (comma-separated, e.g.
  # 'optim.lr') accepts them and records the change in <workdir>/config_history.jsonl
  # (experiment/resume_guard.py).
  runtime.resume_changed = ''
  return runtime


def _cluster_section() -> ml_collections.ConfigDict:
  """config.cluster: roles and meshes of runtime.mode='disagg' (colocated ignores it)."""
  # layout 'auto': 2 processes -> process 0 trains, process 1 rolls out; 1 process -> the first
  # half of its devices train, the second half roll out. 'explicit': the roles' fields below.
  # See set_disagg().
  cluster = ml_collections.ConfigDict()
  cluster.layout = 'auto'
  for role in ('trainer', 'rollout'):
    r = cluster[role] = ml_collections.ConfigDict()
    r.devices = ()  # positions in jax.devices(), e.g. (0, 1)
    r.processes = ()  # or process ids: every device of those processes
    r.mesh_shape = ()  # () = 1-D over the role's devices; else e.g. (2, 2)
    r.axis_names = ('data',)  # one name per mesh axis ('data,fsdp' on the command line)
    r.speed = 1.0  # relative device speed label (heterogeneous clusters)
  # The one interface each process's transfer server (weights and batches across processes)
  # listens on: an IP address, or 'hostname' (the address this machine's name resolves to) for a
  # job over several machines. The default keeps it off every network.
  cluster.transfer_host = '127.0.0.1'
  cluster.rollout.param_dtype = 'float32'  # 'bfloat16': lower-precision rollout copy
  cluster.rollout.param_sharding = 'replicated'  # 'replicated' (data-parallel) | 'fsdp'
  return cluster


def _parallel_section() -> ml_collections.ConfigDict:
  """config.parallel: how a program spreads one sample over a role's devices (both roles)."""
  parallel = ml_collections.ConfigDict()
  # Sequence parallelism: each sample's tokens split over this many devices of the rollout and
  # trainer meshes ("Ulysses": all-to-all from token-split to head-split around attention;
  # models/attention/sequence_parallel.py). It must divide each role's device count and the model's
  # attention heads; the token count is padded to it. 1 = no split. What it buys: a device
  # holds 1/s of a sample's activations, so a fragment needs only n/s samples to fill n
  # devices (docs/design.md#attention-and-sequence-parallelism, docs/real_models.md "Long videos").
  parallel.sequence = 1
  return parallel


def _schedule_section() -> ml_collections.ConfigDict:
  """config.schedule: scheduling (docs/design.md#execution-modes); the defaults are the synchronous
  schedule."""
  schedule = ml_collections.ConfigDict()
  schedule.fragments = 1  # M: GAP fragments per logical batch (1 = no GAP)
  schedule.fragment_unit = 'group'  # 'group' | 'sample'
  # TSP: a fragment's K trained steps x its samples as one fwd/bwd over a (t, b) view of the
  # trainer mesh (programs/tsp.py); tsp_steps_axis is t: 0 = auto, else a divisor of the
  # trainer's device count.
  schedule.tsp = False
  schedule.tsp_steps_axis = 0
  # LoRA: the fragment gradients of an optimizer step read the frozen base gathered once at the
  # step's start (replicated on every trainer device until the step's apply) instead of
  # all-gathering its FSDP shards in every fragment: fewer collectives, a whole base per device.
  schedule.frozen_once_per_step = False
  schedule.tag = False  # trainer-assisted generation, insertions decided by BTS
  schedule.tcss_fraction = 0.0  # phi: share of next batch's fragments allowed one-version-stale
  schedule.trace = True  # write trace.json + timeline.png under the workdir
  # Across processes, True makes the rollout wait until the trainer has pulled each fragment
  # before it samples the next (no run-ahead). A process busy with a program may serve the
  # trainer's pull late (pinned CPU processes here: a fragment arrived 1-3 fragments late), so
  # handing over between programs is faster here: GAP+TSP+TAG 1.36x -> 1.48x naive disagg on a
  # balanced config; only a rollout-bound GAP-only run lost (-9%) (benchmarks/RESULTS.md).
  schedule.wait_for_pull = True
  return schedule


def _eval_section() -> ml_collections.ConfigDict:
  """config.eval: evaluation (deterministic ODE sampling; strict accuracy for ShapesBench
  prompts)."""
  evaluation = ml_collections.ConfigDict()
  evaluation.every = 0  # evaluate every N optimizer steps (0 = off); also at start/end
  evaluation.split = 'eval'
  evaluation.num_prompts = 0  # 0 = the whole split
  evaluation.samples_per_prompt = 4
  evaluation.batch_size = 32
  evaluation.seed = 1234
  return evaluation


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
SHAPES_AE_CHECKPOINT = 'assets/shapes_ae'  # the ShapesBench autoencoder (its README)
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
