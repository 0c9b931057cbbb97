"""Roofline time model: program costs (perf/costs.py) on an accelerator (perf/hardware.py) ->
predicted seconds, plus the transfers the programs' FLOP and byte counts do not hold.

  program     max(flops / (peak * mfu), bytes_accessed / (hbm_bw * hbm_eff)), per device
  FSDP        ring all-gather of the forward's weights (`gathers` times per fragment: forward
              and backward) and reduce-scatter of the float32 gradient: each device moves
              (n - 1) / n of the whole bytes over the slowest link of the ring
  publish     trainer -> rollout weights once per optimizer step: every rollout device receives
              the whole copy (replicated layout) or its 1/n_rollout shard (FSDP layout); the
              receiving link is the bottleneck
  switch      colocated mode, twice per step: the rollout copy is built from the trainer's FSDP
              shards (an all-gather for a replicated copy, a local cast for an FSDP copy) and,
              when the optimizer state is offloaded to host memory during the rollout, it goes
              out and comes back over the host link

Efficiencies are knobs, not measurements: the defaults (40% MFU, 80% of HBM and link bandwidth)
are typical large-model figures; calibrate them against a measured step before trusting an
absolute number. Overlap between these terms is the schedule's business (sim's virtual clock):
nothing here overlaps anything.
"""

from __future__ import annotations

import dataclasses

from digen_jax.perf import program_costs as costs_lib
from digen_jax.perf import hardware


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the accelerator's peaks."""

  mfu: float = 0.4  # of peak dense bf16 FLOP/s
  hbm: float = 0.8  # of HBM bandwidth
  link: float = 0.8  # of interconnect / NIC / host-link bandwidth

  def __post_init__(self):
    for field in ('mfu', 'hbm', 'link'):
      value = getattr(self, field)
      if not 0 < value <= 1:
        raise ValueError(f'Efficiency.{field} must be in (0, 1], got {value!r}')


DEFAULT = Efficiency()


def roofline_seconds(
    flops: float, bytes_accessed: float, acc: hardware.Accelerator, eff: Efficiency = DEFAULT
) -> float:
  """Seconds of one device's work: bound by compute or by memory traffic, whichever is slower."""
  if flops < 0 or bytes_accessed < 0:
    raise ValueError(f'flops={flops} and bytes_accessed={bytes_accessed} must be >= 0')
  return max(flops / (acc.peak_bf16_flops * eff.mfu), bytes_accessed / (acc.hbm_bw * eff.hbm))


def program_seconds(
    cost: costs_lib.ProgramCost, acc: hardware.Accelerator, eff: Efficiency = DEFAULT
) -> float:
  """One call of a compiled program (its per-device counts) on `acc`."""
  return roofline_seconds(cost.flops, cost.bytes_accessed, acc, eff)


def link_bw(
    acc: hardware.Accelerator, devices: int, devices_per_node: int, eff: Efficiency = DEFAULT
) -> float:
  """Bytes/s of the slowest link a collective over `devices` uses: the intra-node link when they
  fit one node, else the NIC."""
  bw = acc.intra_node_bw if devices <= devices_per_node else acc.inter_node_bw
  return bw * eff.link


def fsdp_seconds(
    gathered_bytes: int,
    grad_bytes: int,
    devices: int,
    acc: hardware.Accelerator,
    *,
    gathers: int = 2,
    devices_per_node: int = 8,
    eff: Efficiency = DEFAULT,
) -> float:
  """FSDP collectives of one fragment: `gathers` ring all-gathers of the weights (whole bytes
  `gathered_bytes`) and one ring reduce-scatter of the gradient (`grad_bytes`). 0 on 1 device."""
  if devices < 1:
    raise ValueError(f'devices={devices} must be >= 1')
  moved = (devices - 1) / devices * (gathers * gathered_bytes + grad_bytes)
  return moved / link_bw(acc, devices, devices_per_node, eff)


