"""A run's cost model: its programs (perf/roles.py's ProgramModel), byte counts and batch shape,
and the ways each role can run its work (seconds per work item, bytes per device, fits or not).

Built from cached `Costs` (perf/cache.py: XLA's figures of the real programs) or from published
architecture sizes (perf/analytic.py). Work items are what the schedule hands out: the rollout of
b samples, the gradient of b samples (GAP fragment, or the whole batch at M = 1), the optimizer
apply, the weight publish or the colocated switch. Each role tries the ways it can run an item
and keeps the fastest that fits in its devices' memory (x `memory_fraction`):

  rollout   layout 'replicated' (the config default: a whole copy per device) or 'fsdp' (the
            copy sharded, one all-gather of the weights per sampler step); the samples of a
            device in chunks (calls one after another: same FLOPs, smaller activations)
  grad      remat on / off (where the cache holds both), the K trained steps as one vmap (one
            FSDP all-gather per call; rl.step_loop 'vmap', the default on several devices) or
            a scan (rl.step_loop 'scan': one step's activations, 2 gathers per step), and
            chunks of a device's samples (gradient accumulation over calls). TSP lays K steps
            x b samples over a (t, b) grid of the trainer mesh (parallel/tsp_grid.py): per
            device ceil(K / t) x ceil(b / (n / t)) sample-steps, 2 gathers per call
  colocated the trainer's FSDP state plus the rollout copy while it samples (the copy is
            rebuilt from the shards each step: the switch), optionally the optimizer state
            offloaded to host memory during the rollout

A sequence split q (config.parallel.sequence, one for both roles: the planner tries them) lays
each sample's tokens over q devices: a device computes 1/q of each sample of its row of q
devices (split 1's FLOPs over q), pays the Ulysses all-to-alls of every attention layer over
the split's link (forward, backward and remat's second forward), and holds the temp memory XLA
reports for the programs compiled at that split (SplitMemory: the memory is not split 1's over
q; one video's vmapped gradient is 1,259 GB a device unsplit, 134 GB at q = 8). The rollout
lays rows out in multiples of the devices at any split. A scan over the K steps keeps residuals
of every step under grad (rl/objective.py): its memory is XLA's of the scan compiled (cached
beside the vmap's memory points), else modelled from the vmap's: without remat all K steps'
activations, with remat one step's, which leaves out the residuals (Wan2.1-14B at split 8: 47.0
GB modelled that way, 59.4 compiled).

A batch that does not divide a role's device count is padded (ceil): the plan marks it, since
the runtime needs it divisible.
"""

from __future__ import annotations

import dataclasses
import math

from digen_jax.experiment import run as run_lib
from digen_jax.parallel import tsp_grid
from digen_jax.rewards import scoring as reward_scoring
from digen_jax.perf import calibrations
from digen_jax.perf import hardware
from digen_jax.perf import roles
from digen_jax.perf import timing


