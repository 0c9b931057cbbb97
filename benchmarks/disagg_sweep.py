"""Where disaggregation pays: the planner over models x objectives x trained steps x CFG x
clusters, each row the best on-policy mode against our own colocated mode (at its best
placement), veRL-Omni as its docs configure it, and naive disaggregation, per second and per
USD. Predictions only (python -m digen_jax.plan's model, analytic costs); nothing runs on an
accelerator.

    python benchmarks/disagg_sweep.py --out DIR [--prices H20=1.5] [--clusters 16xH100,...]

Writes DIR/disagg_sweep.json, DIR/disagg_sweep.md (the table) and DIR/disagg_sweep.png (each
row's speed-up over our colocated mode). Costs are analytic (perf/analytic.py: the family's
matmul FLOPs and the weights' bytes, no VAE decode), so every objective is priced the same way;
the likelihood-free objectives have no compiled programs in the costs cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=wrong-import-position
from configs import flux as flux_config
from configs import qwenimage
from digen_jax.perf import baseline
from digen_jax.perf import hardware
from digen_jax.perf import planner as planning
from digen_jax.perf import run_models

# pylint: enable=wrong-import-position

CLUSTERS = ('16xH100', '32xH100', '8xH100+8xH20', '8xH100+16xL40S')
# (label, config path, module, variant, whether it samples with CFG by default)
MODELS = (
    ('Qwen-Image-20B LoRA', 'configs/qwenimage.py', qwenimage, '', True),
    ('Qwen-Image-20B full', 'configs/qwenimage.py', qwenimage, 'full', True),
    ('FLUX.1-dev-12B full', 'configs/flux.py', flux_config, 'full', False),
)
OBJECTIVES = ('grpo', 'nft')
K_VALUES = ('config', '2')


def config_of(module, variant: str, objective: str, cfg: bool):
  c = module.get_config(variant)
  c.rl.algorithm = objective
  if not cfg:
    c.sampler.guidance_scale = 0.0
  return c


def rows(clusters, price_spec: str) -> list[dict]:
  settings = planning.Settings(costs='analytic', prices=price_spec)
  out = []
  for label, path, module, variant, has_cfg in MODELS:
    for objective in OBJECTIVES:
      for cfg in (True, False) if has_cfg else (False,):
        config = config_of(module, variant, objective, cfg)
        name = f'{path}:{variant}' if variant else path
        run = run_models.run_model(name, config, [], settings)
        for k in K_VALUES:
          variant_run = run if k == 'config' else run_models.trained_step_variants(run, [k])[0]
          for cluster in clusters:
            parts = hardware.parse_cluster(cluster)
            try:
              p = planning.plan(
                  variant_run, parts, settings, cluster=cluster, recipe=baseline.recipe_of(config)
              )
            except planning.PlanError as e:
              out.append(_row(label, objective, cfg, variant_run.K, cluster, None, str(e)))
              continue
            out.append(_row(label, objective, cfg, variant_run.K, cluster, p, ''))
  return out


def _row(model, objective, cfg, k, cluster, p, why) -> dict:
  row = {'model': model, 'objective': objective, 'cfg': cfg, 'K': k, 'cluster': cluster}
  if p is None:
    return {**row, 'why': why}
  v = p['verdict']
  return {
      **row,
      'best_on_policy': v['best_on_policy'],
      'disaggregate': v['disaggregate'],
      'against': v['against'],
      'ours_colocated_devices': p['baselines']['ours_colocated']['devices'],
      'samples_per_s': p['modes'][v['best_on_policy']]['samples_per_s'],
      'usd_per_hour': p['cost']['usd_per_hour'],
  }


def _x(a, key):
  return '-' if not a or a.get(key) is None else f'{a[key]:.2f}'


def table(rows_: list[dict]) -> str:
  head = (
      '| model | objective | CFG | K | cluster | best on-policy mode | x our colocated (its '
      'placement) | per USD | x veRL-Omni | per USD | x naive disagg |'
  )
  lines = [head, '|' + '---|' * (head.count('|') - 1)]
  for r in rows_:
    lead = f'| {r["model"]} | {r["objective"]} | {"on" if r["cfg"] else "off"} | {r["K"]} | '
    if 'why' in r:
      lines.append(lead + f'{r["cluster"]} | does not fit: {r["why"][:80]} | | | | | |')
      continue
    a = r['against']
    ours, verl, naive = a['ours_colocated'], a['verl_omni'], a['naive_disagg']
    lines.append(
        lead + f'{r["cluster"]} | {r["best_on_policy"]} | {_x(ours, "x_samples_per_s")} '
        f'({r["ours_colocated_devices"]}) | {_x(ours, "x_per_usd")} | '
        f'{_x(verl, "x_samples_per_s")} | {_x(verl, "x_per_usd")} | '
        f'{_x(naive, "x_samples_per_s")} |'
    )
  return '\n'.join(lines)


def figure(rows_: list[dict], path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fitted = [r for r in rows_ if 'why' not in r and r['against']['ours_colocated']]
  fig, ax = plt.subplots(figsize=(11, 0.22 * len(fitted) + 1.5))
  labels = [
      f'{r["model"]} {r["objective"]} CFG {"on" if r["cfg"] else "off"} K={r["K"]} {r["cluster"]}'
      for r in fitted
  ]
  x = [r['against']['ours_colocated']['x_samples_per_s'] for r in fitted]
  ax.barh(range(len(x)), x, color=['tab:green' if v > 1 else 'tab:red' for v in x])
  ax.axvline(1.0, color='k', lw=1)
  ax.set_yticks(range(len(x)), labels, fontsize=6)
  ax.invert_yaxis()
  ax.set_xlabel('best on-policy mode / our colocated mode at its best placement (samples/s)')
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--out', required=True)
  p.add_argument('--prices', default='', help='KIND=USD,... over perf/prices.py (e.g. H20=1.5)')
  p.add_argument('--clusters', default=','.join(CLUSTERS))
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  found = rows(args.clusters.split(','), args.prices)
  text = table(found)
  with open(os.path.join(args.out, 'disagg_sweep.json'), 'w') as f:
    json.dump({'prices': args.prices, 'rows': found}, f, indent=1)
  with open(os.path.join(args.out, 'disagg_sweep.md'), 'w') as f:
    f.write(text + '\n')
  figure(found, os.path.join(args.out, 'disagg_sweep.png'))
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
