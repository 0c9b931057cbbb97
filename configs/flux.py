"""FLUX.1 (12B) GRPO from a diffusers pipeline folder, and toy variants for a CPU.

Real weights (README "Real models"): encode the prompts once (T5 + CLIP, in their own PyTorch
process), then train (LoRA by default):
  python -m digen_jax.encode_prompts --config=configs/flux.py \
      --config.model.checkpoint=/path/FLUX.1-dev --prompts=prompts.txt --out=/path/cache
  python -m digen_jax.main --config=configs/flux.py --workdir=/tmp/run \
      --config.model.checkpoint=/path/FLUX.1-dev --config.text.cache=/path/cache \
      --config.data.prompts=prompts.txt

Defaults: FLUX.1-dev (guidance-distilled: the guidance scale 3.5 is a model input, no CFG branch),
512x512 images (latent 64x64x16, packed 2x2 into 1024 tokens of 64 channels), the flux scheduler's
dynamic shift from that token count, 16 sampler steps with the Flow-GRPO SDE (a = 0.7) on a random
60% of them per update, LoRA rank 32 on every attention projection, bf16 compute.
Variants (comma-separated, e.g. `:full,disagg`):
  schnell  FLUX.1-schnell: no guidance embedding, 4 steps, static shift 1 as its scheduler
  dance    DanceGRPO-style: its SDE (eta 0.3), 720x720, 16 steps, 12 samples per prompt,
           static shift 3, full fine-tuning at lr 1e-5
  full     full fine-tuning instead of LoRA
  disagg   rollout and trainer on separate meshes (README "Disaggregated runs")
  tiny     the architecture at toy size (double- and single-stream blocks, guidance embedding),
           random init, pixel space, word encoder: seconds on a CPU
  tiny_pipeline  the whole real path at toy size: a random diffusers FLUX.1 folder (transformer
           with guidance embedding, AutoencoderKL, CLIP + T5 encoders and tokenizers, scheduler;
           digen_jax/experiment/tiny_pipeline.py) built under config.model.checkpoint if absent and its
           prompts encoded into config.text.cache (child processes: torch never runs in
           training), then T5 + pooled CLIP embeddings -> FLUX sampling with distilled guidance
           -> VAE decode -> JPEG + ShapesBench rewards -> GRPO (LoRA; add `full` for all weights)
  ocr      the text-rendering task (prompts `a sign that says "OPEN 24 HOURS"`, held-out
           texts for eval) with the offline OCR reward in reward workers; with
           tiny_pipeline (`:tiny_pipeline,ocr`) the same at toy size on a CPU
"""

from digen_jax.experiment import config as configlib
from digen_jax.experiment import pipeline_recipes

VARIANTS = ('schnell', 'dance', 'full', 'disagg', 'tiny', 'tiny_pipeline', 'ocr')


def get_config(arg: str | None = None):
  variants = [v for v in (arg or '').split(',') if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f'configs/flux.py: unknown variant(s) {unknown}; known: {VARIANTS}')
  c = configlib.base_config()
  # The real architecture: black-forest-labs/FLUX.1-dev transformer/config.json.
  c.model.family = 'flux'
  c.model.patch_size = 2  # the pipeline's 2x2 latent packing (the transformer's own is 1)
  c.model.in_channels = 64
  c.model.out_channels = 16
  c.model.num_layers = 19
  c.model.num_single_layers = 38
  c.model.attention_head_dim = 128
  c.model.num_attention_heads = 24
  c.model.joint_attention_dim = 4096  # T5-XXL
  c.model.pooled_projection_dim = 768  # CLIP-L
  c.model.guidance_embeds = True
  c.model.axes_dims_rope = (16, 56, 56)
  pipeline_recipes.pipeline_grpo(c)  # 512x512 images, bf16, LoRA-sized lr (pipeline_recipes)
  c.latent.image_height = c.latent.image_width = 512  # pixels: latent 64 through the 8x VAE
  c.text.encoder = 't5-clip'
  c.text.max_length = 512  # FluxPipeline's max_sequence_length for -dev
  c.sampler.scheduler = 'flux'
  c.sampler.shift = 0.0  # dynamic shift from the image token count (FluxPipeline)
  c.sampler.num_steps = 16
  c.sampler.guidance_scale = 0.0  # no CFG: FLUX.1 is guidance-distilled
  c.sampler.distilled_guidance = 3.5
  c.sampler.sde = 'flow_grpo'
  c.model.lora.rank = 32
  c.model.lora.alpha = 64.0
  # FLUX's attention projections, double-stream (both streams) and single-stream blocks.
  c.model.lora.targets = (
      r'attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$'
  )

  if 'schnell' in variants:
    c.model.guidance_embeds = False
    c.text.max_length = 256  # FluxPipeline's max_sequence_length for -schnell
    c.sampler.num_steps = 4
    c.sampler.shift = 1.0  # FLUX.1-schnell's scheduler: no shifting
  if 'dance' in variants:
    c.sampler.sde = 'dance'
    c.sampler.noise_level = 0.3
    c.latent.height = c.latent.width = 90  # 720 px
    c.sampler.num_steps = 16
    c.sampler.shift = 3.0
    c.rl.group_size = 12
    c.rl.prompts_per_step = 4
  if 'full' in variants or 'dance' in variants:
    pipeline_recipes.full_finetuning(c)

  if 'tiny' in variants:
    # Same architecture at toy size, random init, pixel space (identity decoder), the word
    # encoder (its pooled vector is the mean of its tokens): runs in seconds on a CPU.
    pipeline_recipes.tiny_pixel_space(c)
    c.model.num_layers = 1
    c.model.num_single_layers = 2
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 16
    c.model.axes_dims_rope = (4, 6, 6)
    c.model.joint_attention_dim = 32
    c.model.pooled_projection_dim = 32

  if 'tiny_pipeline' in variants:
    # digen_jax/experiment/tiny_pipeline.py's FLUX toy sizes (FLUX_TRANSFORMER, FLUX_VAE).
    pipeline_recipes.tiny_pipeline(c, 'digen_tiny_flux', full='full' in variants)
    c.model.num_layers = 1
    c.model.num_single_layers = 2
    c.model.joint_attention_dim = 48
    c.model.pooled_projection_dim = 32
    c.latent.image_height = c.latent.image_width = 32  # pixels (the toy VAE compresses 2x)
    c.latent.height = c.latent.width = 16
    c.text.max_length = 32  # the T5 sequence length (FLUX attends to the pads)
    c.rl.behaviour_logprobs = 'rollout'

  if 'ocr' in variants:
    pipeline_recipes.ocr_task(c)
    if 'tiny_pipeline' in variants:
      c.reward.workers = 2
      c.reward.batch_size = 4
      c.text.max_length = 64  # the scenes' prompts are longer than ShapesBench's

  if 'disagg' in variants:
    pipeline_recipes.disagg(c)
  return c