@dataclasses.dataclass
class RunModel:
  """Everything the planner needs to know about a run, independent of the cluster."""

  name: str
  source: str  # 'xla' (cached Costs) | 'analytic'
  prompts: int  # rl.prompts_per_step
  group_size: int
  T: int  # sampler steps
  K: int  # trained steps per trajectory
  image_tokens: int
  latent_channels: int  # per token, as the trajectory stores latents
  layers: int  # transformer blocks (all kinds)
  trainable_bytes: int
  optimizer_state_bytes: int
  frozen_base_bytes: int
  published_bytes: int
  rollout_param_bytes: int
  gathered_bytes: int
  rollout: roles.ProgramModel
  grads: dict[bool, roles.ProgramModel]  # by remat
  apply: roles.ProgramModel
  ref_bytes: int = 0  # the KL reference (rl.kl_beta > 0), FSDP
  # The rollout hands over clean samples only (a likelihood-free objective: CleanSamples), not
  # a trajectory; K is then the noise levels trained per sample.
  clean_samples: bool = False
  finetune: str = 'lora'
  tcss_fraction: float = 0.0  # the config's (0: the plan uses 0.5, the ladder's)
  # Scoring on the accelerators (config.reward.device_s_per_sample on cost_accelerator): 0 for
  # host rewards. Paid where the samples are made (colocated: the same devices), unless
  # reward_workers score them.
  reward_device_s: float = 0.0
  reward_accelerator: str = ''
  # Reward worker devices (config.reward.workers when a reward runs in workers on accelerators):
  # a disaggregated run scores there, beside the rollout (scored_fragment); 0: where sampled.
  reward_workers: int = 0
  # Matmul FLOPs per sample-step our LoRA backward spends on the adapted kernels' full weight
  # gradients (it trains through the merged W + s A B), which a LoRA that trains A and B
  # directly (PEFT, the peers') does not (program_costs.lora_weight_grad_flops).
  lora_weight_grad_flops: float = 0.0
  # Sequence parallelism (config.parallel.sequence, models/attention/sequence_parallel.py): each sample's
  # tokens over `sequence` devices of a role, (n / sequence) samples side by side. A split's
  # FLOPs are split 1's over q; its temp memory is XLA's, of the programs compiled at that split
  # (split_memory, by split > 1). sequence_bytes: one forward of one sample's Ulysses
  # all-to-alls (q, k, v to head-split and the output back: 4 per self-attention layer, every
  # CFG row, in the compute dtype).
  # By remat, XLA's memory of the gradient with the K steps as a scan (rl.step_loop 'scan'),
  # where the cache holds it compiled; else modelled from the vmap's (grad_options).
  scans: dict[bool, roles.ProgramModel] = dataclasses.field(default_factory=dict)
  heads: int = 0  # attention heads: a split divides them (0: no split tried)
  sequence: int = 1
  split_memory: dict[int, 'SplitMemory'] = dataclasses.field(default_factory=dict)
  sequence_bytes: float = 0.0
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def batch(self) -> int:
    return self.prompts * self.group_size

  def sequence_splits(self, devices: int) -> list[int]:
    """The config.parallel.sequence values a plan on `devices` may try, smallest first: those
    dividing the model's heads (Ulysses gives each device whole heads) and the devices."""
    return [q for q in range(1, devices + 1) if devices % q == 0 and (self.heads or 1) % q == 0]

  def rollout_temp(self, units: float) -> float:
    """The rollout's temp bytes per device at `units` samples' worth a device, at the split."""
    prog = self.split_memory[self.sequence].rollout if self.sequence > 1 else self.rollout
    return prog.temp(units)

  def scan_memory(self, remat: bool) -> roles.ProgramModel | None:
    """The scan over K compiled at the split (None: modelled from the vmap's)."""
    if self.sequence == 1:
      return self.scans.get(remat)
    return self.split_memory[self.sequence].scans.get(remat)

  def grad_memory(self, remat: bool) -> roles.ProgramModel | None:
    """The grad program whose temp memory holds at the split (None: not compiled there)."""
    if self.sequence == 1:
      return self.grads.get(remat)
    return self.split_memory[self.sequence].grads.get(remat)

  def all_to_all_seconds(
      self, forwards: float, units: float, group: roles.Group, knobs: 'Knobs'
  ) -> float:
    """The Ulysses all-to-alls of `forwards` passes over `units` samples' worth of tokens on
    a device of `group` (each sends (q - 1) / q of its slice), within the split's q devices."""
    q = self.sequence
    if q == 1:
      return 0.0
    sent = forwards * self.sequence_bytes * units * (q - 1) / q
    per_node = group.per_node(knobs.devices_per_node)
    return max(sent / timing.link_bw(a, q, per_node, knobs.eff) for a in group.kinds)

  def fragment_counts(self) -> list[int]:
    """M values with one or more whole prompt groups per fragment (fragment_unit 'group')."""
    return [m for m in range(1, self.prompts + 1) if self.prompts % m == 0]

  def trajectory_bytes(self, samples: int) -> float:
    """What a fragment hands to the trainer: float32 latents [T+1, b, N, C], log-probs, stds;
    for clean samples the final latents [b, N, C] and a uint32 [b, 2] key each."""
    if self.clean_samples:
      return samples * (4.0 * self.image_tokens * self.latent_channels + 8.0)
    return samples * 4.0 * ((self.T + 1) * self.image_tokens * self.latent_channels + 2 * self.T)

  def reward_seconds(self, samples: int, group: roles.Group) -> float:
    """Scoring `samples` on `group` (spread over its devices; a kind at its peak's ratio to the
    kind the cost was stated on, the slowest kind setting the pace)."""
    if not self.reward_device_s or not samples:
      return 0.0
    ref = hardware.get(self.reward_accelerator).peak_bf16_flops
    slowest = min(a.peak_bf16_flops for a in group.kinds)
    return self.reward_device_s * math.ceil(samples / group.n) * ref / slowest

  def scored_fragment(self, sample_s: float, samples: int, group, deliver_s: float):
    """(the rollout role's seconds per fragment, the fragment's delivery seconds) of a
    disaggregated rollout on `group`: scored on the role's own devices after sampling, or with
    reward workers on theirs while the role samples the next fragment (rollout.py holds one
    fragment's scores outstanding): the role's cycle is the slower of the two, and a fragment
    reaches the trainer its scoring later."""
    if not self.reward_workers:
      return sample_s + self.reward_seconds(samples, group), deliver_s
    score = self.reward_device_s * math.ceil(samples / self.reward_workers)
    return max(sample_s, score), deliver_s + score

  def reward_on_role(self, samples: int, group) -> float:
    """What scoring `samples` costs the role's own devices (TAG's fragments): 0 with reward
    workers (they score on theirs)."""
    return 0.0 if self.reward_workers else self.reward_seconds(samples, group)

  def trainer_persistent(self, n: int) -> float:
    """FSDP bytes per device: params and gradient accumulator (f32), optimizer state, the LoRA
    base, the KL reference."""
    return (
        2 * self.trainable_bytes
        + self.optimizer_state_bytes
        + self.frozen_base_bytes
        + self.ref_bytes
    ) / n


