"""A run as the programs, roles, evaluator and simulator see it: typed, frozen, config-free.

experiment/build.py is the one reader of the config dict. It parses the config once into the
specs below (`specs_of`) and builds the run's parts (weights, text encoder, prompts, reward) into
a `Run`; programs/, runtime/, rl/ and diffusion/ read only the Run's fields. The error messages
still name the config fields (`config.rl.clip_range`, ...), since that is what a user edits.

A Run built with abstract=True is the same Run with every weight a ShapeDtypeStruct and no text
encoder, prompts or reward (the simulator lowers programs from it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from digen_jax.diffusion import sde as sde_lib
from digen_jax.experiment import fragments
from digen_jax.experiment import weights as weights_lib
from digen_jax.models import family as family_lib
from digen_jax.rewards import registry as reward_registry
from digen_jax.rl import nft as nft_lib
from digen_jax.rl import timesteps as timesteps_lib


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """config.model / config.text as the programs read them. checkpoint: the resolved folder
  ('' for a random init)."""

  family: str
  checkpoint: str
  init: str
  compute_dtype: str  # config.optim.compute_dtype: 'float32' | 'bfloat16'
  text_max_length: int
  joint_attention_dim: int
  pooled_projection_dim: int
  num_attention_heads: int
  num_layers: int  # stacked blocks (the simulator counts them)
  num_single_layers: int  # FLUX's single-stream blocks


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
  """config.sampler's guidance fields (the sigmas and the SDE are the Run's own fields)."""

  guidance_scale: float
  norm_rescale: bool
  distilled_guidance: float
  negative_prompt: str


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """config.rl's objective and advantage fields."""

  prompts_per_step: int
  group_size: int
  clip_range: float
  kl_beta: float
  inner_epochs: int
  step_loop: str
  behaviour_logprobs: str
  adv_std: str
  adv_eps: float
  adv_clip: float
  # The objective and the likelihood-free objectives' fields (config.rl; docs/design.md#objectives).
  algorithm: str  # 'grpo' | 'nft' | 'awm'
  rollout_sampler: str  # nft/awm: 'ode' | 'sde'
  train_noise_levels: int  # nft/awm: K levels per sample (resolved: never 0)
  nft_beta: float
  old_policy_flat: int
  old_policy_uprate: float
  old_policy_uphold: float
  awm_weighting: str
  awm_ghuber_power: float
  awm_advantage_max: float
  awm_ema_kl_beta: float
  awm_timestep_fraction: float
  awm_include_init: bool

  @property
  def old_policy_max_decay(self) -> float:
    """The largest decay the old policy's soft update reaches (0: it is the current policy)."""
    return self.old_policy_uphold if self.old_policy_uprate > 0 else 0.0

  @property
  def keeps_old_policy(self) -> bool:
    """Whether the optimizer state carries an old policy copy (rl/old_policy.py): a
    likelihood-free objective whose old policy can differ from the current params inside an
    update (a decay that is ever > 0, or several epochs over one batch)."""
    if self.algorithm == 'nft':
      return self.old_policy_max_decay > 0 or self.inner_epochs > 1
    return self.algorithm == 'awm' and self.old_policy_max_decay > 0 and self.awm_ema_kl_beta > 0

  @property
  def samples_with_old_policy(self) -> bool:
    """Whether the rollout samples with the old policy: DiffusionNFT collects data with v_old
    (NVlabs/DiffusionNFT scripts/train_nft_sd3.py); AWM with the current policy."""
    return self.algorithm == 'nft' and self.keeps_old_policy


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """config.reward's names and weights, parsed once (weights: ((name, weight), ...) in the
  order config.reward.weights gives them), and how a batch's rewards combine."""

  weights: tuple[tuple[str, float], ...]
  failed: str  # 'mask' | 'skip'
  combine: str  # 'sum' | 'advantages'

  @property
  def weight_map(self) -> dict[str, float]:
    return dict(self.weights)


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
  """How a program spreads one sample over a role's devices: `sequence`, the tokens of each
  sample split over that many devices (1 = no split; validated against heads and devices)."""

  sequence: int


@dataclasses.dataclass(frozen=True)
class RoleSpec:
  """config.cluster.<role>: devices (positions in jax.devices()) or processes, its mesh."""

  devices: tuple[int, ...]
  processes: tuple[int, ...]
  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  speed: float


