"""Wan2.1 text-to-video (14B; 1.3B with `:1.3b`) GRPO from a diffusers pipeline folder, and toy
variants for a CPU.

Real weights (README "Video: Wan2.1"): encode the prompts once (umT5, in its own PyTorch
process), then train (LoRA by default):
  python -m digen_jax.encode_prompts --config=configs/wan21.py \
      --config.model.checkpoint=/path/Wan2.1-T2V-14B-Diffusers --prompts=prompts.txt \
      --out=/path/cache
  python -m digen_jax.main --config=configs/wan21.py --workdir=/tmp/run \
      --config.model.checkpoint=/path/Wan2.1-T2V-14B-Diffusers --config.text.cache=/path/cache \
      --config.data.prompts=prompts.txt

Defaults: Wan2.1-T2V-14B, 81 frames at 832x480 (latent 21 x 60 x 104 x 16, packed 1x2x2 into
32,760 tokens of 64 channels), 20 sampler steps on Wan's flow sigmas with flow shift 3, true CFG
5.0 against the empty negative prompt, the Flow-GRPO SDE (a = 0.7) on a random 60% of the steps
per update, 8 videos for each of 4 prompts, LoRA rank 32 on both attentions of every block, bf16
compute. Each value's source is beside it. Rewards see uint8 videos [B, 81, 480, 832, 3]: the
image rewards score every frame and average, 'temporal_consistency' scores the video
(rewards/registry.py).
Variants (comma-separated, e.g. `:1.3b,disagg`):
  1.3b     Wan2.1-T2V-1.3B (30 blocks of 12 heads, ffn 8960), same clip and recipe
  720p     1280x720 (latent 90 x 160: 75,600 tokens), flow shift 5 (the 14B's other resolution)
  full     full fine-tuning instead of LoRA
  disagg   rollout and trainer on separate meshes (README "Disaggregated runs")
  tiny     the architecture at toy size, random init, pixel-space videos (3 frames of 16x16),
           word encoder: seconds on a CPU
  tiny_pipeline  the whole real path at toy size: a random diffusers Wan2.1 folder
           (WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, tokenizer, UniPC flow
           scheduler; digen_jax/experiment/tiny_pipeline.py) built under config.model.checkpoint
           if absent and its prompts encoded into config.text.cache (child processes: torch
           never runs in training), then umT5 embeddings -> Wan sampling with true CFG -> causal
           VAE decode of 5-frame videos -> JPEG + ShapesBench (per frame) + temporal-consistency
           rewards -> GRPO (LoRA; add `full` for all weights)
"""

from digen_jax.experiment import config as configlib
from digen_jax.experiment import pipeline_recipes

VARIANTS = ('1.3b', '720p', 'full', 'disagg', 'tiny', 'tiny_pipeline')

# LoRA on both attentions of every block (models/io/wan_convert.py ATTENTION_TARGETS): what
# Flow-GRPO's scripts/train_wan2_1.py adapts (to_q, to_k, to_v, to_out.0 of attn1 and attn2).
ATTENTION_TARGETS = r'attn[12]\.(to_q|to_k|to_v|to_out\.0)$'