@dataclasses.dataclass
class SplitMemory:
  """XLA's temp memory of a run's programs compiled with config.parallel.sequence > 1 (their
  units as split 1's: samples, or sample-steps, a device's share)."""

  rollout: roles.ProgramModel
  grads: dict[bool, roles.ProgramModel]  # by remat, the K steps as one vmap
  scans: dict[bool, roles.ProgramModel]  # by remat, rl.step_loop 'scan' (unit: a sample-step)
  source: str = ''


@dataclasses.dataclass(frozen=True)
class Knobs:
  """Planner settings that are not the run's: efficiencies, node size, memory headroom.

  engine: whose measured fractions of peak the programs reach (calibrations.calibration: the
  sampler's forward for the rollout, forward + backward for the gradient and the apply, the
  gradient-free forward for a baseline's behaviour pass), or
  'uniform' for eff.mfu everywhere. The calibrations count a model's matmul FLOPs, so a
  program's FLOPs are taken at their matmul share (roles.ProgramModel.matmul_share)."""

  eff: timing.Efficiency = timing.DEFAULT
  devices_per_node: int = 8
  memory_fraction: float = 0.9  # of the accelerator's memory a program may use
  sharded_decode: bool = False  # model the rollout's VAE decode sharded (not as compiled)
  hbm: bool = True  # False: compute-bound roofline (FLOPs only)
  engine: str = 'digen_jax'  # calibrations.ENGINES, or 'uniform'
  # FSDP's collectives overlapped with the layers' compute (process/xla_flags.py on GPUs: the
  # next layer's gather prefetched during this one), only the first layer's exposed; False:
  # every collective after the compute.
  overlap: bool = True

  def __post_init__(self):
    if self.engine not in calibrations.ENGINES + ('uniform',):
      raise ValueError(
          f'Knobs.engine={self.engine!r}: use one of {calibrations.ENGINES + ("uniform",)}'
      )

  def exposed(self, comm: float, compute: float, layers: int) -> float:
    """Seconds of `comm` collectives not hidden behind `compute` (a layer scan's)."""
    if not self.overlap:
      return comm
    return max(0.0, comm - compute) + comm / max(1, layers)

  def efficiency(self, acc: hardware.Accelerator, work: str) -> timing.Efficiency:
    """The fractions of `acc`'s peaks for `work` (calibrations.WORKS)."""
    if self.engine == 'uniform':
      return self.eff
    return dataclasses.replace(self.eff, mfu=calibrations.calibration(self.engine, acc).of(work))

  def seconds(
      self,
      group: roles.Group,
      prog: roles.ProgramModel,
      flops: float,
      bytes_accessed: float,
      work: str | None = None,
  ) -> float:
    """One call of `prog` with these per-device counts on `group`: its slowest kind. `work`:
    whose fraction of peak (default: sampling for the rollout, training for the rest)."""
    work = work or ('sampling' if prog.name == 'rollout' else 'training')
    return max(
        timing.roofline_seconds(
            flops * prog.matmul_share,
            bytes_accessed if self.hbm else 0.0,
            a,
            self.efficiency(a, work),
        )
        for a in group.kinds
    )


