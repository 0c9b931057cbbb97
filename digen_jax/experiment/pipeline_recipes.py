"""Settings the diffusers-pipeline configs share (configs/qwenimage.py, configs/flux.py, and the
families to come): GRPO on a real pipeline, full fine-tuning, the two toy-size CPU variants and
the disaggregated layout. Each sets fields of a config from configlib.base_config() in place and
returns it; a family's config file sets its own architecture and sampler around them, so what
the families share is written once and what differs stays in the family's file.
"""

import os
import tempfile

import ml_collections

from digen_jax.experiment import config as configlib


def pipeline_grpo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """GRPO on a real pipeline: 512x512 images (a 16-channel VAE latent of 64x64, decoded 4 images
  at a time), bf16 compute with float32 trainable masters and bf16 frozen copies, the SDE at
  noise level 0.7 on a random 60% of the steps per update, 16 samples for each of 8 prompts,
  LoRA-sized lr 3e-4, remat, no eval. The prompts (config.data.prompts) are the user's to set."""
  c.model.remat = True
  c.latent.space = 'vae'
  c.latent.channels = 16
  c.latent.height = c.latent.width = 64
  c.latent.vae_batch_chunk = 4  # decode 4 images at a time: bounded decoder activations
  c.sampler.noise_level = 0.7
  # Real-model numerics: bf16 compute everywhere, float32 trainable masters, bf16 frozen copies.
  c.optim.compute_dtype = 'bfloat16'
  c.model.frozen_dtype = 'bfloat16'
  # bf16 rollout and trainer programs round differently (|ratio - 1| ~ 3e-3 > the 1e-4 clip):
  # the ratio uses the trainer's own forward (configlib: rl.behaviour_logprobs).
  c.rl.behaviour_logprobs = 'trainer'
  c.optim.lr = 3e-4
  c.rl.group_size = 16
  c.rl.prompts_per_step = 8
  c.rl.timesteps = 'random_fraction'
  c.rl.timestep_fraction = 0.6
  c.data.prompts = ''  # a prompt file (one per line) or tfds name: set it
  c.eval.every = 0
  return c


def full_finetuning(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Every weight trained (float32 masters on the trainer) instead of LoRA, at lr 1e-5. Under
  bf16 compute the rollout samples with a bf16 copy in every mode (its programs cast to bf16
  anyway: the same samples, half the bytes of the copy and of each publish)."""
  c.model.lora.rank = 0
  c.optim.lr = 1e-5
  if c.optim.compute_dtype == 'bfloat16':
    c.cluster.rollout.param_dtype = 'bfloat16'
  return c


def tiny_pixel_space(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The family's architecture at toy size (its sizes are the family's to set), random init,
  full fine-tuning in float32, 16x16 RGB pixel space (identity decoder, 2x2 patches of 3
  channels), the word encoder, 6 sampler steps, 4 samples for each of 2 ShapesBench prompts,
  3 steps: seconds on a CPU."""
  c.model.init = 'random'
  c.model.lora.rank = 0
  c.model.remat = False
  c.model.frozen_dtype = 'float32'
  c.latent.space = 'pixel'
  c.latent.image_height = c.latent.image_width = 0  # pixel space: the grid is the image
  c.latent.channels = 3
  c.latent.vae_batch_chunk = 0
  c.model.in_channels = 12
  c.model.out_channels = 3
  c.latent.height = c.latent.width = 16
  c.text.encoder = 'word'
  c.text.max_length = 16
  c.sampler.num_steps = 6
  c.sampler.shift = 3.0
  c.optim.compute_dtype = 'float32'
  c.cluster.rollout.param_dtype = 'float32'  # float32 compute: the copy as trained
  c.rl.behaviour_logprobs = 'rollout'
  c.optim.lr = 1e-4
  _toy_run(c)
  return c


def tiny_pipeline(
    c: ml_collections.ConfigDict, folder_name: str, *, full: bool
) -> ml_collections.ConfigDict:
  """The whole real path at toy size: a random diffusers pipeline folder (built by
  digen_jax/experiment/tiny_pipeline.py under the temp dir's `folder_name` if absent, its
  prompts encoded into its text_cache/), 4-channel latents, 4 sampler steps in float32, LoRA
  rank 4 (full: every weight), JPEG + ShapesBench rewards, an eval every 2 of 3 steps. The
  family sets its own toy sizes (num_layers, joint_attention_dim, latent size, ...)."""
  c.model.checkpoint = os.path.join(tempfile.gettempdir(), folder_name)
  c.model.build_tiny_pipeline = True
  c.model.remat = False
  c.model.in_channels = 16
  c.model.out_channels = 4
  c.model.attention_head_dim = 16
  c.model.num_attention_heads = 2
  c.model.axes_dims_rope = (4, 6, 6)
  c.model.lora.rank = 0 if full else 4
  c.model.lora.alpha = 8.0
  c.latent.channels = 4
  c.latent.vae_batch_chunk = 4
  c.text.cache = os.path.join(c.model.checkpoint, 'text_cache')
  c.text.max_length = 32
  c.sampler.num_steps = 4
  c.optim.compute_dtype = 'float32'
  c.cluster.rollout.param_dtype = 'float32'  # float32 compute: the copy as trained
  c.model.frozen_dtype = 'float32'
  c.optim.lr = 1e-3
  _toy_run(c)
  c.reward.weights = 'jpeg_compressibility:1,shapes:1'
  c.eval.every = 2
  c.eval.num_prompts = 4
  c.eval.samples_per_prompt = 2
  c.eval.batch_size = 8
  return c


def ocr_task(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The text-rendering task (tasks/text_render: `a sign that says "OPEN 24 HOURS"`) scored by
  the offline OCR reward (rewards/ocr.py, PP-OCRv4 in reward worker processes), as Flow-GRPO's
  OCR recipe: eval on held-out texts. Apply after the size variants (tiny_pipeline sets
  ShapesBench prompts and rewards)."""
  c.data.prompts = 'text_render'
  c.eval.split = 'eval'
  c.reward.weights = 'ocr'
  c.reward.callables = ''
  # PP-OCRv4 on a CPU core reads a 512 px image in ~0.1-0.3 s: workers score a step's batch
  # while the rollout samples (state config.reward.device_s_per_sample only for GPU workers).
  c.reward.workers = 4
  c.reward.batch_size = 8
  return c


def _toy_run(c: ml_collections.ConfigDict) -> None:
  # 4 samples for each of 2 ShapesBench prompts, every stochastic step trained, 3 steps.
  c.rl.group_size = 4
  c.rl.prompts_per_step = 2
  c.rl.timesteps = 'all_but_last'
  c.data.prompts = 'shapes'
  c.total_steps = 3


def disagg(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Rollout and trainer on separate meshes ('auto' layout: 2 processes -> process 0 trains,
  process 1 rolls out; 1 process -> half of its devices each). The rollout copy keeps the dtype
  the config gives it (full_finetuning: bf16 under bf16 compute; LoRA: the float32 adapters,
  which the rollout merges into its own frozen base)."""
  return configlib.set_disagg(c)
