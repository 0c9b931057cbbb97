"""End-of-run report: reward.png (reward and eval accuracy against step; unless DIGEN_PLOTS=0,
digen_jax/outputs/figures.py) and a short summary."""

from __future__ import annotations

import json
import os

from absl import logging

from digen_jax.outputs import eval_report
from digen_jax.outputs import figures
from digen_jax.outputs import metrics as metrics_lib

ACC = 'eval/strict_accuracy'


def write_config(config_json: str, workdir: str) -> None:
  """<workdir>/config.json: the resolved config (JSON text) of the run writing this workdir (the
  trainer writes it once its checkpoint restored: a run refused at its start leaves the previous
  one's)."""
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, 'config.json.tmp')
  with open(tmp, 'w') as f:
    f.write(config_json)
  os.replace(tmp, os.path.join(workdir, 'config.json'))


# What each time figure of the summary covers (printed after the summary line, in summary.json).
TIME_FIGURES = {
    'steps_s': "every optimizer step's wall time (metrics.jsonl wall_s: sample, score, update; "
    "step 1's compilation included, evals excluded)",
    'first_step_s': 'the first step of the run (mostly compilation)',
    'later_step_mean_s': 'the mean of the steps after the first (the steady pace)',
    'rows_span_s': "from the first metrics row to the last (start-up and step 1's compile "
    'before it not included, the evals in between included)',
}


def summarize(rows: list[dict]) -> dict:
  train = [r for r in rows if 'reward_mean' in r]
  evals = [r for r in rows if ACC in r or 'eval/reward_mean' in r]
  step_s = [r.get('wall_s', 0.0) for r in train]
  out = {
      'steps': train[-1]['step'] if train else 0,
      'steps_s': sum(step_s),
      'first_step_s': step_s[0] if step_s else 0.0,
      'later_step_mean_s': sum(step_s[1:]) / len(step_s[1:]) if step_s[1:] else 0.0,
      'rows_span_s': (rows[-1]['time'] - rows[0]['time']) if len(rows) > 1 else 0.0,
  }
  if train:
    out.update(first_reward_mean=train[0]['reward_mean'], last_reward_mean=train[-1]['reward_mean'])
  if evals:
    for key in (ACC, 'eval/strict_accuracy_hard', 'eval/reward_mean'):
      if key in evals[0]:
        out[f'base_{key.split("/")[1]}'] = evals[0][key]
        out[f'final_{key.split("/")[1]}'] = evals[-1][key]
    out['base_eval_step'], out['final_eval_step'] = evals[0]['step'], evals[-1]['step']
  return out


def plot(rows: list[dict], path: str):
  # Imported here: matplotlib takes about a second to import, which every process that stops
  # early (a bad config, an error line) would otherwise pay before saying anything.
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  train = [r for r in rows if 'reward_mean' in r]
  evals = [r for r in rows if ACC in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(
        [r['step'] for r in train],
        [r['reward_mean'] for r in train],
        color='tab:blue',
        alpha=0.8,
        label='rollout reward (mean)',
    )
  ax.set_xlabel('optimizer step')
  ax.set_ylabel('reward', color='tab:blue')
  if evals:
    ax2 = ax.twinx()
    ax2.plot(
        [r['step'] for r in evals],
        [r[ACC] for r in evals],
        'o-',
        color='tab:red',
        label='eval strict accuracy',
    )
    ax2.set_ylabel('eval strict accuracy', color='tab:red')
    ax2.set_ylim(0, 1)
  fig.suptitle('GRPO progress')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_before_after(workdir: str, summary: dict) -> str | None:
  """eval/before_after.png from the first and last eval reports of the run, if both exist."""
  if 'base_eval_step' not in summary or summary['base_eval_step'] == summary['final_eval_step']:
    return None
  paths = [
      os.path.join(workdir, 'eval', f'eval_{summary[k]:06d}.npz')
      for k in ('base_eval_step', 'final_eval_step')
  ]
  if not all(os.path.exists(p) for p in paths):
    return None
  return eval_report.before_after_grid(
      *paths,
      os.path.join(workdir, 'eval', 'before_after.png'),
      labels=(f'step {summary["base_eval_step"]}', f'step {summary["final_eval_step"]}'),
  )


def finish(workdir: str) -> dict:
  rows = metrics_lib.read_metrics(workdir)
  if figures.enabled():
    plot(rows, os.path.join(workdir, 'reward.png'))
  summary = summarize(rows)
  grid = write_before_after(workdir, summary)
  if grid:
    summary['before_after'] = grid
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(dict(summary, time_figures=TIME_FIGURES), f, indent=1)
  line = ', '.join(
      f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in summary.items()
  )
  legend = '; '.join(f'{k}: {v}' for k, v in TIME_FIGURES.items())
  logging.info('summary: %s', line)
  print(f'digen_jax summary: {line}\ndigen_jax summary times: {legend}', flush=True)
  return summary
