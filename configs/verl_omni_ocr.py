"""veRL-Omni's Flow-GRPO Qwen-Image OCR recipes as configs: the colocated runs the planner's
baseline is calibrated against (tests/perf/test_calibration.py, benchmarks/RESULTS.md).

    python -m digen_jax.plan --config=configs/verl_omni_ocr.py:lora --cluster=4xH800
    python -m digen_jax.plan --config=configs/verl_omni_ocr.py:full --cluster=4xH200

Variants (none: lora):
  lora    examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh: LoRA rank 64 (alpha
          128) on the attention projections and MLPs of both streams, true CFG 4.0, lr 3e-4
  full    run_qwen_image_ocr.sh: every weight, no CFG (true_cfg_scale 1.0), lr 3e-5
  full64  the same on 64 H100s with the parameters resident (their performance page: VeOmni
          and FSDP1 with param_offload=False, optimizer_offload=True), FSDP over all 64 GPUs
          as its script shards them (run_qwen_image_ocr_veomni_64cards.sh sets no fsdp_size)

Common to all (the scripts and the defaults they inherit): 32 prompts x 16 images = 512 per step,
512 x 512 px, 10 sampler steps, an SDE window of 2 steps (sde_window_size=2, within steps
[0, 5]: K = 2), two mini-batches of 16 prompts (ppo_mini_batch_size=16) in micro-batches of 16
images per GPU, the behaviour log-probs recomputed before the update (old_log_prob), weights
synced layer by layer (layered_summon=True), the generation engine asleep while it trains, and
Qwen3-VL-8B as the OCR reward on the same GPUs (synchronous).

Two figures are not in the scripts: prompt length and the reward's cost. Text: 64 tokens
(an assumption: the OCR prompts are a sentence with the text to render; the scripts cap them at
256, and 32 or 128 tokens would change a forward's FLOPs by -3 % / +6 %). Reward: veRL-Omni's
performance page measures the LoRA recipe at 420 s per step with the reward on the 4 training
GPUs and 360 s with it on a 5th GPU: 60 s of scoring per 512 images on 4 H800s, 0.469
device-seconds per image.

PUBLISHED holds each variant's published throughput (verl-project/verl-omni
docs/algo/performance.md, updated 2026-09-10).
"""

from digen_jax.experiment import config as configlib

# configs/qwenimage.py beside this file (loads outside the checkout too).
qwenimage = configlib.sibling_config(__file__, 'qwenimage')

VARIANTS = ('lora', 'full', 'full64')
SOURCE = 'verl-project/verl-omni docs/algo/performance.md (updated 2026-09-10)'
# variant: (cluster, images per GPU per second, seconds per step)
PUBLISHED = {
    'lora': ('4xH800', 0.305, 420.0),
    'full': ('4xH200', 0.510, 250.0),
    'full64': ('64xH100', 0.079, 100.0),
}
REWARD_S_PER_IMAGE = (420.0 - 360.0) * 4 / 512  # H800 device-seconds (module docstring)


def get_config(arg: str | None = None):
  variants = [v for v in (arg or 'lora').split(',') if v]
  if len(variants) != 1 or variants[0] not in VARIANTS:
    raise ValueError(
        f'configs/verl_omni_ocr.py takes one variant of {VARIANTS}, e.g. '
        '--config=configs/verl_omni_ocr.py:full'
    )
  variant = variants[0]
  c = qwenimage.get_config('' if variant == 'lora' else 'full')
  c.rl.prompts_per_step = 32
  c.rl.group_size = 16
  c.rl.timesteps = 'fixed_window'
  c.rl.window_start = 0
  c.rl.window_size = 2
  c.sampler.num_steps = 10
  c.sampler.noise_level = 1.2
  c.text.max_length = 64
  c.reward.device_s_per_sample = REWARD_S_PER_IMAGE
  c.reward.cost_accelerator = 'H800'
  c.reward.cost_source = (
      f'{SOURCE}: Qwen3-VL-8B OCR reward, 420 s/step on the 4 training H800s vs 360 s on a '
      '5th GPU, 512 images'
  )
  c.baseline.engine = 'torch'
  c.baseline.mini_batches = 2
  c.baseline.micro_batch = 16
  if variant == 'lora':
    c.sampler.guidance_scale = 4.0
    c.model.lora.rank = 64
    c.model.lora.alpha = 128.0
    c.model.lora.targets = (
        r'(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)'
        r'|(img|txt)_mlp\.net\.(0\.proj|2))$'
    )
    c.optim.lr = 3e-4
  else:
    c.sampler.guidance_scale = 1.0  # true_cfg_scale 1.0: no CFG
    c.optim.lr = 3e-5
  c.baseline.param_offload = variant != 'full64'
  c.baseline.optimizer_offload = True
  if variant == 'full64':
    # examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_veomni_64cards.sh (verl-omni at
    # a1139baf) sets no fsdp_size and no reshard_after_forward: one FSDP group over all 64
    # GPUs, across the 8 nodes, resharding after the forward (the multi-node guide's
    # within-node sharding is not what this published run used).
    c.baseline.fsdp_size = 64
    c.baseline.reshard_after_forward = 'yes'
  return c
