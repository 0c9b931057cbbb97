"""The (t, b) grid of time-step parallelism (TSP, docs/design.md#execution-modes): how a fragment
gradient's K trained steps x B samples spread over a trainer mesh of n devices. Arithmetic only (no
JAX), so a config check or a cost model can use it without building anything.

The n devices are viewed as t x b (t * b = n): the K steps are padded with weight-0 steps to
K_pad = ceil(K / t) * t and split over t, the B samples over b (padded with weight-0 rows to
ceil(B / b) * b when b does not divide B). Each device runs K_pad / t steps of ceil(B / b)
samples.

t is config.schedule.tsp_steps_axis, or with 0 (auto) the divisor of n, at most K, whose
per-device work (K_pad / t) * ceil(B / b) is least; ties go to the larger t. So K is padded by
less than one round (K_pad - K < t <= K). A forced t may be any divisor of n (t = n is the 1-D
layout: the timestep axis alone over the mesh).
"""

from __future__ import annotations

from typing import NamedTuple

FIELD = 'config.schedule.tsp_steps_axis'


class Layout(NamedTuple):
  """K trained steps (padded to K_pad) over t devices, `samples` over b devices."""

  K: int
  K_pad: int
  t: int
  b: int
  samples: int

  @property
  def rows(self) -> int:
    """Sample rows the program computes: `samples` rounded up to a multiple of b."""
    return -(-self.samples // self.b) * self.b

  @property
  def work(self) -> int:
    """Sample-steps per device: (K_pad / t) * ceil(samples / b)."""
    return self.K_pad // self.t * (self.rows // self.b)


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check_steps_axis(t, n: int, where: str = 'trainer') -> None:
  """ValueError naming config.schedule.tsp_steps_axis unless it is 0 (auto) or divides n."""
  if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (t and n % t):
    raise ValueError(
        f'{FIELD}={t!r} must be 0 (auto) or a divisor of the {n} {where} devices '
        f'({", ".join(map(str, divisors(n)))})'
    )


def choose(K: int, n: int, samples: int, steps_axis: int = 0) -> Layout:
  """The layout of K steps x `samples` samples on n devices (module docstring); `steps_axis`
  forces t (0 = auto)."""
  check_steps_axis(steps_axis, n)
  if K < 1 or samples < 1:
    raise ValueError(f'TSP needs K >= 1 trained steps and samples >= 1 (K={K}, {samples=})')

  def of(t):
    return Layout(K, -(-K // t) * t, t, n // t, samples)

  if steps_axis:
    return of(steps_axis)
  candidates = [of(t) for t in divisors(n) if t <= K]
  return min(candidates, key=lambda lay: (lay.work, -lay.t))