@dataclasses.dataclass(frozen=True)
class PublishSpec:
  """The rollout's copy of the policy (config.cluster.rollout.param_dtype / param_sharding)."""

  param_dtype: str  # 'float32' | 'bfloat16'
  param_sharding: str  # 'replicated' | 'fsdp'


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """config.cluster and what resolving it against the devices checks (runtime/cluster.py)."""

  layout: str  # 'auto' | 'explicit'
  trainer: RoleSpec
  rollout: RoleSpec
  publish: PublishSpec
  transfer_host: str
  tsp: bool
  tsp_steps_axis: int
  sequence: int
  num_attention_heads: int

  def role(self, name: str) -> RoleSpec:
    return {'trainer': self.trainer, 'rollout': self.rollout}[name]


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
  """config.schedule: fragments, TSP, TAG/BTS, TCSS and the trace."""

  fragments: int
  fragment_unit: str
  tsp: bool
  tsp_steps_axis: int
  tag: bool
  tcss_fraction: float
  wait_for_pull: bool
  frozen_once_per_step: bool
  trace: bool


@dataclasses.dataclass(frozen=True)
class RuntimeSpec:
  """config.runtime's fields the roles read."""

  mode: str  # 'colocated' | 'disagg'
  transfer_guard: str
  max_consecutive_skips: int


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """config.eval and the prompt source it reads (config.data)."""

  every: int
  seed: int
  split: str
  num_prompts: int
  samples_per_prompt: int
  batch_size: int
  prompts: str  # config.data.prompts
  data_dir: str  # config.data.data_dir ('' resolves against the workdir)
  max_prompt_chars: int = 512  # config.data.max_prompt_chars


@dataclasses.dataclass(frozen=True)
class OutputSpec:
  """What a run writes: metrics rows, sample grids, checkpoints, and config.json (`config_json`,
  the resolved config as JSON)."""

  log_every: int
  sample_grid_every: int
  checkpoint_every: int
  keep_checkpoints: int
  config_json: str


@dataclasses.dataclass(frozen=True)
class Run:
  """See the module docstring."""

  model_config: Any  # the family's architecture config (MMDiTConfig, FluxConfig)
  weights: weights_lib.Weights  # trainable params (full or LoRA), frozen weights, decode
  text_encoder: Any  # prompts -> (emb [B, L, D], mask [B, L]); None when abstract
  prompts: Any  # PromptIterator: next_batch(), position, restore(); None when abstract
  reward_fn: Any  # rewards/scoring.Rewards; None when abstract
  sigmas: np.ndarray  # [T+1]
  sde_cfg: sde_lib.SDEConfig
  selection: timesteps_lib.TimestepSelection
  optimizer: optax.GradientTransformation
  img_shape: tuple[int, int, int]  # (frames, h_tokens, w_tokens)
  latent_shape: tuple[int, int]  # (tokens, packed channels)
  # How a logical batch is cut into fragments (config.schedule), handed to the schedule, the
  # roles and their programs.
  plan: fragments.FragmentPlan
  seed: int
  total_steps: int
  model: ModelSpec
  sampler: SamplerSpec
  rl: RLSpec
  reward: RewardSpec
  parallel: ParallelSpec
  cluster: ClusterSpec
  schedule: ScheduleSpec
  runtime: RuntimeSpec
  eval: EvalSpec
  output: OutputSpec
  # The config as the programs see it (program_key): a second build of the same config gets
  # the jitted programs the first made (programs/common.memoized).
  program_key: str

  @property
  def publish(self) -> PublishSpec:
    return self.cluster.publish

  @property
  def compute_dtype(self):
    return jnp.bfloat16 if self.model.compute_dtype == 'bfloat16' else jnp.float32

  @property
  def batch_size(self) -> int:
    return self.rl.prompts_per_step * self.rl.group_size

  @property
  def graphdef(self):
    """The MMDiT graphdef (the forward's structure)."""
    return self.weights.graphdef

  @property
  def params(self):
    """The initial trainable params (MMDiT state, or LoRA adapters): concrete, or their
    ShapeDtypeStructs when they stream from a large checkpoint (weights.init_params) or the
    Run is abstract."""
    return self.weights.params

  @property
  def family(self) -> family_lib.Family:
    return family_lib.get(self.model.family)

  def conditioning(self, prompts: list[str]) -> dict[str, np.ndarray]:
    """The forward's conditioning for `prompts` (host arrays, batch-leading): 'text' [B, L, D]
    float32, 'text_mask' [B, L] int32, and 'pooled' [B, P] float32 for families that read it."""
    emb, mask = self.text_encoder.encode(prompts)
    cond = {'text': np.asarray(emb, np.float32), 'text_mask': np.asarray(mask, np.int32)}
    if 'pooled' in self.family.cond_keys:
      cond['pooled'] = np.asarray(self.text_encoder.encode_pooled(prompts), np.float32)
    return cond

  def cond_abstract(self, batch: int, sharding_fn: Callable[[int], Any] | None = None) -> dict:
    """ShapeDtypeStructs of `conditioning` for `batch` prompts; sharding_fn(ndim) places each."""
    m = self.model
    shapes = {
        'text': ((batch, m.text_max_length, m.joint_attention_dim), jnp.float32),
        'text_mask': ((batch, m.text_max_length), jnp.int32),
        'pooled': ((batch, m.pooled_projection_dim), jnp.float32),
    }
    return {
        k: jax.ShapeDtypeStruct(
            *shapes[k], sharding=sharding_fn(len(shapes[k][0])) if sharding_fn else None
        )
        for k in self.family.cond_keys
    }


