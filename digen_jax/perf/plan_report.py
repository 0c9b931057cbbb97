"""What python -m digen_jax.plan prints and writes: the plan report as text (format_plan), and
DIR/plan.json, DIR/timeline.png, DIR/trace.json and DIR/timelines/<mode>.png (write).
"""

from __future__ import annotations

import dataclasses
import json
import os

from digen_jax.runtime import trace as trace_lib
from digen_jax.perf import search


def format_k_summary(plans: list[dict]) -> str:
  """One line per planned K: the baseline, our colocated and the best on-policy mode."""
  lines = [f'{"K":>3}{"baseline":>10}{"colocated":>11}  best on-policy: samples/s, x base, split']
  for p in plans:
    k = p['best_on_policy'] or p['best']
    m = p['modes'][k]
    col = p['modes']['colocated']['samples_per_s']
    lines.append(
        f'{p["run"]["K"]:>3}{p["baseline"]["samples_per_s"]:10.4g}'
        f'{col if col is None else round(col, 4)!s:>11}  {k} {m["samples_per_s"]:.4g}, '
        f'{m["x_baseline"]:.2f}x, {m["split"]}, M={m["fragments"]}'
    )
  return '\n'.join(lines)


def _seconds(s: float) -> str:
  """A step's seconds in 9 columns or fewer, never an exponent (1140 s, not 1.14e+03)."""
  return f'{s:.3g}' if s < 100 else f'{s:.0f}'


def _usd(x: float | None) -> str:
  return '-' if x is None else f'{x:.4g}'


def baselines_lines(p: dict) -> list[str]:
  """The three baselines every plan compares against (their terms' sources: plan.json)."""
  lines = ['baselines (each term\'s source: plan.json "baselines"):']
  for key, b in p['baselines'].items():
    if b is None:
      lines.append(f'  {key:15} -  (does not fit)')
      continue
    lines.append(
        f'  {key:15} {b["samples_per_s"]:10.4g} samples/s, {_usd(b.get("samples_per_usd"))} '
        f'samples/USD on {b["devices"]}'
    )
  return lines


def verdict_lines(p: dict) -> list[str]:
  """'Should I disaggregate?': the best on-policy mode against each baseline, and the cost."""
  v, cost = p['verdict'], p['cost']
  if cost['usd_per_hour'] is None:
    price = f'no per-USD figures: no cited price for {", ".join(cost["unpriced"])} (--prices)'
  else:
    price = f'the cluster at {cost["usd_per_hour"]:.4g} USD an hour (perf/prices.py)'
  if v['best_on_policy'] is None:
    return ['', f'Should I disaggregate? No on-policy mode fits; {price}.']
  ours = v['against'].get('ours_colocated') or {}
  if v['disaggregate']:
    head = f'yes for speed: {v["best_on_policy"]} beats our colocated mode at its best placement'
    if ours.get('x_per_usd') is not None and ours['x_per_usd'] < 1:
      head += ', but not per USD'
  else:
    head = 'no: our colocated mode is the fastest on-policy mode on this cluster'
  lines = ['', f'Should I disaggregate? {head}; {price}.']
  for name, a in v['against'].items():
    if a is None:
      lines.append(f'  against {name}: -')
      continue
    per_usd = '' if a['x_per_usd'] is None else f', {a["x_per_usd"]:.2f}x per USD'
    lines.append(
        f'  {v["best_on_policy"]} against {name}: {a["x_samples_per_s"]:.2f}x samples/s{per_usd}'
    )
  return lines


def baseline_lines(b: dict) -> list[str]:
  """The compared colocated system's step, term by term, on each placement planned."""
  lines = [
      f'baseline: the colocated system of config.baseline ({b["recipe"]["engine"]} engine; '
      f'terms: {", ".join(b["terms"]) or "none"}):'
  ]
  for key in ('all', 'fast_part'):
    if key in b:
      sec = b[key]['seconds']
      lines.append(
          f'  on {b[key]["devices"]}: {b[key]["samples_per_s"]:.4g} samples/s, step '
          f'{sec["total"]:.3g} s = '
          + ' + '.join(f'{t} {v:.3g}' for t, v in sec.items() if t != 'total' and v > 0)
      )
  return lines