def publish_seconds(
    published_bytes: int,
    acc: hardware.Accelerator,
    *,
    rollout_devices: int = 1,
    layout: str = 'replicated',
    across_nodes: bool = True,
    eff: Efficiency = DEFAULT,
) -> float:
  """Trainer -> rollout weight publish: bytes each rollout device receives over its link."""
  if layout not in ('replicated', 'fsdp'):
    raise ValueError(f"layout={layout!r}: expected 'replicated' or 'fsdp'")
  per_device = published_bytes / (rollout_devices if layout == 'fsdp' else 1)
  bw = acc.inter_node_bw if across_nodes else acc.intra_node_bw
  return per_device / (bw * eff.link)


def switch_seconds(
    rollout_param_bytes: int,
    optimizer_state_bytes: int,
    devices: int,
    acc: hardware.Accelerator,
    *,
    layout: str = 'replicated',
    offload_optimizer: bool = False,
    devices_per_node: int = 8,
    eff: Efficiency = DEFAULT,
) -> dict[str, float]:
  """Colocated mode's switch between the training and sampling layouts, once per step:
  {'reshard': building the rollout copy from FSDP shards, 'offload': the optimizer state to host
  and back (0 unless offloaded), 'total'}."""
  if layout == 'replicated':
    reshard = (
        (devices - 1) / devices * rollout_param_bytes / link_bw(acc, devices, devices_per_node, eff)
    )
  elif layout == 'fsdp':
    # Each device casts its own shard: read it and write the copy (HBM traffic only).
    reshard = 2 * rollout_param_bytes / devices / (acc.hbm_bw * eff.hbm)
  else:
    raise ValueError(f"layout={layout!r}: expected 'replicated' or 'fsdp'")
  offload = (
      2 * optimizer_state_bytes / devices / (acc.host_bw * eff.link) if offload_optimizer else 0.0
  )
  return {'reshard': reshard, 'offload': offload, 'total': reshard + offload}


def step_breakdown(
    costs: costs_lib.Costs,
    acc: hardware.Accelerator,
    *,
    mode: str = 'colocated',
    rollout_devices: int | None = None,
    devices_per_node: int = 8,
    offload_optimizer: bool = False,
    eff: Efficiency = DEFAULT,
) -> dict[str, float]:
  """Seconds of each part of one optimizer step, nothing overlapped: the rollout of the logical
  batch, its fragments' gradients and FSDP collectives, the apply, and the publish ('disagg') or
  the layout switch ('colocated'). Needs costs.programs rollout, grad and apply."""
  if mode not in ('colocated', 'disagg'):
    raise ValueError(f"mode={mode!r}: expected 'colocated' or 'disagg'")
  missing = {'rollout', 'grad', 'apply'} - set(costs.programs)
  if missing:
    raise ValueError(f'step_breakdown needs the programs {sorted(missing)} in costs')
  p = costs.programs
  fragments = max(1, p['rollout'].batch // p['grad'].batch)
  layout = costs.settings['rollout_layout']
  out = {
      'rollout': program_seconds(p['rollout'], acc, eff),
      'grad': fragments * program_seconds(p['grad'], acc, eff),
      'fsdp': fragments
      * fsdp_seconds(
          costs.gathered_bytes,
          costs.trainable_bytes,
          costs.devices,
          acc,
          devices_per_node=devices_per_node,
          eff=eff,
      ),
      'apply': program_seconds(p['apply'], acc, eff),
  }
  if mode == 'disagg':
    out['publish'] = publish_seconds(
        costs.published_bytes,
        acc,
        rollout_devices=rollout_devices or costs.devices,
        layout=layout,
        eff=eff,
    )
  else:
    out['switch'] = switch_seconds(
        costs.rollout_param_bytes,
        costs.optimizer_state_bytes,
        costs.devices,
        acc,
        layout=layout,
        offload_optimizer=offload_optimizer,
        devices_per_node=devices_per_node,
        eff=eff,
    )['total']
  out['total'] = sum(out.values())
  return out
