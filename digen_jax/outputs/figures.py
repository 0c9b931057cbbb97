"""DIGEN_PLOTS: whether a run draws its matplotlib figures (reward.png, timeline.png).

Drawing them costs a run about a second (importing matplotlib alone is 0.7 s on a 2-core host):
the test session, which starts a hundred short runs, and sweeps that read the JSON files set
DIGEN_PLOTS=0. What the figures show stays in metrics.jsonl, summary.json and trace.json; the
sample grids (samples/, eval/) are drawn either way."""

from __future__ import annotations

import os

ENV = 'DIGEN_PLOTS'


def enabled() -> bool:
  """True unless the environment says DIGEN_PLOTS=0; any value but 0 or 1 is refused."""
  value = os.environ.get(ENV, '1')
  if value not in ('0', '1'):
    raise ValueError(
        f'{ENV}={value!r}: use 1 (draw reward.png and timeline.png; the default) or 0 (skip them)'
    )
  return value == '1'
