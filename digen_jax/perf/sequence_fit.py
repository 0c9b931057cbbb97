"""Which sequence split a config needs: the smallest config.parallel.sequence under which its
compiled programs fit a device's memory, from XLA's memory analysis on fake devices
(`python -m digen_jax.perf.costs ... --fit_gb=80`; program_costs.run_costs compiles them)."""

from __future__ import annotations

import copy

from digen_jax.parallel import sequence as sequence_lib
from digen_jax.perf import program_costs as costs_lib


def fit_sequence_split(
    config, devices: int, budget_bytes: float, **run_costs_kw
) -> tuple[int | None, dict[int, costs_lib.Costs]]:
  """The smallest config.parallel.sequence (a split the `devices` and the model's heads allow)
  under which every program of run_costs fits `budget_bytes` per device (XLA's memory
  analysis), or None when none does; with the Costs of every split tried, in the order tried."""
  heads = int(config.model.num_attention_heads)
  tried = {}
  for split in sequence_lib.divisors(devices):
    if heads % split:
      continue
    c = copy.deepcopy(config)
    c.parallel.sequence = split
    tried[split] = costs = costs_lib.run_costs(c, devices, **run_costs_kw)
    if all(p.memory.total_bytes <= budget_bytes for p in costs.programs.values()):
      return split, tried
  return None, tried


def format_fit(tried: dict, split: int | None, budget: float) -> str:
  """--fit_gb's verdict: each split's largest program total, and the split chosen."""
  rows = [f'per-device memory against {budget / 1e9:g} GB (XLA:CPU buffer assignment):']
  for s, c in tried.items():
    worst = max(c.programs.values(), key=lambda p: p.memory.total_bytes)
    fits = 'fits' if worst.memory.total_bytes <= budget else 'does not fit'
    rows.append(
        f'  config.parallel.sequence={s}: largest {worst.name} '
        f'{worst.memory.total_bytes / 1e9:.1f} GB, {fits}'
    )
  rows.append(
      f'chosen: config.parallel.sequence={split}'
      if split is not None
      else 'no split fits: fewer samples a fragment, fewer trained steps or more devices'
  )
  return '\n'.join(rows)