def spec_fields(run: Run) -> dict[str, Any]:
  """The Run's fields that are neither weights nor built parts (what abstract=True keeps equal)."""
  parts = ('weights', 'text_encoder', 'prompts', 'reward_fn', 'optimizer')
  return {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name not in parts}


# ------------------------------------------------------------------------- parsing (the builder)


def reward_weights(reward) -> dict[str, float]:
  """config.reward.weights as {name: weight}: the one place it is parsed (ValueError naming the
  field)."""
  try:
    return reward_registry.parse_weights(reward.weights)
  except ValueError as e:
    raise ValueError(f'config.reward.weights: {e}') from None


# Fields that locate inputs and never reach a program (the prompt files' folder).
_NOT_IN_PROGRAMS = ('data.data_dir',)


def program_key(config) -> str:
  """The config as the programs see it: JSON, without the fields no program reads."""
  d = config.to_dict()
  for dotted in _NOT_IN_PROGRAMS:
    *path, last = dotted.split('.')
    node = d
    for k in path:
      node = node.get(k, {})
    node.pop(last, None)
  return json.dumps(d, sort_keys=True, default=repr)


def axis_names(names) -> tuple[str, ...]:
  """('data',) / ('data,fsdp',) (as a command line gives it) / ('data', 'fsdp') -> names."""
  if isinstance(names, str):
    names = (names,)
  return tuple(n.strip() for s in names for n in str(s).split(',') if n.strip())


def _role_spec(r) -> RoleSpec:
  return RoleSpec(
      devices=tuple(r.devices),
      processes=tuple(r.processes),
      mesh_shape=tuple(r.mesh_shape),
      axis_names=axis_names(r.axis_names),
      speed=float(r.speed),
  )


def cluster_spec(config) -> ClusterSpec:
  """config.cluster (and what resolving it checks: TSP's steps axis, the sequence split)."""
  cl = config.cluster
  return ClusterSpec(
      layout=cl.layout,
      trainer=_role_spec(cl.trainer),
      rollout=_role_spec(cl.rollout),
      publish=PublishSpec(cl.rollout.param_dtype, cl.rollout.param_sharding),
      transfer_host=cl.transfer_host,
      tsp=bool(config.schedule.tsp),
      tsp_steps_axis=int(config.schedule.tsp_steps_axis),
      sequence=int(config.parallel.sequence),
      num_attention_heads=int(config.model.num_attention_heads),
  )


def specs_of(config, checkpoint: str | None = None) -> dict[str, Any]:
  """Every spec field of a Run from `config` (checkpoint: the resolved model folder, default
  config.model.checkpoint as given; config.json and the program key record it resolved)."""
  if checkpoint is not None and checkpoint != config.model.checkpoint:
    config = copy.deepcopy(config)
    config.model.checkpoint = checkpoint
  s = config.sampler
  return dict(
      seed=int(config.seed),
      total_steps=int(config.total_steps),
      model=model_spec(config),
      sampler=SamplerSpec(
          guidance_scale=float(s.guidance_scale),
          norm_rescale=bool(s.norm_rescale),
          distilled_guidance=float(s.distilled_guidance),
          negative_prompt=s.negative_prompt,
      ),
      rl=rl_spec(config),
      reward=RewardSpec(
          weights=tuple(reward_weights(config.reward).items()),
          failed=config.reward.failed,
          combine=config.reward.combine,
      ),
      parallel=ParallelSpec(sequence=int(config.parallel.sequence)),
      cluster=cluster_spec(config),
      schedule=schedule_spec(config),
      runtime=RuntimeSpec(
          mode=config.runtime.mode,
          transfer_guard=config.runtime.transfer_guard,
          max_consecutive_skips=int(config.runtime.max_consecutive_skips),
      ),
      eval=eval_spec(config),
      output=output_spec(config),
      program_key=program_key(config),
  )