def get_config(arg: str | None = None):
  variants = [v for v in (arg or '').split(',') if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f'configs/wan21.py: unknown variant(s) {unknown}; known: {VARIANTS}')
  c = configlib.base_config()
  # The real architecture: Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (the Wan2.1
  # repo's wan/configs/wan_t2v_14B.py: dim 5120 = 40 heads x 128, ffn_dim 13824, 40 layers,
  # patch 1x2x2; shared_config.py: umT5-XXL text of 4096 channels, text_len 512).
  c.model.family = 'wan'
  c.model.patch_size = 2
  c.model.in_channels = 64  # 16 VAE channels x 2 x 2 (packed as every family packs)
  c.model.out_channels = 16
  c.model.num_layers = 40
  c.model.num_attention_heads = 40
  c.model.attention_head_dim = 128
  c.model.joint_attention_dim = 4096
  c.model.ffn_dim = 13824
  c.model.cross_attn_norm = True
  c.model.axes_dims_rope = (44, 42, 42)  # Wan's RoPE split of the head dim (not read: derived)
  pipeline_recipes.pipeline_grpo(c)  # bf16, remat, trainer log-probs (pipeline_recipes)
  # 81 frames at 832x480: the Wan2.1 README's T2V 480p clip and diffusers' WanPipeline defaults
  # (height 480, width 832, num_frames 81). The VAE: 8x spatial, 4x temporal compression.
  c.latent.frames = 21  # 1 + (81 - 1) / 4
  c.latent.height, c.latent.width = 60, 104
  c.latent.vae_batch_chunk = 1  # decode one video at a time (its frames in causal chunks)
  c.text.encoder = 'umt5'
  c.text.max_length = 512  # WanPipeline's max_sequence_length (zero-padded umT5 rows)
  c.sampler.scheduler = 'wan'  # the pipeline's UniPC flow sigmas, stepped by our Euler/SDE
  c.sampler.shift = 3.0  # WanPipeline's flow_shift for 480p (diffusers docs; 5.0 for 720p)
  # Flow-GRPO's Wan2.1 recipe (config/grpo.py general_ocr_wan2_1): 20 training sampler steps.
  c.sampler.num_steps = 20
  # True CFG: WanPipeline's default guidance_scale 5.0 (the Wan2.1 repo's sample_guide_scale),
  # plain uncond + g (cond - uncond), negative prompt '' (WanPipeline's default None is '').
  c.sampler.guidance_scale = 5.0
  c.sampler.norm_rescale = False
  c.sampler.negative_prompt = ''
  # DanceGRPO-style group sizes for Wan (its and Pref-GRPO's finetune scripts: 8 generations per
  # prompt, timestep_fraction 0.6, clip_range 1e-4, adv_clip_max 5): 8 videos x 4 prompts.
  c.rl.group_size = 8
  c.rl.prompts_per_step = 4
  c.rl.timestep_fraction = 0.6
  c.rl.clip_range = 1e-4
  c.rl.adv_clip = 5.0
  # LoRA as Flow-GRPO trains Wan2.1 (scripts/train_wan2_1.py: r=32, lora_alpha=64; lr 1e-4 in
  # general_ocr_wan2_1).
  c.model.lora.rank = 32
  c.model.lora.alpha = 64.0
  c.model.lora.targets = ATTENTION_TARGETS
  c.optim.lr = 1e-4
  c.reward.weights = 'jpeg_compressibility:1,temporal_consistency:1'

  if '1.3b' in variants:
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers (wan/configs/wan_t2v_1_3B.py: dim 1536 = 12 x 128, ffn
    # 8960, 30 layers): the model Flow-GRPO and DanceGRPO post-train.
    c.model.num_layers = 30
    c.model.num_attention_heads = 12
    c.model.ffn_dim = 8960
  if '720p' in variants:
    # The 14B's 720p clip (Wan2.1 README: 1280x720), flow shift 5 (diffusers' WanPipeline docs).
    c.latent.height, c.latent.width = 90, 160
    c.sampler.shift = 5.0
  if 'full' in variants:
    pipeline_recipes.full_finetuning(c)

  if 'tiny' in variants:
    # Same architecture at toy size, random init, pixel-space videos (identity decoder), the
    # word encoder: seconds on a CPU.
    pipeline_recipes.tiny_pixel_space(c)
    c.latent.frames = 3
    c.model.num_layers = 2
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 16
    c.model.joint_attention_dim = 32
    c.model.ffn_dim = 32
    c.sampler.guidance_scale = 0.0
    c.reward.weights = 'shapes:1,temporal_consistency:0.5'

  if 'tiny_pipeline' in variants:
    # digen_jax/experiment/tiny_pipeline.py's Wan toy sizes (WAN_TRANSFORMER, WAN_VAE).
    pipeline_recipes.tiny_pipeline(c, 'digen_tiny_wan', full='full' in variants)
    c.model.num_layers = 2
    c.model.joint_attention_dim = 32
    c.model.ffn_dim = 64
    c.latent.frames = 2  # 5 video frames
    c.latent.height = c.latent.width = 4  # 32x32 frames (the toy VAE compresses 8x)
    c.latent.vae_batch_chunk = 2
    c.text.max_length = 32  # the umT5 rows the cache pads to (its max_sequence_length)
    c.rl.behaviour_logprobs = 'rollout'
    c.reward.weights = 'jpeg_compressibility:1,shapes:1,temporal_consistency:1'

  if 'disagg' in variants:
    pipeline_recipes.disagg(c)
  return c
