"""Sequence parallelism's layout: a sample's tokens split over `s` devices of a role's mesh
(config.parallel.sequence = s, docs/design.md#attention-and-sequence-parallelism). The role's n
devices are viewed as (n / s) x s, row-major (a second Mesh over the same devices in the same order,
as TSP's grid: the jit's device assignment is unchanged): samples go over the first axis, each
sample's tokens over the s devices of the second. models/attention/sequence_parallel.py runs attention on that
view ("Ulysses").

`check` is the arithmetic a config load runs (no JAX: validation and runtime.cluster call it
before anything compiles); `token_mesh` builds the view.
"""

from __future__ import annotations

from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

FIELD = 'config.parallel.sequence'
SAMPLES, TOKENS = 'seq_samples', 'seq_tokens'  # the view's axis names


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check(size, devices: int | None, heads: int, where: str = 'the') -> None:
  """ValueError naming config.parallel.sequence unless `size` is a positive int that divides
  the model's `heads` (Ulysses gives each device heads / size whole heads) and `devices` (a
  role's device count; None: not known yet). The token count needs no divisibility: attention
  pads it."""
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(f'{FIELD}={size!r} must be a positive int (1 = no split)')
  if heads % size:
    raise ValueError(
        f"{FIELD}={size} must divide the model's {heads} attention heads "
        f'(model.num_attention_heads): each device attends with whole heads; one of '
        f'{", ".join(map(str, divisors(heads)))}'
    )
  if devices is not None and devices % size:
    fits = [d for d in divisors(devices) if heads % d == 0]
    raise ValueError(
        f'{FIELD}={size} must divide {where} {devices} devices: one of '
        f'{", ".join(map(str, fits))}'
    )


def token_mesh(mesh: Mesh, size: int) -> Mesh | None:
  """The (samples, tokens) view of `mesh`'s devices with `size` devices per sample, or None
  when nothing is split (size 1, or a one-device mesh, which only abstract shape traces use).
  ValueError naming the field when size does not divide the mesh."""
  n = mesh.devices.size
  if size == 1 or n == 1:
    return None
  if n % size:
    raise ValueError(f"{FIELD}={size} must divide the mesh's {n} devices")
  return Mesh(
      mesh.devices.reshape(n // size, size), (SAMPLES, TOKENS), axis_types=(AxisType.Auto,) * 2
  )


def samples_sharding(view: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
  """Dimension `axis` of an ndim array over the view's samples axis (each sample whole on the
  devices that split its tokens)."""
  spec = [None] * ndim
  spec[axis] = SAMPLES
  return NamedSharding(view, P(*spec))
