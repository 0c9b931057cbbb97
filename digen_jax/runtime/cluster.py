"""Roles and meshes: which devices roll out and which train, from `config.cluster`.

A `Cluster` holds two `Role`s, trainer and rollout, each with its devices, its mesh and a speed
label. Colocated runs use one mesh for both roles (`colocated(devices)`); disaggregated runs
resolve the run's cluster spec (config.cluster, parsed by experiment/build.py) against the real
devices (`resolve(spec)`), before anything compiles.
Every mistake is a ValueError naming the config field and the fix.

Layouts (config.cluster.layout):
  'auto'      one process: the first half of its devices train, the second half roll out;
              two processes: process 0 trains, process 1 rolls out.
  'explicit'  config.cluster.{trainer,rollout}.devices (positions in jax.devices()) or
              .processes (every device of those processes).

Multi-process runs: each role lives in exactly one process, every process has a role, and the
trainer is process 0 (it owns params and optimizer state and writes checkpoints and metrics;
orbax 0.12 writes host data from process 0 only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import Mesh

from digen_jax.parallel import mesh as mesh_lib
from digen_jax.parallel import sequence
from digen_jax.parallel import tsp_grid

ROLES = ('trainer', 'rollout')


@dataclasses.dataclass(frozen=True)
class Role:
  """One role's devices and mesh. speed: relative device speed label (1.0 = reference)."""

  name: str
  devices: tuple[jax.Device, ...]
  mesh: Mesh
  speed: float = 1.0

  @property
  def size(self) -> int:
    return len(self.devices)

  @property
  def processes(self) -> tuple[int, ...]:
    return tuple(sorted({d.process_index for d in self.devices}))

  @property
  def process(self) -> int:
    """The role's process (multi-process runs have one per role)."""
    if len(self.processes) != 1:
      raise ValueError(f'the {self.name} role spans processes {self.processes}')
    return self.processes[0]

  def describe(self) -> str:
    shape = ', '.join(f'{k}={v}' for k, v in self.mesh.shape.items())
    return (
        f'{self.name}: {self.size} device(s) {[d.id for d in self.devices]} in process(es) '
        f'{list(self.processes)}, mesh ({shape}), speed {self.speed:g}'
    )


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The two roles, and how the rollout copy of the weights is laid out."""

  trainer: Role
  rollout: Role
  rollout_param_dtype: str = 'float32'  # 'float32' | 'bfloat16'
  rollout_param_sharding: str = 'replicated'  # 'replicated' | 'fsdp'

  @property
  def is_colocated(self) -> bool:
    return self.trainer.mesh is self.rollout.mesh

  @property
  def multi_process(self) -> bool:
    """True when the roles live in different processes (weights and batches go over a Channel)."""
    return self.trainer.processes != self.rollout.processes

  @property
  def writer_process(self) -> int:
    """The process that writes metrics.jsonl, checkpoints, config.json and the summary."""
    return self.trainer.processes[0]

  @property
  def num_devices(self) -> int:
    return len(set(self.trainer.devices) | set(self.rollout.devices))

  def role_of(self, process_id: int) -> str:
    """'trainer', 'rollout' or 'both' (one-process runs)."""
    t = process_id in self.trainer.processes
    r = process_id in self.rollout.processes
    return 'both' if t and r else 'trainer' if t else 'rollout' if r else 'none'

  def describe(self) -> str:
    return (
        f'{self.trainer.describe()}; {self.rollout.describe()}; rollout weights '
        f'{self.rollout_param_dtype} {self.rollout_param_sharding}'
    )


def colocated(devices: Sequence[jax.Device], rollout_param_dtype: str = 'float32') -> Cluster:
  """Both roles on one 1-D mesh over `devices` (the colocated baseline); the rollout samples
  with a copy in `rollout_param_dtype` (config.cluster.rollout.param_dtype)."""
  devices = tuple(devices)
  mesh = mesh_lib.make_mesh(devices)
  return Cluster(
      Role('trainer', devices, mesh), Role('rollout', devices, mesh), rollout_param_dtype
  )


def _auto_layout(spec, devices: list) -> dict[str, list]:
  for role in ROLES:
    for field in ('devices', 'processes'):
      if getattr(spec.role(role), field):
        raise ValueError(
            f'config.cluster.{role}.{field}={getattr(spec.role(role), field)} is set but '
            "config.cluster.layout='auto' ignores it; add "
            '--config.cluster.layout=explicit'
        )
  procs = sorted({d.process_index for d in devices})
  if len(procs) == 1:
    n = len(devices)
    if n < 2 or n % 2:
      raise ValueError(
          f"config.cluster.layout='auto' splits this process's devices in half, but it has {n}; "
          'run two processes (python launch/local.py --num_processes=2 -- python -m '
          'digen_jax.main ...), force an even number of CPU devices (XLA_FLAGS='
          '--xla_force_host_platform_device_count=4), or set config.cluster.layout=explicit'
      )
    return {'trainer': devices[: n // 2], 'rollout': devices[n // 2 :]}
  if len(procs) == 2:
    return {
        'trainer': [d for d in devices if d.process_index == procs[0]],
        'rollout': [d for d in devices if d.process_index == procs[1]],
    }
  raise ValueError(
      f"config.cluster.layout='auto' handles 1 or 2 processes; this job has "
      f'{len(procs)}. Launch 2 processes, or one per role with '
      'config.cluster.layout=explicit and config.cluster.<role>.processes'
  )


def _explicit_layout(spec, devices: list) -> dict[str, list]:
  n = len(devices)
  procs = sorted({d.process_index for d in devices})
  chosen = {}
  for role in ROLES:
    ids, pids = spec.role(role).devices, spec.role(role).processes
    if ids and pids:
      raise ValueError(
          f'config.cluster.{role}: give devices or processes, not both '
          f'(devices={ids}, processes={pids})'
      )
    if not ids and not pids:
      raise ValueError(
          f'config.cluster.{role} is empty: set config.cluster.{role}.devices '
          f'(positions in jax.devices(), 0..{n - 1}) or '
          f'config.cluster.{role}.processes (0..{procs[-1]})'
      )
    if ids:
      for i in ids:
        if not isinstance(i, int) or not 0 <= i < n:
          raise ValueError(
              f'config.cluster.{role}.devices={ids} names device {i!r}, but '
              f'jax.devices() has {n} (positions 0..{n - 1})'
          )
      if len(set(ids)) != len(ids):
        raise ValueError(f'config.cluster.{role}.devices={ids} lists a device twice')
      chosen[role] = [devices[i] for i in ids]
    else:
      for p in pids:
        if p not in procs:
          raise ValueError(
              f'config.cluster.{role}.processes={pids} names process {p!r}, but '
              f'this job has processes {procs}'
          )
      chosen[role] = [d for d in devices if d.process_index in set(pids)]
  overlap = set(chosen['trainer']) & set(chosen['rollout'])
  if overlap:
    pos = sorted(devices.index(d) for d in overlap)
    raise ValueError(
        f'config.cluster.trainer and config.cluster.rollout overlap on device(s) '
        f'{pos} (positions in jax.devices()): each device belongs to one role'
    )
  return chosen


def _check_processes(chosen: dict[str, list], devices: list) -> None:
  procs = sorted({d.process_index for d in devices})
  if len(procs) == 1:
    return
  by_role = {r: sorted({d.process_index for d in chosen[r]}) for r in ROLES}
  idle = sorted(set(procs) - set(by_role['trainer']) - set(by_role['rollout']))
  if idle:
    raise ValueError(
        f'config.cluster: process(es) {idle} have no role; every process of a '
        'multi-process run must be the trainer or the rollout'
    )
  for r in ROLES:
    if len(by_role[r]) > 1:
      raise ValueError(
          f'config.cluster.{r} spans processes {by_role[r]}; in a multi-process run '
          'each role lives in one process'
      )
  if by_role['trainer'] == by_role['rollout']:
    raise ValueError(
        f'config.cluster: both roles are in process {by_role["trainer"][0]} while '
        f'the job has {len(procs)} processes; give each role its own process'
    )
  if by_role['trainer'] != [procs[0]]:
    raise ValueError(
        f'config.cluster.trainer must be process {procs[0]} in a multi-process run '
        f'(it is {by_role["trainer"]}): that process writes checkpoints and metrics'
    )


def _role(spec, name: str, devices: list) -> Role:
  spec = spec.role(name)
  shape = tuple(int(s) for s in spec.mesh_shape) or (len(devices),)
  names = spec.axis_names
  if any(s < 1 for s in shape) or math.prod(shape) != len(devices):
    raise ValueError(
        f'config.cluster.{name}.mesh_shape={tuple(spec.mesh_shape)} holds '
        f'{math.prod(shape)} devices but the {name} role has {len(devices)}'
    )
  if len(names) != len(shape):
    raise ValueError(
        f'config.cluster.{name}.axis_names={names} must name each of the '
        f'{len(shape)} mesh axes of mesh_shape={shape}'
    )
  if len(set(names)) != len(names):
    raise ValueError(f'config.cluster.{name}.axis_names={names} repeats a name')
  if not spec.speed > 0:
    raise ValueError(f'config.cluster.{name}.speed={spec.speed} must be > 0')
  return Role(
      name, tuple(devices), mesh_lib.make_role_mesh(devices, shape, names), float(spec.speed)
  )


def resolve(spec, devices: Sequence[jax.Device] | None = None) -> Cluster:
  """The cluster of a runtime.mode='disagg' run on `devices` (default: jax.devices(), every
  process's) from its cluster spec (experiment/run.py ClusterSpec: config.cluster, the TSP steps
  axis, the sequence split). Raises ValueError naming the field for overlapping or empty roles,
  devices or processes that do not exist, bad mesh shapes, and a TSP steps axis the trainer
  cannot hold."""
  devices = list(jax.devices() if devices is None else devices)
  if spec.layout not in ('auto', 'explicit'):
    raise ValueError(f"config.cluster.layout={spec.layout!r} is not one of ('auto', 'explicit')")
  chosen = (_auto_layout if spec.layout == 'auto' else _explicit_layout)(spec, devices)
  _check_processes(chosen, devices)
  roles = {r: _role(spec, r, chosen[r]) for r in ROLES}
  # A batch or fragment that a role's devices do not divide is padded with weight-0 rows
  # (experiment/fragments.py: FragmentPlan.rows, over the lcm of the roles' device counts).
  if spec.tsp:
    tsp_grid.check_steps_axis(spec.tsp_steps_axis, roles['trainer'].size)
  for role in ROLES:
    sequence.check(
        spec.sequence,
        roles[role].size,
        spec.num_attention_heads,
        f"the {role} role's",
    )
  dtype, sharding = spec.publish.param_dtype, spec.publish.param_sharding
  if dtype not in ('float32', 'bfloat16'):
    raise ValueError(
        f'config.cluster.rollout.param_dtype={dtype!r} is not one of ' "('float32', 'bfloat16')"
    )
  if sharding not in ('replicated', 'fsdp'):
    raise ValueError(
        f'config.cluster.rollout.param_sharding={sharding!r} is not one of '
        "('replicated', 'fsdp')"
    )
  return Cluster(roles['trainer'], roles['rollout'], dtype, sharding)