def _limit(group: roles.Group, knobs: Knobs) -> float:
  return group.memory_bytes * knobs.memory_fraction


def rollout_options(
    run: RunModel,
    group: roles.Group,
    b: int,
    knobs: Knobs,
    *,
    layouts=('replicated', 'fsdp'),
    on_trainer: bool = False,
    persistent: float = 0.0,
) -> list[roles.Option]:
  """Ways to sample b samples on `group`. on_trainer (TAG): the trainer's own FSDP params,
  gathered per sampler step, beside `persistent` bytes of trainer state."""
  n, prog, q = group.n, run.rollout, run.sequence
  if n % q:  # the split must divide the role's devices
    return []
  # With a split too the rollout lays rows out in multiples of the devices (q samples a row of
  # q devices): c samples' worth of tokens a device.
  s = math.ceil(b / n)
  out = []
  for layout in (('trainer',) if on_trainer else layouts):
    for c in roles.chunks(s):
      calls = math.ceil(s / c)
      call_batch = min(b, c * n)
      units = c
      flops = prog.flops(n, units, call_batch, sharded_decode=knobs.sharded_decode)
      sec = knobs.seconds(group, prog, flops, prog.bytes_for(flops))
      sec += run.all_to_all_seconds(run.T, units, group, knobs)
      gather = 0.0
      if layout in ('fsdp', 'trainer'):
        gather = run.T * group.gather_seconds(run.gathered_bytes, knobs.devices_per_node, knobs.eff)
      if layout == 'replicated':
        copy = run.rollout_param_bytes
      elif layout == 'fsdp':
        copy = run.rollout_param_bytes / n
      else:
        copy = 0.0
      # The sharded layouts hold one gathered block at a time besides the copy.
      block = run.gathered_bytes / run.layers if layout != 'replicated' else 0.0
      mem = roles.memory_dict(
          state=persistent, rollout_copy=copy, gathered_block=block, temp=run.rollout_temp(units)
      )
      gather = knobs.exposed(gather, sec, run.layers)
      out.append(
          roles.Option(
              f'{layout} layout, {c} sample{"s" if c > 1 else ""}/device/call'
              + (f", each sample's tokens over {q} devices" if q > 1 else '')
              + _split_label(q),
              calls * (sec + gather),
              mem,
              mem['total'] <= _limit(group, knobs),
              calls,
              {
                  'layout': layout,
                  'chunk': c,
                  'padded': b % n != 0,
                  'gather_s': calls * gather,
                  'sequence': q,
              },
          )
      )
  return out


def _split_label(q: int) -> str:
  return f', config.parallel.sequence={q}' if q > 1 else ''


def _grad_plans(run: RunModel, n: int, b: int, tsp: bool) -> list[tuple]:
  """(loop over K, samples a call, calls, per-device memory units, the call's batch) of each
  way to compute b samples' gradient on n devices at the run's split."""
  if tsp:  # chunks of the fragment's samples, K x samples over a (t, b) grid of the mesh
    return [
        ('vmap', bc, math.ceil(b / bc), tsp_grid.choose(run.K, n, bc).work, bc)
        for bc in roles.chunks(b)
    ]
  q = run.sequence
  rows = n // q  # samples side by side, each over q devices
  s = math.ceil(b / rows)
  plans = []
  for c in roles.chunks(s):
    plans.append(('vmap', c, math.ceil(s / c), run.K * c / q, min(b, c * rows)))
    plans.append(('scan', c, math.ceil(s / c), c / q, min(b, c * rows)))
  return plans