def format_plan(p: dict) -> str:
  r = p['run']
  lines = [
      f'{p["model"]} on {p["cluster"]} ({p["devices"]} devices): {r["finetune"]}, batch '
      f'{r["batch"]} ({r["prompts"]} prompts x {r["group_size"]}), T={r["T"]}, K={r["K"]}, '
      f'{r["image_tokens"]} image tokens; costs {p["source"]}; roofline '
      f'{p["settings"]["roofline"]}, '
      + (
          f'MFU {p["settings"]["mfu"]:.0%} for our programs'
          if p['settings']['mfu']
          else 'measured fractions of peak (perf/calibrations.py):'
      )
  ]
  lines += [f'  {c}' for c in p['calibration']]
  lines += [f'  assumed: {a}' for a in p['assumed']]
  lines += baseline_lines(p['baseline'])
  lines += baselines_lines(p)
  head = (
      f'{"mode":18}{"samples/s":>10}{"util":>6}{"busy t/r":>10}{"x base":>7}{"x coloc":>8}'
      f'{"x disagg":>9}{"M":>4} {"step s":>9}  split'
  )
  lines += ['', head]
  for k in search.MODES + search.EXTRA_MODES:
    m = p['modes'][k]
    if m['samples_per_s'] is None:
      lines.append(f'{k:18}{"-":>10}  {m["why"]}')
      continue
    xc = f'{m["x_colocated"]:.2f}' if m['x_colocated'] else '-'
    xd = f'{m["x_disagg"]:.2f}' if m['x_disagg'] else '-'
    xb = f'{m["x_baseline"]:.2f}' if m['x_baseline'] else '-'
    busy = f'{m["trainer_busy"]:.2f}/{m["rollout_busy"]:.2f}'
    lines.append(
        f'{k:18}{m["samples_per_s"]:10.4g}{m["utilization"]:6.2f}{busy:>10}{xb:>7}{xc:>8}{xd:>9}'
        f'{m["fragments"]:4d} {_seconds(m["wall_s"]):>9}  {m["split"]}'
        + ('  (TSP off: not a ladder rung)' if k in search.EXTRA_MODES else '')
    )
  lines.append(
      'busy t/r: the share of a step the trainer / the rollout runs a program '
      '(colocated: the same devices); x base: over veRL-Omni (verl_omni), x coloc: over our '
      'colocated mode (ours_colocated), x disagg: over naive disaggregation, each at its best '
      'placement'
  )
  lines += [
      '',
      'memory per device (GiB; usable '
      f'{p["settings"]["memory_fraction"]:.0%} of the device), the option each role takes:',
  ]
  shown = set()
  for k in ('colocated', p['best']):
    m = p['modes'].get(k) or {}
    for what in ('rollout', 'grad', 'tag'):
      o = m.get(f'{what}_option')
      if not o or (k, what) in shown:
        continue
      shown.add((k, what))
      role = {'rollout': 'rollout', 'grad': 'trainer', 'tag': 'trainer (TAG sampling)'}[what]
      where = (
          m['rollout'] if what == 'rollout' and m.get('rollout') else (m['trainer'] or m['split'])
      )
      parts = ', '.join(f'{a} {v:.1f}' for a, v in o['memory_gib'].items() if a != 'total')
      lines.append(
          f'  {k:10} {role:22} {where}: {o["memory_gib"]["total"]:.1f} '
          f'({parts}) {"fits" if o["fits"] else "DOES NOT FIT"}; {o["label"]}'
          + (' [batch padded to the devices]' if o.get('padded') else '')
      )
  lines += [
      '',
      f'best: {p["best"]} ({p["modes"][p["best"]]["samples_per_s"]:.3f} samples/s); '
      f'best on-policy: {p["best_on_policy"]}; split: {p["best_split"]}',
  ]
  lines += verdict_lines(p)
  for n in p['notes']:
    lines.append(f'note: {n}')
  return '\n'.join(lines)


def write(p: dict, directory: str, *, max_rows: int = 32, every_mode: bool = True) -> list[str]:
  """plan.json, timeline.png and trace.json (the best mode), timelines/<mode>.png (every mode,
  or none)."""
  os.makedirs(os.path.join(directory, 'timelines') if every_mode else directory, exist_ok=True)
  results = p.get('_results', {})
  doc = {k: v for k, v in p.items() if not k.startswith('_')}
  paths = [os.path.join(directory, 'plan.json')]
  with open(paths[0], 'w') as f:
    json.dump(doc, f, indent=1, default=str)
  for mode, res in results.items():
    if not every_mode and mode != p['best']:
      continue
    m = p['modes'][mode]
    title = (
        f'simulated {mode}: {p["model"]} on {p["cluster"]}, {m["split"]}, M={m["fragments"]}'
        f', {m["samples_per_s"]:.3f} samples/s'
    )
    spans = _rows(res.spans, max_rows)
    if every_mode:
      path = os.path.join(directory, 'timelines', f'{mode}.png')
      trace_lib.write_timeline(path, spans, title=title)
      paths.append(path)
    if mode == p['best']:
      top = os.path.join(directory, 'timeline.png')
      trace_lib.write_timeline(top, spans, title=title)
      tr = os.path.join(directory, 'trace.json')
      trace_lib.write_chrome_trace(tr, res.spans, res.decisions)
      paths += [top, tr]
  return paths


def _rows(spans, max_rows: int):
  """Spans with at most `max_rows` device rows: a role's devices run the same programs in
  lockstep, so a large role keeps its first devices' rows only."""
  devs = sorted({d for s in spans for d in s.devices})
  if len(devs) <= max_rows:
    return spans
  by_role: dict[str, list[int]] = {}
  for s in spans:
    by_role.setdefault(s.role, sorted(s.devices))
  keep = set()
  for ids in by_role.values():
    keep |= set(ids[: max(1, max_rows // max(1, len(by_role)))])
  return [
      dataclasses.replace(s, devices=tuple(d for d in s.devices if d in keep))
      for s in spans
      if any(d in keep for d in s.devices)
  ]
