"""A run's programs on a role's devices: seconds and bytes per device, scaled from perf/costs.py.

XLA's figures (perf/costs.py) are per device for one compile: n0 fake devices, one batch. A
role has n devices of one or more accelerator kinds and runs the program on other batches, so
each program is modelled in its unit of per-device work:

  rollout  one sample per device (all T sampler steps, its CFG rows)
  grad     one sample-step per device (one trained timestep of one sample, its CFG rows)
  apply    the optimizer step on the FSDP shards: everything scales as n0 / n

  FLOPs    the extrapolation's coefficients (perf/costs.py) split a program into work per unit
           and work outside the units: the rollout's `a` (the VAE decode, which the compiled
           program replicates: every device decodes the call's whole batch, benchmarks/
           RESULTS.md) scales with the call's batch, its LoRA merge (`d`) is fixed per call;
           the grad's constant is FSDP-sharded work (n0 / n). Without coefficients (methods
           raw / unrolled) everything scales with the units.
  bytes    accessed bytes scale with the FLOPs (each program's arithmetic intensity is kept).
  memory   arguments from the run's byte counts (FSDP state / n, the rollout copy whole or
           / n); temp memory affine in the units when the cache holds the program at two
           per-device batches (a memory point), else proportional to them. XLA:CPU has no bf16
           dot: it holds an f32 copy of the bf16 weights a program reads (the replicated
           rollout's temp at 2 and 8 samples per device: 77.5 and 78.5 GiB, 2x its bf16 base),
           which an accelerator does not; `temp(..., accelerator=True)` removes that copy.

A role with several kinds runs SPMD in lockstep: the slowest kind sets its seconds, the smallest
memory its fit, and its collectives cross nodes.
"""

from __future__ import annotations

import dataclasses
import math

from digen_jax.perf import program_costs as costs_lib
from digen_jax.perf import hardware
from digen_jax.perf import timing

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Group:
  """The devices of one role: (count, kind) parts."""

  parts: tuple[hardware.ClusterPart, ...]

  @property
  def n(self) -> int:
    return sum(p.count for p in self.parts)

  @property
  def kinds(self) -> tuple[hardware.Accelerator, ...]:
    return tuple(p.accelerator for p in self.parts)

  @property
  def memory_bytes(self) -> int:
    return min(a.memory_bytes for a in self.kinds)

  @property
  def label(self) -> str:
    return '+'.join(f'{p.count}x{p.accelerator.name}' for p in self.parts)

  def per_node(self, devices_per_node: int) -> int:
    # Kinds live in different nodes: a mixed role's collectives cross them.
    return devices_per_node if len(self.parts) == 1 else 1

  def fsdp_seconds(
      self, gathered: int, grad: int, gathers: int, devices_per_node: int, eff: timing.Efficiency
  ) -> float:
    return max(
        timing.fsdp_seconds(
            gathered,
            grad,
            self.n,
            a,
            gathers=gathers,
            devices_per_node=self.per_node(devices_per_node),
            eff=eff,
        )
        for a in self.kinds
    )

  def gather_seconds(
      self, whole_bytes: int, devices_per_node: int, eff: timing.Efficiency
  ) -> float:
    """One ring all-gather of `whole_bytes` over the group."""
    if self.n == 1:
      return 0.0
    return max(
        (self.n - 1)
        / self.n
        * whole_bytes
        / timing.link_bw(a, self.n, self.per_node(devices_per_node), eff)
        for a in self.kinds
    )


@dataclasses.dataclass
class ProgramModel:
  """One program's per-device FLOPs, bytes and temp memory as functions of its units."""

  name: str
  n0: int  # devices of the compile
  batch0: int  # the compile's global batch (samples)
  units0: float  # per-device units of the compile
  flops0: float
  bytes0: float
  per_unit: float  # FLOPs per unit per device
  batch_flops: float = 0.0  # per device, scales with the call's global batch (replicated decode)
  fixed_flops: float = 0.0  # per device per call (the rollout's LoRA merge)
  sharded_flops: float = 0.0  # per device at n0, scales as n0 / n
  temp_const: float = 0.0  # temp bytes = temp_const + temp_per_unit * units (XLA's, per device)
  temp_per_unit: float = 0.0
  temp_fit: str = 'proportional'
  upcast_bytes: float = 0.0  # XLA:CPU's f32 copy of bf16 weights inside temp_const (n0 devices)
  # The model's matmul FLOPs over the counted ones (XLA also counts norms, softmax, elementwise
  # and the decode): the calibrated efficiencies are fractions of peak for matmul FLOPs.
  matmul_share: float = 1.0

  def flops(self, n: int, units: float, call_batch: int, *, sharded_decode: bool = False) -> float:
    decode = self.batch_flops * call_batch / self.batch0
    if sharded_decode:  # the decode mapped over each device's own samples
      decode *= self.n0 / n
    return self.per_unit * units + decode + self.fixed_flops + self.sharded_flops * self.n0 / n

  def bytes_for(self, flops: float) -> float:
    return self.bytes0 * flops / self.flops0 if self.flops0 else 0.0

  def temp(self, units: float, *, accelerator: bool = True) -> float:
    const = self.temp_const - (self.upcast_bytes if accelerator else 0.0)
    return max(0.0, const) + self.temp_per_unit * units