def grad_options(
    run: RunModel,
    group: roles.Group,
    b: int,
    knobs: Knobs,
    *,
    tsp: bool,
    frozen_once: bool = False,
) -> list[roles.Option]:
  """Ways to compute the gradient of b samples on `group` (a GAP fragment, or the whole batch
  by gradient accumulation). Memory: the trainer's state plus the larger of the gradient's and
  the optimizer apply's temp. frozen_once (LoRA; config.schedule.frozen_once_per_step): the
  base gathered once per step into a whole copy beside its shard, so a call gathers only the
  adapters; the step's one gather is detail['step_gather_s']."""
  n = group.n
  persistent = run.trainer_persistent(n)
  gathered = run.gathered_bytes
  step_gather = 0.0
  if frozen_once:
    persistent += run.frozen_base_bytes * (1 - 1 / n)
    gathered -= run.frozen_base_bytes
    step_gather = group.gather_seconds(run.frozen_base_bytes, knobs.devices_per_node, knobs.eff)
  apply = apply_temp(run, n)
  q = run.sequence
  if n % q or (tsp and q > 1):  # TSP and a sequence split do not combine (config validation)
    return []
  rows = n // q  # samples side by side, each over q devices
  out = []
  for remat, prog in sorted(run.grads.items()):
    held = run.grad_memory(remat)
    if held is None:  # this remat setting was not compiled at the split
      continue
    for loop, c, calls, mem_units, call_batch in _grad_plans(run, n, b, tsp):
      units = mem_units if loop == 'vmap' else run.K * mem_units
      flops = prog.flops(n, units, call_batch)
      gathers = 2 if loop == 'vmap' else 2 * run.K
      sec = knobs.seconds(group, prog, flops, prog.bytes_for(flops))
      # Forward and backward (and the remat's second forward) each pass the all-to-alls.
      sec += run.all_to_all_seconds(3 if remat else 2, units, group, knobs)
      fsdp = group.fsdp_seconds(
          gathered, run.trainable_bytes, gathers, knobs.devices_per_node, knobs.eff
      )
      fsdp = knobs.exposed(fsdp, sec, run.layers)
      scan = run.scan_memory(remat)
      if loop == 'scan' and scan is not None:  # XLA's, of the scan compiled
        temp = scan.temp(mem_units)
      elif loop == 'scan' and not remat:  # every step's activations kept, as the vmap's
        temp = held.temp(run.K * mem_units)
      else:  # one step's (a remat scan keeps some residuals of every step: module docstring)
        temp = held.temp(mem_units)
      mem = roles.memory_dict(state=persistent, temp=max(temp, apply))
      per = '/call (TSP)' if tsp else '/device/call' if q == 1 else f' per {q} devices/call'
      what = f'{c} sample{"s" if c > 1 else ""}{per}'
      what += ', base gathered once per step' if frozen_once else ''
      what += _split_label(q)
      out.append(
          roles.Option(
              f'remat {"on" if remat else "off"}, {loop} over K, {what}',
              calls * (sec + fsdp),
              mem,
              mem['total'] <= _limit(group, knobs),
              calls,
              {
                  'remat': remat,
                  'loop': loop,
                  'chunk': c,
                  'padded': b % rows != 0,
                  'sequence': q,
                  'fsdp_s': calls * fsdp,
                  'compute_s': calls * sec,
                  'frozen_once': frozen_once,
                  'step_gather_s': step_gather,
              },
          )
      )
  return out


def apply_seconds(run: RunModel, group: roles.Group, knobs: Knobs) -> float:
  flops = run.apply.flops(group.n, 1, 1)
  return knobs.seconds(group, run.apply, flops, run.apply.bytes0 * run.apply.n0 / group.n)


def apply_temp(run: RunModel, n: int) -> float:
  return run.apply.temp_const * run.apply.n0 / n


def best(options: list[roles.Option]) -> roles.Option | None:
  """The fastest option that fits, or None."""
  fitting = [o for o in options if o.fits]
  return min(fitting, key=lambda o: o.seconds) if fitting else None


def smallest(options: list[roles.Option]) -> roles.Option:
  """The option with the least memory (what the 'does not fit' message quotes)."""
  return min(options, key=lambda o: o.memory['total'])


def trainer_fits(run: RunModel, group: roles.Group, knobs: Knobs) -> bool:
  """Whether the trainer's state and the apply fit at all (before any gradient)."""
  total = run.trainer_persistent(group.n) + apply_temp(run, group.n)
  return total <= _limit(group, knobs)


