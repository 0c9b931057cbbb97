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
  ocr             the text-rendering task (prompts `a sign that says "OPEN 24 HOURS"`, held-out
                  texts for eval) with the offline OCR reward in reward workers; with
                  tiny_pipeline (`:tiny_pipeline,ocr`) the same at toy size on a CPU
"""

from digen_jax.experiment import config as configlib
from digen_jax.experiment import pipeline_recipes

VARIANTS = ('full', 'disagg', 'tiny', 'tiny_disagg', 'tiny_pipeline', 'ocr')


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
  # 512x512 training images as Flow-GRPO trains (the model's native 1328x1328 is latent 166), bf16,
  # LoRA-sized lr (pipeline_recipes).
  pipeline_recipes.pipeline_grpo(c)
  c.latent.image_height = c.latent.image_width = 512  # pixels: latent 64 through the 8x VAE
  c.text.encoder = 'qwen2.5-vl'
  # Prompt tokens after the template is dropped (diffusers caps at 512); RL prompt sets are
  # short, and every text token costs attention. A longer prompt is a clear error at start.
  c.text.max_length = 128
  c.sampler.scheduler = 'qwenimage'
  c.sampler.num_steps = 10  # Flow-GRPO-style training rollouts (inference uses 50)
  c.sampler.guidance_scale = 4.0  # QwenImage pipeline true_cfg_scale, negative prompt ' '
  # LoRA on every attention projection of both streams (what most users train).
  c.model.lora.rank = 64
  c.model.lora.alpha = 128.0

  if 'full' in variants:
    pipeline_recipes.full_finetuning(c)

  if 'tiny' in variants or 'tiny_disagg' in variants:
    # Same architecture at toy size, random init, pixel space (identity decoder): seconds on a CPU.
    pipeline_recipes.tiny_pixel_space(c)
    c.model.num_layers = 2
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 32
    c.model.axes_dims_rope = (8, 12, 12)
    c.model.joint_attention_dim = 32
    c.sampler.guidance_scale = 0.0

  if 'tiny_pipeline' in variants:
    # digen_jax/experiment/tiny_pipeline.py's toy sizes (a random diffusers Qwen-Image folder).
    pipeline_recipes.tiny_pipeline(c, 'digen_tiny_qwenimage', full='full' in variants)
    c.model.num_layers = 2
    c.model.joint_attention_dim = 32
    c.latent.image_height = c.latent.image_width = 64  # pixels (latent 8 through the 8x VAE)
    c.latent.height = c.latent.width = 8
    c.sampler.guidance_scale = 4.0

  if 'ocr' in variants:
    pipeline_recipes.ocr_task(c)
    if 'tiny_pipeline' in variants:
      c.reward.workers = 2
      c.reward.batch_size = 4
      c.text.max_length = 64  # the scenes' prompts are longer than ShapesBench's

  if 'disagg' in variants or 'tiny_disagg' in variants:
    pipeline_recipes.disagg(c)
  return c
