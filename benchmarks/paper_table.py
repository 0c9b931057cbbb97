"""The DigenRL paper's table, predicted: the best on-policy DigenRL mode's speedup over a
calibrated colocated baseline and over naive disaggregation, for four model families on 16 and
32 GPUs, homogeneous and mixed, and a scaling curve to 1024 accelerators.

    python benchmarks/paper_table.py --md=/tmp/paper_table.md --json=benchmarks/paper_table.json \
        --png=benchmarks/sim_scaling.png

Families: Qwen-Image-20B and FLUX.1-dev-12B from configs/qwenimage.py and configs/flux.py with
their XLA costs from the cache (digen_jax/perf/costs_data/; full fine-tuning where cached, else the
config's LoRA); Wan2.1-T2V-14B from configs/wan21.py (LoRA rank 32) with its XLA costs too:
XLA:CPU's memory analysis puts the fragment gradient of one 32,760-token video at 1,259 GB a
device unsplit, so the planner tries the sequence splits (config.parallel.sequence) whose
compiled programs the cache holds, smallest first, and plans at the first under which a mode
fits (each plan's 'sequence'). HunyuanVideo-13B from its published sizes (perf/analytic.py, no
model code here). Batches scale with the cluster (weak scaling): the configs' batch at 16 GPUs
(images: 8 prompts x 16; videos: 4 prompts x 8), twice the prompts at 32, and so on. Every mode
is the planner's (digen_jax/perf/search.py): the best split and fragment count it finds,
simulated by perf/engine.py, at the calibrated efficiencies of perf/hardware.py. Splits whose
device counts do not divide a fragment are costed as the runtime pads them.

The baseline is perf/baseline.py's colocated system (config.baseline: veRL-Omni's recipe, its
engine's calibrated efficiencies, reward, behaviour pass, offload, engine sleep, layer-by-layer
sync), priced with every term on and with every term off (then it runs our own calibrated
programs, nothing else: our own colocated mode without its FSDP layout); on a mixed cluster also
on its fastest part alone, the better of the two counting. --trained_steps=K plans a K-step
window instead of the configs' K (veRL-Omni and Flow-GRPO-Fast train 1-2 steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=wrong-import-position
from configs import flux as flux_config
from configs import qwenimage
from configs import wan21
from digen_jax.perf import analytic
from digen_jax.perf import baseline
from digen_jax.perf import cache
from digen_jax.perf import calibrations
from digen_jax.perf import comparisons
from digen_jax.perf import cached_run
from digen_jax.perf import hardware
from digen_jax.perf import planner as planning
from digen_jax.perf import run_models
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search

# pylint: enable=wrong-import-position

PAPER = "1.56-2.10x over colocated (16-32 GPUs; the paper's headline range)"
CLUSTERS = ('16xH100', '32xH100', '8xH100+8xH20', '16xH100+16xH20')
SCALING = (16, 32, 64, 128, 256, 512, 1024)
LADDER = search.MODES
SHOWN = ('disagg', 'gap', 'gap_tsp', 'gap_tsp_tag', 'gap_tsp_tag_tcss', 'gap_tag', 'gap_tag_tcss')


def run_from_cache(module, path: str, finetune: str) -> rm.RunModel | None:
  """The RunModel of a config from the costs cache (None when it has no entry)."""
  variant = 'full' if finetune == 'full' else ''
  config = module.get_config(variant)
  rank = int(config.model.lora.rank)
  entries = cache.matching(path, cache.config_digest(config), finetune, rank if rank else 0)
  if not any(set(e.key.programs) >= {'rollout', 'grad', 'apply'} for e in entries):
    return None
  name = f'{path}{":" + variant if variant else ""}'
  return cached_run.from_cache(name, config, entries)


def families() -> dict[str, rm.RunModel]:
  out = {}
  for label, module, path in (
      ('Qwen-Image-20B', qwenimage, 'configs/qwenimage.py'),
      ('FLUX.1-dev-12B', flux_config, 'configs/flux.py'),
  ):
    run = run_from_cache(module, path, 'full') or run_from_cache(module, path, 'lora')
    out[f'{label} ({run.finetune}, XLA)'] = run
  out['HunyuanVideo-13B (full, analytic)'] = analytic.run_model(analytic.HUNYUAN_VIDEO)
  wan = run_models.run_model('configs/wan21.py', wan21.get_config(''), [], planning.Settings())
  out[f'Wan2.1-14B ({wan.finetune}, XLA)'] = wan
  return out


def devices_of(spec: str) -> int:
  return sum(p.count for p in hardware.parse_cluster(spec))


def plan_one(run: rm.RunModel, spec: str, settings: planning.Settings) -> dict:
  """The plan of `run` (its batch scaled with the cluster) with the baseline's terms on, and the
  baseline again with every term off ('baseline_off')."""
  scale = max(1, devices_of(spec) // 16)
  scaled = dataclasses.replace(run, prompts=run.prompts * scale, notes=list(run.notes))
  parts = hardware.parse_cluster(spec)
  p = planning.plan(scaled, parts, settings, cluster=spec)
  p['baseline_off'] = comparisons.baseline_row(
      scaled, parts, settings.knobs(), baseline.Recipe(), frozenset()
  )
  p.pop('_results', None)
  return p


def fmt(x, digits=2):
  return '-' if x is None else f'{x:.{digits}f}'


DIGENRL = ('gap', 'gap_tsp', 'gap_tsp_tag', 'gap_tag')  # on-policy DigenRL modes


def best_digenrl(modes: dict) -> str | None:
  fitted = [m for m in DIGENRL if modes[m]['samples_per_s']]
  return max(fitted, key=lambda m: modes[m]['samples_per_s']) if fitted else None


def table(rows: list[dict]) -> str:
  head = (
      '| model | cluster | batch, K | baseline samples/s (terms on / off) | our colocated x base '
      '| best on-policy DigenRL mode | x base (terms on) | x base (terms off) | x our colocated '
      '| x naive disagg | busy trainer / rollout | split, M |'
  )
  lines = [head, '|' + '---|' * (head.count('|') - 1)]
  for r in rows:
    p = r['plan']
    modes, b, off = p['modes'], p['baseline'], p['baseline_off']
    k = best_digenrl(modes)
    m = modes[k] if k else None
    ours = p['baselines']['ours_colocated']  # at its best placement (a mixed cluster's fast part)
    where = (
        ' (fast part)'
        if 'fast_part' in b and b['fast_part']['samples_per_s'] >= b['all']['samples_per_s']
        else ''
    )
    lines.append(
        f'| {r["model"]} | {r["cluster"]} | {p["run"]["batch"]}, {p["run"]["K"]} | '
        f'{fmt(b["samples_per_s"], 3)}{where} / {fmt(off["samples_per_s"], 3)} | '
        f'{fmt(ours["samples_per_s"] / b["samples_per_s"] if ours else None)} | {k or "-"} | '
        f'{fmt(m["x_baseline"]) if m else "-"} | '
        f'{fmt(m["samples_per_s"] / off["samples_per_s"]) if m else "-"} | '
        f'{fmt(m["x_colocated"]) if m else "-"} | '
        f'{fmt(m["x_disagg"]) if m else "-"} | '
        + (
            f'{m["trainer_busy"]:.2f} / {m["rollout_busy"]:.2f} | {m["split"]}, {m["fragments"]}'
            + (f', sequence split {p["sequence"]}' if p['sequence'] > 1 else '')
            + ' |'
            if m
            else '- | - |'
        )
    )
  return '\n'.join(lines)


def scaling(runs: dict[str, rm.RunModel], settings: planning.Settings) -> dict:
  """Per family and cluster kind (H100s; half H100s, half H20s): samples/s of the baseline, our
  colocated mode, naive disagg and the best on-policy DigenRL mode on 16 to 1024 devices, weak
  scaling."""
  out = {}
  for name, run in runs.items():
    for kinds in ('H100', 'H100+H20'):
      pts = out.setdefault(f'{name}|{kinds}', [])
      for n in SCALING:
        spec = f'{n}xH100' if kinds == 'H100' else f'{n // 2}xH100+{n // 2}xH20'
        t0 = time.time()
        p = plan_one(run, spec, settings)
        k = best_digenrl(p['modes'])
        pts.append(
            {
                'devices': n,
                'cluster': spec,
                'batch': p['run']['batch'],
                'baseline': p['baseline']['samples_per_s'],
                'colocated': p['modes']['colocated']['samples_per_s'],
                'disagg': p['modes']['disagg']['samples_per_s'],
                'best_mode': k,
                'best': p['modes'][k]['samples_per_s'] if k else None,
                'best_split': p['modes'][k]['split'] if k else None,
                'sequence': p['sequence'],
                'seconds': round(time.time() - t0, 1),
            }
        )
        print(f'[scaling] {name} {spec}: {pts[-1]}', file=sys.stderr, flush=True)
  return out


def plot(curves: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = list(dict.fromkeys(k.split('|')[0] for k in curves))
  kinds = list(dict.fromkeys(k.split('|')[1] for k in curves))
  fig, axes = plt.subplots(
      len(kinds), len(names), figsize=(4.2 * len(names), 3.3 * len(kinds)), squeeze=False
  )
  for i, kind in enumerate(kinds):
    for j, name in enumerate(names):
      ax, pts = axes[i, j], curves[f'{name}|{kind}']
      n = [p['devices'] for p in pts]
      for key, style, label in (
          ('baseline', 'v:', 'colocated baseline (veRL-Omni terms)'),
          ('colocated', 'o-', 'our colocated mode'),
          ('disagg', 's--', 'naive disaggregation'),
          ('best', '^-', 'best on-policy DigenRL mode'),
      ):
        ax.plot(
            n, [p[key] / p['devices'] if p[key] else float('nan') for p in pts], style, label=label
        )
      ax.set_xscale('log', base=2)
      ax.set_yscale('log')
      ax.set_title(f'{name}\n{"H100s" if kind == "H100" else "half H100s, half H20s"}', fontsize=8)
      ax.grid(alpha=0.3, which='both')
      if i == len(kinds) - 1:
        ax.set_xlabel('accelerators (batch grows with them)')
      if j == 0:
        ax.set_ylabel('samples/s per accelerator')
  axes[0, 0].legend(fontsize=7)
  fig.suptitle(
      'python -m digen_jax.plan, simulated: throughput per accelerator from 16 to 1024 '
      'accelerators (benchmarks/paper_table.py)',
      fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


KEPT = (
    'samples_per_s',
    'x_baseline',
    'utilization',
    'x_colocated',
    'x_disagg',
    'trainer_busy',
    'rollout_busy',
    'wall_s',
    'fragments',
    'split',
    'bts_inserts',
    'step_costs',
    'why',
)


def compact(m: dict) -> dict:
  """A mode's figures for the JSON: the step costs and the options' labels, not every detail."""
  out = {k: m[k] for k in KEPT if k in m}
  for what in ('rollout', 'grad', 'tag'):
    o = m.get(f'{what}_option')
    if o:
      out[f'{what}_option'] = {
          'label': o['label'],
          'seconds': o['seconds'],
          'memory_gib': o['memory_gib']['total'],
          **{k: o[k] for k in ('fsdp_s', 'compute_s', 'gather_s') if k in o},
      }
  return out


def rounded(x):
  """4 significant digits for every float (the JSON is committed)."""
  if isinstance(x, float):
    return float(f'{x:.4g}')
  if isinstance(x, dict):
    return {k: rounded(v) for k, v in x.items()}
  if isinstance(x, list):
    return [rounded(v) for v in x]
  return x


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--md', default=None, help='write the markdown tables here')
  ap.add_argument('--json', default=None, help='write every plan figure here')
  ap.add_argument('--png', default=os.path.join(REPO, 'benchmarks', 'sim_scaling.png'))
  ap.add_argument('--no_scaling', action='store_true')
  ap.add_argument(
      '--trained_steps',
      default='config,2',
      help="the Ks to tabulate: 'config' (each config's K) and/or step counts",
  )
  a = ap.parse_args(argv)
  t0 = time.time()
  runs = families()
  settings = planning.Settings()
  out_md = ['\n'.join(calibrations.describe('digen_jax', [hardware.get('H100')]))]
  doc = {'paper': PAPER, 'calibration': out_md[0], 'tables': {}, 'scaling': None}
  for k in a.trained_steps.split(','):
    rows = []
    for name, run in runs.items():
      run_k = run if k == 'config' else dataclasses.replace(run, K=int(k), notes=list(run.notes))
      for spec in CLUSTERS:
        rows.append({'model': name, 'cluster': spec, 'plan': plan_one(run_k, spec, settings)})
        print(f'[table] K={k} {name} {spec}', file=sys.stderr, flush=True)
    title = "each config's K" if k == 'config' else f'K = {k} trained steps'
    out_md.append(f'{title}\n\n{table(rows)}')
    doc['tables'][k] = [
        {
            'model': r['model'],
            'cluster': r['cluster'],
            'batch': r['plan']['run']['batch'],
            'K': r['plan']['run']['K'],
            'baseline': r['plan']['baseline'],
            'baseline_off': r['plan']['baseline_off'],
            'modes': {m: compact(v) for m, v in r['plan']['modes'].items()},
            'best': r['plan']['best'],
            'best_on_policy': r['plan']['best_on_policy'],
            'sequence': r['plan']['sequence'],
            'notes': r['plan']['notes'],
        }
        for r in rows
    ]
  if not a.no_scaling:
    settings = planning.Settings(sharded_decode=True, simulate_top=3, grid=8)
    doc['scaling'] = scaling(runs, settings)
    plot(doc['scaling'], a.png)
    out_md.append(f'Scaling curve: {a.png}')
  text = '\n\n'.join(out_md)
  print(text)
  if a.md:
    with open(a.md, 'w') as f:
      f.write(text + '\n')
  if a.json:
    with open(a.json, 'w') as f:
      json.dump(rounded(doc), f, separators=(',', ':'), default=str)
      f.write('\n')
  print(f'[paper_table] {time.time() - t0:.0f} s', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
