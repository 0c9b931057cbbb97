"""Qwen-Image (20B MMDiT) GRPO, and `:tiny`, the same architecture at toy size that runs on a CPU.

  python -m digen_jax.main --config=configs/qwenimage.py --config.model.checkpoint=/path/Qwen-Image
  python -m digen_jax.main --config=configs/qwenimage.py:tiny --workdir=/tmp/x

Disaggregated (rollout and trainer on separate meshes; README "Disaggregated runs"):
  python launch/local.py --num_processes=2 -- \
      python -m digen_jax.main --config=configs/qwenimage.py:tiny_disagg --workdir=/tmp/x
  :disagg is the real model the same way (bf16 rollout copy: the compute dtype is bf16 anyway).
"""
from digen_jax import configlib


def get_config(arg: str | None = None):
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
  # 1328x1328 images, VAE with 8x spatial compression and 16 channels.
  c.latent.space = 'vae'
  c.latent.channels = 16
  c.latent.height = c.latent.width = 166
  c.text.encoder = 'qwen2.5-vl'
  c.text.max_length = 1024
  c.sampler.scheduler = 'qwenimage'
  c.sampler.num_steps = 10          # Flow-GRPO-style training rollouts (inference uses 50)
  c.sampler.guidance_scale = 4.0    # QwenImage pipeline default true_cfg_scale
  c.optim.compute_dtype = 'bfloat16'
  c.rl.group_size = 16
  c.rl.prompts_per_step = 8

  if arg in ('tiny', 'tiny_disagg'):
    # Same architecture, random init, pixel space (identity decoder): runs in seconds on a CPU.
    c.model.init = 'random'
    c.model.num_layers = 2
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 32
    c.model.axes_dims_rope = (8, 12, 12)
    c.model.joint_attention_dim = 32
    c.latent.space = 'pixel'
    c.latent.channels = 3
    c.model.in_channels = 12
    c.model.out_channels = 3
    c.latent.height = c.latent.width = 16
    c.text.encoder = 'word'
    c.text.max_length = 16
    c.sampler.num_steps = 6
    c.sampler.guidance_scale = 0.0
    c.sampler.shift = 3.0
    c.optim.compute_dtype = 'float32'
    c.rl.group_size = 4
    c.rl.prompts_per_step = 2
    c.total_steps = 3
  elif arg not in (None, '', 'disagg'):
    raise ValueError(f'configs/qwenimage.py: unknown variant {arg!r}; known: tiny, tiny_disagg, '
                     'disagg')
  if arg in ('disagg', 'tiny_disagg'):
    # 'auto' layout: 2 processes -> process 0 trains, process 1 rolls out; 1 process -> half
    # of its devices each. A bf16 compute dtype casts the weights inside the programs anyway,
    # so a bf16 rollout copy changes nothing but halves every publish.
    configlib.set_disagg(c, rollout_param_dtype=(
        'bfloat16' if c.optim.compute_dtype == 'bfloat16' else 'float32'))
  return c
