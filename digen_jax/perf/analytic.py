"""Cost models from architecture sizes: ANALYTIC, not compiled. The planner treats them like
XLA-costed runs (perf/runmodel.RunModel), with every figure from the formulas below.

Two sources: `run_model_of(config)`, any config whose family has model code here (Qwen-Image,
FLUX, Wan2.1: its FLOPs are the family's flops_per_forward as program_costs.analytic_flops counts
a program: forwards x steps x CFG rows, the backward, the remat recompute; its weights' bytes as
the compiled programs hold them, from the abstract weights); and `run_model(VideoDiT)`, a video
DiT without model code here (HunyuanVideo) from its published sizes alone:

  FLOPs    matmuls only (2 per multiply-add), as models/transformers/mmdit.py and models/transformers/flux.py count
           them. HunyuanVideo's transformer is FLUX's block structure (dual-stream MMDiT blocks,
           then single-stream blocks, MLP ratio 4, guidance embedding) at other depths, so
           flux.flops_per_forward counts it. Backward = 2 forwards, remat = 1 more forward
           (full fine-tuning). The VAE decode and the text encoders are left out (a few % of a
           video rollout).
  bytes    per forward: the bf16 weights once, and 24 bytes per token per hidden unit per
           block of activation traffic (bf16, flash attention: no S x S logits).
  memory   grad, per sample-step per device: with remat the blocks' bf16 inputs (2 bytes x L)
           plus one block's activations for its backward, 34 bytes per token per hidden unit
           (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
           Models", eq. 1 without the 5as/h attention-score term that flash attention removes);
           without remat 34 x L. Rollout: one block's activations, 24 bytes per token per
           hidden unit, per sample.
  weights  full fine-tuning: float32 master weights, gradient accumulator and Adam moments
           (16 bytes per parameter, FSDP), a bfloat16 rollout copy (published in bf16: the
           ':disagg' variants' cluster.rollout.param_dtype for bf16 compute).

Token counts: a video of F frames at H x W pixels is (1 + (F - 1) / 4) x H / 8 x W / 8 latent
positions (the causal 3D VAEs' 4x temporal, 8x spatial compression), patchified 1 x 2 x 2.
"""

from __future__ import annotations

import dataclasses

from digen_jax.models.transformers import flux
from digen_jax import programs
from digen_jax.perf import abstract
from digen_jax.perf import program_costs
from digen_jax.perf import program_flops
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm

ANALYTIC_DEVICES = 16  # the nominal compile the per-device figures are stated for


