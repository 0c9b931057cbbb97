"""Qwen-Image (20B MMDiT) GRPO from a diffusers pipeline folder, and toy variants for a CPU.

Real weights (README "Real models"): encode the prompts once, then train (LoRA by default):
  python -m digen_jax.encode_prompts --config=configs/qwenimage.py \
      --config.model.checkpoint=/path/Qwen-Image --prompts=prompts.txt --out=/path/cache
  python -m digen_jax.main --config=configs/qwenimage.py --workdir=/tmp/run \
      --config.model.checkpoint=/path/Qwen-Image --config.text.cache=/path/cache \
      --config.data.prompts=prompts.txt
Variants (comma-separated, e.g. `:full,disagg`):
  full            full fine-tuning (float32 masters on the trainer) instead of LoRA
  disagg          rollout and trainer on separate meshes (README "Disaggregated runs")
  tiny            the architecture at toy size, random init, pixel space, word encoder: seconds
  tiny_disagg     tiny + disagg
  tiny_pipeline   the whole real path at toy size: a random diffusers Qwen-Image folder
                  (transformer, VAE, Qwen2.5-VL text encoder, tokenizer, scheduler) is built
                  under config.model.checkpoint if absent and its prompts encoded into
                  config.text.cache (both in child processes: torch never runs in training),
                  then cached embeddings -> MMDiT sampling with true CFG -> VAE decode ->
                  JPEG + ShapesBench rewards -> GRPO (LoRA; add `full` for all weights)
"""

import os
import tempfile

from digen_jax.experiment import config as configlib

VARIANTS = ('full', 'disagg', 'tiny', 'tiny_disagg', 'tiny_pipeline')


