"""The colocated baseline (perf/baseline.py) against veRL-Omni's published Qwen-Image OCR runs
(configs/verl_omni_ocr.py): predicted images/GPU/s with every term, then each term switched off
alone and all of them off; and what the 64-GPU run's unexplained time would take.

    python benchmarks/calibration.py [--md=OUT.md] [--json=OUT.json]

Nothing here is fitted: the efficiencies are perf/hardware.py's measurements, the reward cost and
the recipe's settings are configs/verl_omni_ocr.py's, with their sources. The last column solves
for the one figure the 64xH100 run does not publish, its inter-node bandwidth per GPU, that
would make the model's step as long as the published one (a diagnosis, not a calibration).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=wrong-import-position
from configs import verl_omni_ocr
from digen_jax.perf import analytic
from digen_jax.perf import baseline
from digen_jax.perf import hardware
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm

# pylint: enable=wrong-import-position

ALL = frozenset(baseline.TERMS)


def predict(variant: str, terms=ALL, group=None) -> tuple[float, dict]:
  """(images/GPU/s, seconds by term) of a recipe on its published cluster (or `group`)."""
  cluster, _, _ = verl_omni_ocr.PUBLISHED[variant]
  c = verl_omni_ocr.get_config(variant)
  run = analytic.run_model_of(c, variant)
  group = group or roles.Group(hardware.parse_cluster(cluster))
  sec = baseline.step_seconds(run, group, rm.Knobs(), baseline.recipe_of(c), terms)
  return run.batch / sec['total'] / group.n, sec


def nic_to_match(variant: str, target_s: float) -> float:
  """The inter-node bandwidth per GPU (bytes/s) at which the modelled step takes target_s
  (bisection; the step shortens as the bandwidth grows)."""
  cluster, _, _ = verl_omni_ocr.PUBLISHED[variant]
  part = hardware.parse_cluster(cluster)[0]
  lo, hi = 1e6, part.accelerator.inter_node_bw
  for _ in range(60):
    mid = (lo * hi) ** 0.5
    acc = dataclasses.replace(part.accelerator, inter_node_bw=mid)
    group = roles.Group((hardware.ClusterPart(part.count, acc),))
    if predict(variant, ALL, group)[1]['total'] > target_s:
      lo = mid
    else:
      hi = mid
  return hi


def rows() -> list[dict]:
  out = []
  for variant, (cluster, published, step_s) in verl_omni_ocr.PUBLISHED.items():
    ips, sec = predict(variant)
    row = {
        'variant': variant,
        'cluster': cluster,
        'published': published,
        'published_step_s': step_s,
        'predicted': ips,
        'error': ips / published - 1,
        'seconds': sec,
        'without': {t: predict(variant, ALL - {t})[0] for t in baseline.TERMS},
        'no_terms': predict(variant, frozenset())[0],
    }
    if abs(row['error']) > 0.3:
      row['nic_to_match_gb_s'] = nic_to_match(variant, step_s) / 1e9
    out.append(row)
  return out


def markdown(table: list[dict]) -> str:
  head = (
      '| recipe | cluster | published images/GPU/s | predicted | error | step s: '
      + ' + '.join(t for t in ('rollout', 'reward', 'behaviour_pass', 'train', 'offload'))
      + ' + rest | '
      + ' | '.join(f'without {t}' for t in baseline.TERMS)
      + ' | no terms |'
  )
  lines = [head, '|' + '---|' * (head.count('|') - 1)]
  for r in table:
    s = r['seconds']
    rest = s['apply'] + s['engine_sleep'] + s['layered_sync']
    parts = ' + '.join(
        f'{s[t]:.1f}' for t in ('rollout', 'reward', 'behaviour_pass', 'train', 'offload')
    )
    lines.append(
        f'| {r["variant"]} | {r["cluster"]} | {r["published"]:.3f} ({r["published_step_s"]:.0f} '
        f's) | {r["predicted"]:.3f} | {100 * r["error"]:+.1f}% | {s["total"]:.0f} = {parts} + '
        f'{rest:.1f} | '
        + ' | '.join(f'{r["without"][t]:.3f}' for t in baseline.TERMS)
        + f' | {r["no_terms"]:.3f} |'
    )
  for r in table:
    if 'nic_to_match_gb_s' in r:
      lines.append(
          f'\n{r["variant"]} ({r["cluster"]}): the modelled step is {r["seconds"]["total"]:.0f} s '
          f'against {r["published_step_s"]:.0f} s published; it would take '
          f'{r["nic_to_match_gb_s"]:.1f} GB/s of inter-node bandwidth per GPU (the model assumes '
          f'{hardware.parse_cluster(r["cluster"])[0].accelerator.inter_node_bw / 1e9:.0f}: one '
          '400 Gb/s NIC per GPU) to take as long.'
      )
  return '\n'.join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--md', default=None)
  ap.add_argument('--json', default=None)
  a = ap.parse_args(argv)
  table = rows()
  text = markdown(table)
  print(text)
  if a.md:
    with open(a.md, 'w') as f:
      f.write(text + '\n')
  if a.json:
    with open(a.json, 'w') as f:
      json.dump({'source': verl_omni_ocr.SOURCE, 'rows': table}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
