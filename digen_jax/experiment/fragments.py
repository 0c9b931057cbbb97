"""How a logical batch is cut into GAP fragments along the sampling axis
(docs/design.md#execution-modes).

The batch holds P prompt groups of G samples, group-contiguous (B = P*G). Fragment f covers
samples [f*s, (f+1)*s) with s = B/M. With unit 'group' every fragment holds whole groups; with
unit 'sample' a group may straddle fragments, and a fragment is trainable (its advantages are
known) only once every fragment touching its groups has been scored. Pure bookkeeping: no JAX.

A fragment's arrays have `rows` rows: s rounded up to a multiple of `devices` (the lcm of the
roles' device counts, so that both meshes split them evenly). Rows past s are weight-0 padding:
copies of the fragment's own samples with valid False and advantage 0, so they add nothing to
the loss, the gradient, the pair weight or the metrics; the rollout scores only the s samples.
"""

from __future__ import annotations

import dataclasses

UNITS = ('group', 'sample')


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
  """M fragments of `size` samples over a batch of `groups` groups of `group_size`, each laid
  out as `rows` rows for meshes of `devices` (or a divisor of it) devices."""

  groups: int
  group_size: int
  num: int
  unit: str
  devices: int = 1

  def __post_init__(self):
    """The one check of config.schedule.fragments / fragment_unit against the batch
    (validation._validate_schedule builds the plan to run it)."""
    m = self.num
    if self.unit not in UNITS:
      raise ValueError(f'config.schedule.fragment_unit={self.unit!r} is not one of {UNITS}')
    if m < 1:
      raise ValueError(f'config.schedule.fragments={m} must be >= 1 (1 = no GAP)')
    if self.devices < 1:
      raise ValueError(f'FragmentPlan: devices={self.devices} must be >= 1')
    if self.unit == 'group' and self.groups % m:
      raise ValueError(
          f'config.schedule.fragments={m} must divide rl.prompts_per_step={self.groups} with '
          "fragment_unit='group'; change fragments or use --config.schedule.fragment_unit=sample"
      )
    if self.unit == 'sample' and self.batch % m:
      raise ValueError(
          f'config.schedule.fragments={m} must divide the batch rl.prompts_per_step * '
          f'rl.group_size = {self.batch}'
      )

  @property
  def batch(self) -> int:
    return self.groups * self.group_size

  @property
  def size(self) -> int:
    """Samples per fragment."""
    return self.batch // self.num

  @property
  def rows(self) -> int:
    """Rows of a fragment's arrays: `size` rounded up to a multiple of `devices`."""
    return -(-self.size // self.devices) * self.devices

  def pad_prompts(self, prompts: list[str]) -> list[str]:
    """A fragment's `size` per-sample prompts extended to `rows`, cycling through them."""
    return [prompts[i % len(prompts)] for i in range(self.rows)]

  def samples(self, f: int) -> range:
    return range(f * self.size, (f + 1) * self.size)

  def groups_of(self, f: int) -> range:
    """The groups fragment f has samples of."""
    s = self.samples(f)
    return range(s.start // self.group_size, (s.stop - 1) // self.group_size + 1)

  def fragments_of_group(self, g: int) -> range:
    return range(g * self.group_size // self.size, ((g + 1) * self.group_size - 1) // self.size + 1)

  def needs(self, f: int) -> frozenset[int]:
    """The fragments that must be scored before fragment f's advantages are known."""
    return frozenset(x for g in self.groups_of(f) for x in self.fragments_of_group(g))

  def trainable(self, scored: set[int], trained: set[int]) -> list[int]:
    """Fragments not yet trained whose groups are complete, given the scored ones."""
    return [
        f for f in range(self.num) if f not in trained and f in scored and self.needs(f) <= scored
    ]

  def prompts(self, f: int, batch_prompts: list[str]) -> list[str]:
    """Per-sample prompts of fragment f (batch_prompts: one per sample)."""
    return batch_prompts[f * self.size : (f + 1) * self.size]


def stale_count(num: int, fraction: float) -> int:
  """TCSS: how many of a batch's M fragments may start with the previous policy."""
  return int(num * fraction + 1e-9)


def plan_of(config, devices: int = 1) -> FragmentPlan:
  """The fragment plan of a run's config (rl batch, config.schedule) for meshes of `devices`
  devices (every role's device count divides it)."""
  return FragmentPlan(
      config.rl.prompts_per_step,
      config.rl.group_size,
      config.schedule.fragments,
      config.schedule.fragment_unit,
      devices,
  )