@dataclasses.dataclass(frozen=True)
class VideoDiT:
  """A FLUX-like video DiT's published sizes (dual-stream, then single-stream blocks) and the
  clip users post-train it on."""

  name: str
  hidden: int
  heads: int
  double_layers: int  # dual-stream blocks
  single_layers: int  # single-stream blocks
  text_tokens: int
  text_dim: int  # the text encoder's hidden size
  pooled_dim: int  # pooled text embedding (hunyuan: CLIP-L 768)
  guidance_embeds: bool  # CFG-distilled (one row per sample) vs true CFG (two)
  frames: int
  height: int
  width: int
  cfg: bool  # true CFG at rollout and training (2 rows per sample)
  source: str

  @property
  def latent_channels(self) -> int:
    return 16 * 2 * 2  # 16 VAE channels, 1 x 2 x 2 patches

  @property
  def tokens(self) -> int:
    t = 1 + (self.frames - 1) // 4
    return t * (self.height // 16) * (self.width // 16)

  @property
  def layers(self) -> int:
    return self.double_layers + self.single_layers

  def flux_config(self) -> flux.FluxConfig:
    return flux.FluxConfig(
        patch_size=1,
        in_channels=self.latent_channels,
        out_channels=16,
        num_layers=self.double_layers,
        num_single_layers=self.single_layers,
        attention_head_dim=self.hidden // self.heads,
        num_attention_heads=self.heads,
        joint_attention_dim=self.text_dim,
        pooled_projection_dim=self.pooled_dim,
        guidance_embeds=self.guidance_embeds,
        axes_dims_rope=(16, 56, 56),
    )

  def params(self) -> int:
    return flux.count_params(self.flux_config())

  def flops_per_forward(self, rows: int) -> float:
    """Matmul FLOPs of one forward on `rows` samples."""
    return flux.flops_per_forward(self.flux_config(), rows, self.tokens, self.text_tokens)


# Published sizes: github.com/Tencent/HunyuanVideo hyvideo/modules/models.py
# HUNYUAN_VIDEO_CONFIG['HYVideo-T/2-cfgdistill'] (mm_double_blocks_depth 20,
# mm_single_blocks_depth 40, hidden 3072, 24 heads, mlp ratio 4, guidance embedding), text
# 256 LLaVA-Llama-3-8B tokens (hidden 4096) + CLIP-L pooled 768; 544p x 129 frames is one of
# the two resolutions its README lists. (Wan2.1 has model code: configs/wan21.py, costed from
# its compiled programs or by run_model_of.)
HUNYUAN_VIDEO = VideoDiT(
    'HunyuanVideo-13B (analytic)',
    hidden=3072,
    heads=24,
    double_layers=20,
    single_layers=40,
    text_tokens=256,
    text_dim=4096,
    pooled_dim=768,
    guidance_embeds=True,
    frames=129,
    height=544,
    width=960,
    cfg=False,
    source='Tencent/HunyuanVideo hyvideo/modules/models.py HYVideo-T/2-cfgdistill; README '
    '544p x 129 frames',
)


def _programs(n0, fwd, steps, weights, act, rows_tokens_hidden, layers, grad_flops):
  """(rollout, {remat: grad}) ProgramModels per unit (a sample; a sample-step) on n0 devices:
  FLOPs as given, bytes the weights once and `act` of activation traffic per forward, temp
  memory from the per-token estimates of the module docstring."""

  def prog(name, per_unit_flops, per_unit_bytes, temp_per_unit):
    return roles.ProgramModel(
        name,
        n0=n0,
        batch0=n0,
        units0=1.0,
        flops0=per_unit_flops,
        bytes0=per_unit_bytes,
        per_unit=per_unit_flops,
        temp_per_unit=temp_per_unit,
        temp_fit='analytic',
    )

  rollout = prog('rollout', steps * fwd, steps * (weights + act), 24.0 * rows_tokens_hidden)
  grads = {}
  for remat, flops in grad_flops.items():
    passes = flops / fwd
    per_token = (2 * layers + 34) if remat else 34 * layers
    grads[remat] = prog('grad', flops, passes * (weights + act), per_token * rows_tokens_hidden)
  return rollout, grads


def _apply(n0, params):
  """The optimizer step on the FSDP shards: Adam's ~12 FLOPs and 28 bytes per parameter."""
  return roles.ProgramModel(
      'apply',
      n0=n0,
      batch0=1,
      units0=1.0,
      flops0=12.0 * params / n0,
      bytes0=28.0 * params / n0,
      per_unit=0.0,
      sharded_flops=12.0 * params / n0,
      temp_const=4.0 * params / n0,
      temp_fit='analytic',
  )


def run_model(
    m: VideoDiT,
    *,
    prompts: int = 4,
    group_size: int = 8,
    steps: int = 16,
    trained_fraction: float = 0.6,
) -> rm.RunModel:
  """An analytic RunModel of full fine-tuning of `m`: T = `steps` SDE sampler steps, K = the
  `trained_fraction` of the T - 1 stochastic ones (Flow-GRPO / DanceGRPO's 0.6), bf16."""
  rows = 2 if m.cfg else 1
  P = m.params()
  K = max(1, int((steps - 1) * trained_fraction))
  fwd = m.flops_per_forward(rows)  # one sample, all its rows
  act = 24.0 * rows * m.tokens * m.hidden * m.layers  # activation bytes of one forward
  rollout, grads = _programs(
      ANALYTIC_DEVICES,
      fwd,
      steps,
      2.0 * P,
      act,
      rows * m.tokens * m.hidden,
      m.layers,
      {True: 4 * fwd, False: 3 * fwd},
  )
  return rm.RunModel(
      name=m.name,
      source='analytic',
      prompts=prompts,
      group_size=group_size,
      T=steps,
      K=K,
      image_tokens=m.tokens,
      latent_channels=m.latent_channels,
      layers=m.layers,
      trainable_bytes=4 * P,
      optimizer_state_bytes=8 * P,
      frozen_base_bytes=0,
      published_bytes=2 * P,
      rollout_param_bytes=2 * P,
      gathered_bytes=2 * P,
      rollout=rollout,
      grads=grads,
      apply=_apply(ANALYTIC_DEVICES, P),
      finetune='full',
      notes=[
          f'analytic costs from published sizes ({m.source}): {P / 1e9:.2f}B params, '
          f'{m.tokens} video tokens ({m.frames} frames at {m.width}x{m.height}) + '
          f'{m.text_tokens} text tokens, {rows} row(s) per sample; no VAE decode counted'
      ],
  )


def run_model_of(config, name: str) -> rm.RunModel:
  """An analytic RunModel of `config` (any family with model code): per sample the rollout's
  T forwards of its CFG rows, per sample-step the gradient's forward, backward (LoRA: the
  data gradients and the adapted kernels' weight gradients) and remat recompute, as
  program_costs.analytic_flops counts the compiled programs; the weights' bytes as the programs
  hold them. Nothing is compiled; the VAE decode is left out."""
  exp, _ = abstract.abstract_run(config)
  rows = program_flops.cfg_branches(exp)
  fwd = program_flops.forward_flops(exp, rows)  # the rollout's, per sample-step
  train_rows = program_flops.train_branches(exp)
  train_fwd = program_flops.forward_flops(exp, train_rows)
  attn = program_flops.attention_flops(exp, train_rows)
  if exp.weights.lora is None:
    backward = 2 * train_fwd
  else:
    backward = (train_fwd - attn) + 2 * attn + program_flops.lora_weight_grad_flops(exp, train_rows)
  extra = program_flops.extra_forwards(exp) * train_fwd
  m = config.model
  layers = int(m.num_layers) + (int(m.num_single_layers) if m.family == 'flux' else 0)
  tokens = exp.latent_shape[0] + int(config.text.max_length)
  hidden = exp.model_config.inner_dim
  sizes = program_costs.weight_bytes(exp)
  weights = sizes['gathered_bytes']
  rollout, grads = _programs(
      ANALYTIC_DEVICES,
      fwd,
      len(exp.sigmas) - 1,
      weights,
      24.0 * rows * tokens * hidden * layers,
      rows * tokens * hidden,
      layers,
      {bool(m.remat): train_fwd + backward + extra + (train_fwd if m.remat else 0.0)},
  )
  rollout.fixed_flops = program_flops.lora_merge_flops(exp)
  params = exp.family.count_params(exp.model_config)
  trainable = sizes['trainable_bytes'] // 4
  lora = exp.weights.lora is not None
  return rm.RunModel(
      name=name,
      source='analytic',
      prompts=int(config.rl.prompts_per_step),
      group_size=int(config.rl.group_size),
      T=len(exp.sigmas) - 1,
      K=programs.trained_levels(exp),
      clean_samples=programs.likelihood_free(exp),
      image_tokens=exp.latent_shape[0],
      latent_channels=int(m.in_channels),
      layers=layers,
      rollout=rollout,
      grads=grads,
      apply=_apply(ANALYTIC_DEVICES, trainable),
      ref_bytes=sizes['trainable_bytes'] if config.rl.kl_beta > 0 and not lora else 0,
      finetune='lora' if lora else 'full',
      tcss_fraction=float(config.schedule.tcss_fraction),
      notes=[
          f"analytic costs of {name} (the family's matmul FLOPs, no VAE decode): "
          f'{params / 1e9:.2f}B params, {exp.latent_shape[0]} image + {config.text.max_length} '
          f'text tokens, {rows} row(s) per sample'
      ],
      lora_weight_grad_flops=program_flops.lora_weight_grad_flops(exp, rows),
      **sizes,
      **rm.reward_terms(config),
  )
