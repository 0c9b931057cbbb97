"""What an accelerator-hour costs, so a plan can say what a trained sample costs.

Each default is a public list price with its page and the date it was read; `--prices` replaces
or adds them (kind=USD per accelerator-hour). A kind without a price gets none: the plan then
reports no per-dollar figure for a cluster that includes it, and says which kind lacks one.
Prices move; the figures only compare placements on the same price list.
"""

from __future__ import annotations

import dataclasses

from digen_jax.perf import hardware


@dataclasses.dataclass(frozen=True)
class Price:
  """USD for one accelerator for one hour, and where that figure is published."""

  usd_per_hour: float
  source: str
  date: str  # when the page was read

  def __post_init__(self):
    if not self.usd_per_hour > 0:
      raise ValueError(f'Price {self.usd_per_hour!r} must be > 0 USD an hour')


_CAPACITY_BLOCKS = (
    'AWS EC2 Capacity Blocks for ML pricing (aws.amazon.com/ec2/capacityblocks/pricing), '
    'effective accelerator hourly rate, US East, the rates in force until 2025-01-01'
)
PRICES = {
    'H100 SXM': Price(4.916, f'{_CAPACITY_BLOCKS}: p5.48xlarge, 8 x H100', '2026-12-02'),
    'H200': Price(5.408, f'{_CAPACITY_BLOCKS}: p5e.48xlarge, 8 x H200', '2026-12-02'),
    'L40S': Price(
        1.861,
        'AWS G6e on-demand, 1 x L40S, us-east-1, as listed by Modal, "How much does it cost to '
        'run NVIDIA L40S GPUs in 2025?" (modal.com/blog/nvidia-l40s-price-article, 2025-08-12)',
        '2026-12-02',
    ),
}


def parse(spec: str) -> dict[str, Price]:
  """The default list with `spec`'s prices ('H20=1.2,H100=2.5': kind=USD an hour) over it."""
  out = dict(PRICES)
  for item in filter(None, (s.strip() for s in spec.split(','))):
    kind, sep, usd = item.partition('=')
    if not sep:
      raise ValueError(f'--prices item {item!r}: write KIND=USD_PER_HOUR, e.g. H20=1.2')
    try:
      value = float(usd)
    except ValueError:
      raise ValueError(f'--prices item {item!r}: {usd!r} is not a number of USD') from None
    name = hardware.get(kind.strip()).name
    out[name] = Price(value, '--prices (given on the command line)', '')
  return out


def usd_per_hour(parts, prices: dict[str, Price]) -> tuple[float | None, list[str]]:
  """(USD an hour for these cluster parts or None, the kinds without a price)."""
  missing = sorted({p.accelerator.name for p in parts} - set(prices))
  if missing:
    return None, missing
  return sum(p.count * prices[p.accelerator.name].usd_per_hour for p in parts), []