def get_config(arg: str | None = None):
  variants = [v for v in (arg or '').split(',') if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f'configs/qwenimage.py: unknown variant(s) {unknown}; known: {VARIANTS}')
  c = configlib.base_config()
  # The real architecture: diffusers' Qwen/Qwen-Image transformer/config.json.
  c.model.patch_size = 2
  c.model.in_channels = 64
  c.model.out_channels = 16
  c.model.num_layers = 60
  c.model.attention_head_dim = 128
  c.model.num_attention_heads = 24
  c.model.joint_attention_dim = 3584
  c.model.axes_dims_rope = (16, 56, 56)
  c.model.remat = True
  # 512x512 training images as Flow-GRPO trains (the model's native 1328x1328 is latent 166):
  # the VAE compresses 8x spatially into 16 channels.
  c.latent.space = 'vae'
  c.latent.channels = 16
  c.latent.height = c.latent.width = 64
  c.latent.vae_batch_chunk = 4  # decode 4 images at a time: bounded decoder activations
  c.text.encoder = 'qwen2.5-vl'
  # Prompt tokens after the template is dropped (diffusers caps at 512); RL prompt sets are
  # short, and every text token costs attention. A longer prompt is a clear error at start.
  c.text.max_length = 128
  c.sampler.scheduler = 'qwenimage'
  c.sampler.num_steps = 10  # Flow-GRPO-style training rollouts (inference uses 50)
  c.sampler.guidance_scale = 4.0  # QwenImage pipeline true_cfg_scale, negative prompt ' '
  c.sampler.noise_level = 0.7
  # Real-model numerics: bf16 compute everywhere, float32 trainable masters, bf16 frozen copies.
  c.optim.compute_dtype = 'bfloat16'
  c.model.frozen_dtype = 'bfloat16'
  # bf16 rollout and trainer programs round differently (|ratio - 1| ~ 3e-3 > the 1e-4 clip):
  # the ratio uses the trainer's own forward (configlib: rl.behaviour_logprobs).
  c.rl.behaviour_logprobs = 'trainer'
  # LoRA on every attention projection of both streams (what most users train).
  c.model.lora.rank = 64
  c.model.lora.alpha = 128.0
  c.optim.lr = 3e-4
  c.rl.group_size = 16
  c.rl.prompts_per_step = 8
  c.rl.timesteps = 'random_fraction'
  c.rl.timestep_fraction = 0.6
  c.data.prompts = ''  # a prompt file (one per line) or tfds name: set it
  c.eval.every = 0

  if 'full' in variants:
    c.model.lora.rank = 0
    c.optim.lr = 1e-5

  if 'tiny' in variants or 'tiny_disagg' in variants:
    # Same architecture, random init, pixel space (identity decoder): runs in seconds on a CPU.
    c.model.init = 'random'
    c.model.lora.rank = 0
    c.model.remat = False
    c.model.num_layers = 2
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 32
    c.model.axes_dims_rope = (8, 12, 12)
    c.model.joint_attention_dim = 32
    c.model.frozen_dtype = 'float32'
    c.latent.space = 'pixel'
    c.latent.channels = 3
    c.latent.vae_batch_chunk = 0
    c.model.in_channels = 12
    c.model.out_channels = 3
    c.latent.height = c.latent.width = 16
    c.text.encoder = 'word'
    c.text.max_length = 16
    c.sampler.num_steps = 6
    c.sampler.guidance_scale = 0.0
    c.sampler.shift = 3.0
    c.optim.compute_dtype = 'float32'
    c.rl.behaviour_logprobs = 'rollout'
    c.optim.lr = 1e-4
    c.rl.group_size = 4
    c.rl.prompts_per_step = 2
    c.rl.timesteps = 'all_but_last'
    c.data.prompts = 'shapes'
    c.total_steps = 3

  if 'tiny_pipeline' in variants:
    # digen_jax/experiment/tiny_pipeline.py's toy sizes (a random diffusers Qwen-Image folder).
    c.model.checkpoint = os.path.join(tempfile.gettempdir(), 'digen_tiny_qwenimage')
    c.model.build_tiny_pipeline = True
    c.model.remat = False
    c.model.in_channels = 16
    c.model.out_channels = 4
    c.model.num_layers = 2
    c.model.attention_head_dim = 16
    c.model.num_attention_heads = 2
    c.model.joint_attention_dim = 32
    c.model.axes_dims_rope = (4, 6, 6)
    c.model.lora.rank = 4 if 'full' not in variants else 0
    c.model.lora.alpha = 8.0
    c.latent.channels = 4
    c.latent.height = c.latent.width = 8  # 64x64 images
    c.latent.vae_batch_chunk = 4
    c.text.cache = os.path.join(c.model.checkpoint, 'text_cache')
    c.text.max_length = 32
    c.sampler.num_steps = 4
    c.sampler.guidance_scale = 4.0
    c.optim.compute_dtype = 'float32'
    c.model.frozen_dtype = 'float32'
    c.optim.lr = 1e-3
    c.rl.group_size = 4
    c.rl.prompts_per_step = 2
    c.rl.timesteps = 'all_but_last'
    c.data.prompts = 'shapes'
    c.reward.weights = 'jpeg_compressibility:1,shapes:1'
    c.eval.every = 2
    c.eval.num_prompts = 4
    c.eval.samples_per_prompt = 2
    c.eval.batch_size = 8
    c.total_steps = 3

  if 'disagg' in variants or 'tiny_disagg' in variants:
    # 'auto' layout: 2 processes -> process 0 trains, process 1 rolls out; 1 process -> half
    # of its devices each. Full fine-tuning publishes a bf16 rollout copy when the compute
    # dtype is bf16 (the programs cast to bf16 anyway, so nothing changes but the bytes);
    # LoRA publishes its float32 adapters (the rollout merges them into its own frozen base).
    bf16 = c.optim.compute_dtype == 'bfloat16' and c.model.lora.rank == 0
    configlib.set_disagg(c, rollout_param_dtype='bfloat16' if bf16 else 'float32')
  return c