def model_spec(config) -> ModelSpec:
  m = config.model
  return ModelSpec(
      family=m.family,
      checkpoint=m.checkpoint,
      init=m.init,
      compute_dtype=config.optim.compute_dtype,
      text_max_length=int(config.text.max_length),
      joint_attention_dim=int(m.joint_attention_dim),
      pooled_projection_dim=int(m.pooled_projection_dim),
      num_attention_heads=int(m.num_attention_heads),
      num_layers=int(m.num_layers),
      num_single_layers=int(m.num_single_layers),
  )


def train_noise_levels(config) -> int:
  """K of a likelihood-free objective: config.rl.train_noise_levels, or for 0 the method's own:
  DiffusionNFT's int(0.99 * T) distinct levels of the T-step rollout grid
  (rl/nft.num_train_levels), AWM's 6."""
  k = int(config.rl.train_noise_levels)
  if k > 0:
    return k
  if config.rl.algorithm == 'awm':
    return AWM_LEVELS
  return nft_lib.num_train_levels(int(config.sampler.num_steps), 0.99)


AWM_LEVELS = 6  # AWM's K (config/dgx_awm.py: 6 stratified levels)


def rl_spec(config) -> RLSpec:
  r = config.rl
  return RLSpec(
      prompts_per_step=int(r.prompts_per_step),
      group_size=int(r.group_size),
      clip_range=float(r.clip_range),
      kl_beta=float(r.kl_beta),
      inner_epochs=int(r.inner_epochs),
      step_loop=r.step_loop,
      behaviour_logprobs=r.behaviour_logprobs,
      adv_std=r.adv_std,
      adv_eps=float(r.adv_eps),
      adv_clip=float(r.adv_clip),
      algorithm=r.algorithm,
      rollout_sampler=r.rollout_sampler,
      train_noise_levels=train_noise_levels(config),
      nft_beta=float(r.nft_beta),
      old_policy_flat=int(r.old_policy_flat),
      old_policy_uprate=float(r.old_policy_uprate),
      old_policy_uphold=float(r.old_policy_uphold),
      awm_weighting=r.awm_weighting,
      awm_ghuber_power=float(r.awm_ghuber_power),
      awm_advantage_max=float(r.awm_advantage_max),
      awm_ema_kl_beta=float(r.awm_ema_kl_beta),
      awm_timestep_fraction=float(r.awm_timestep_fraction),
      awm_include_init=bool(r.awm_include_init),
  )


def schedule_spec(config) -> ScheduleSpec:
  sc = config.schedule
  return ScheduleSpec(
      fragments=int(sc.fragments),
      fragment_unit=sc.fragment_unit,
      tsp=bool(sc.tsp),
      tsp_steps_axis=int(sc.tsp_steps_axis),
      tag=bool(sc.tag),
      tcss_fraction=float(sc.tcss_fraction),
      wait_for_pull=bool(sc.wait_for_pull),
      frozen_once_per_step=bool(sc.frozen_once_per_step),
      trace=bool(sc.trace),
  )


def eval_spec(config) -> EvalSpec:
  e = config.eval
  return EvalSpec(
      every=int(e.every),
      seed=int(e.seed),
      split=e.split,
      num_prompts=int(e.num_prompts),
      samples_per_prompt=int(e.samples_per_prompt),
      batch_size=int(e.batch_size),
      prompts=config.data.prompts,
      data_dir=config.data.data_dir,
      max_prompt_chars=int(config.data.max_prompt_chars),
  )


def output_spec(config) -> OutputSpec:
  return OutputSpec(
      log_every=int(config.log_every),
      sample_grid_every=int(config.sample_grid_every),
      checkpoint_every=int(config.checkpoint_every),
      keep_checkpoints=int(config.keep_checkpoints),
      config_json=config.to_json_best_effort(indent=2),
  )