def units_of(cost: costs_lib.ProgramCost, trained_steps: int, tsp: bool) -> float:
  """Per-device units of a compiled program (module docstring)."""
  n, b = cost.devices, cost.batch
  if cost.name == 'rollout':
    return b / n
  if cost.name == 'grad':
    return b * math.ceil(trained_steps / n) if tsp else trained_steps * b / n
  return 1.0


def program_model(
    cost: costs_lib.ProgramCost,
    *,
    trained_steps: int = 1,
    tsp: bool = False,
    memory_points: tuple[costs_lib.ProgramCost, ...] = (),
    upcast_bytes: float = 0.0,
    own_memory: bool = True,
) -> ProgramModel:
  """A ProgramModel from XLA's figures of `cost` (and of the same program at other per-device
  batches on the same device count: memory points). own_memory=False: the temp memory from the
  memory points alone (`cost`'s was read under another XLA:CPU pipeline)."""
  units0 = units_of(cost, trained_steps, tsp)
  share = cost.analytic_flops / cost.flops if cost.analytic_flops and cost.flops else 1.0
  m = ProgramModel(
      cost.name,
      cost.devices,
      max(1, cost.batch),
      units0,
      cost.flops,
      cost.bytes_accessed,
      0.0,
      upcast_bytes=upcast_bytes,
      matmul_share=share,
  )
  fit = cost.fit
  layers = {k[2:]: v for k, v in fit.items() if k.startswith('d_')}
  d_total = sum(cost.trip_counts.get(k, 0) * v for k, v in layers.items())
  if cost.name == 'rollout' and fit:
    m.batch_flops, m.fixed_flops = fit['a'], d_total
  elif cost.name == 'grad' and fit:
    m.sharded_flops = fit['a'] + d_total
  if cost.name == 'apply':
    m.sharded_flops = cost.flops
  else:
    m.per_unit = (cost.flops - m.batch_flops - m.fixed_flops - m.sharded_flops) / units0
  points = sorted(
      {
          (units_of(p, trained_steps, tsp), p.memory.temp_bytes)
          for p in ((cost,) if own_memory else ()) + tuple(memory_points)
          if p.devices == cost.devices
      }
  )
  if not points:
    raise ValueError(f'{cost.name}: no memory figure on {cost.devices} devices to model it from')
  if len(points) >= 2 and points[-1][0] > points[0][0]:
    (u1, t1), (u2, t2) = points[0], points[-1]
    m.temp_per_unit = (t2 - t1) / (u2 - u1)
    m.temp_const = t1 - u1 * m.temp_per_unit
    if m.temp_const < 0:  # a fit through the origin's other side: keep it proportional
      m.temp_const, m.temp_per_unit = 0.0, t2 / u2
    m.temp_fit = f'affine in {len(points)} points (units {", ".join(f"{u:g}" for u, _ in points)})'
  elif cost.name == 'apply':
    m.temp_const = cost.memory.temp_bytes
    m.temp_fit = 'scales as n0 / n'
  elif own_memory:
    m.temp_per_unit = cost.memory.temp_bytes / units0
  else:
    u, t = points[-1]
    m.temp_per_unit = t / u
  return m


@dataclasses.dataclass
class Option:
  """One way to run a program on a role: its seconds per work item and bytes per device."""

  label: str
  seconds: float
  memory: dict[str, float]  # bytes per device by part, with 'total'
  fits: bool
  calls: int = 1
  detail: dict = dataclasses.field(default_factory=dict)


def memory_dict(**parts: float) -> dict[str, float]:
  out = {k: float(v) for k, v in parts.items()}
  out['total'] = sum(out.values())
  return out


def chunks(s: int) -> list[int]:
  """Per-device samples per call to try for s samples per device: s, then halves down to 1."""
  out, c = [], s
  while c >= 1:
    out.append(c)
    if c == 1:
      break
    c = max(1, c // 2)
  return out