def publish_seconds(
    run: RunModel, trainer: roles.Group, rollout: roles.Group, layout: str, knobs: Knobs
) -> float:
  """Trainer -> rollout weights, once per step; the slowest receiving NIC. Within one node
  (both roles of one kind on <= devices_per_node devices) over the intra-node link."""
  within = (
      len(trainer.parts) == len(rollout.parts) == 1
      and trainer.kinds == rollout.kinds
      and trainer.n + rollout.n <= knobs.devices_per_node
  )
  lay = 'fsdp' if layout == 'fsdp' else 'replicated'
  return max(
      timing.publish_seconds(
          run.published_bytes,
          a,
          rollout_devices=rollout.n,
          layout=lay,
          across_nodes=not within,
          eff=knobs.eff,
      )
      for a in trainer.kinds + rollout.kinds
  )


def deliver_seconds(
    run: RunModel, samples: int, trainer: roles.Group, rollout: roles.Group, knobs: Knobs
) -> float:
  """A fragment's trajectories rollout -> trainer over the NICs of the rollout's devices."""
  bw = min(a.inter_node_bw for a in trainer.kinds + rollout.kinds) * knobs.eff.link
  return run.trajectory_bytes(samples) / (bw * min(trainer.n, rollout.n))


def switch_seconds(
    run: RunModel, group: roles.Group, layout: str, offload: bool, knobs: Knobs
) -> float:
  """Colocated: the rollout copy built from the trainer's shards (+ the optimizer state's trip
  to host memory and back when offloaded), once per step."""
  return max(
      timing.switch_seconds(
          run.rollout_param_bytes,
          run.optimizer_state_bytes,
          group.n,
          a,
          layout=layout,
          offload_optimizer=offload,
          devices_per_node=group.per_node(knobs.devices_per_node),
          eff=knobs.eff,
      )['total']
      for a in group.kinds
  )


def colocated_rollout_options(
    run: RunModel, group: roles.Group, b: int, knobs: Knobs
) -> list[roles.Option]:
  """The colocated rollout beside the trainer's state (optimizer state offloaded or not)."""
  out = []
  for offload in (False, True):
    state = run.trainer_persistent(group.n) - (
        run.optimizer_state_bytes / group.n if offload else 0.0
    )
    for o in rollout_options(run, group, b, knobs, persistent=state):
      # A LoRA base is the trainer's own (its FSDP shard is in `state`): the replicated copy
      # adds the rest of it, the FSDP layout samples from the trainer's shards.
      own = run.rollout_param_bytes - run.frozen_base_bytes
      if o.detail['layout'] == 'fsdp':
        o.memory['rollout_copy'] = own / group.n
      else:
        o.memory['rollout_copy'] = own + run.frozen_base_bytes * (1 - 1 / group.n)
      o.memory['total'] = sum(v for k, v in o.memory.items() if k != 'total')
      o.fits = o.memory['total'] <= _limit(group, knobs)
      o.detail['offload'] = offload
      o.label += ', optimizer offloaded' if offload else ''
      out.append(o)
  return out


def reward_terms(config) -> dict:
  """RunModel's scoring fields from config.reward (a stated cost needs a known accelerator)."""
  r = config.reward
  cost = float(r.device_s_per_sample)
  if cost > 0:
    try:
      hardware.get(r.cost_accelerator)
    except ValueError as e:
      raise ValueError(
          f'config.reward.cost_accelerator={r.cost_accelerator!r}: {e}; it names the kind '
          'reward.device_s_per_sample was measured on'
      ) from None
  # Learned rewards and reward.in_workers run in reward.workers processes; on accelerators
  # (worker_devices 'cuda:...') those are devices of their own, of cost_accelerator's kind; a
  # remote scorer (reward.remote) is the user's devices, reward.workers requests at a time.
  where = set(reward_scoring.placement(r, run_lib.reward_weights(r)).values())
  on_devices = any(d.strip() != 'cpu' for d in (r.worker_devices or 'cpu').split(','))
  elsewhere = 'remote' in where or ('workers' in where and on_devices)
  return {
      'reward_device_s': cost,
      'reward_accelerator': str(r.cost_accelerator),
      'reward_workers': int(r.workers) if cost > 0 and elsewhere else 0,
  }
