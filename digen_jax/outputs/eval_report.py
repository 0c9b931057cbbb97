"""What an eval writes: eval_<step>.json (metrics, per-prompt pass rates), eval_<step>.png (a
sample grid with PASS/FAIL frames; a video run's: eval_<step>.gif, the grid animated),
eval_<step>.npz (every sample, for the end-of-run before/after grid), and that grid."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from PIL import Image

from digen_jax.outputs import visualize


def write_report(result: dict[str, Any], out_dir: str, step: int, *, grid_prompts: int = 16) -> str:
  """eval_<step>.json (metrics + per-prompt pass rates) and eval_<step>.png (a sample grid with
  ✓/✗ marks and prompts; videos: eval_<step>.gif). Returns the grid's path."""
  os.makedirs(out_dir, exist_ok=True)
  prompts, rewards, passed = result['prompts'], result['rewards'], result['passed']
  per_prompt: dict[str, dict[str, float]] = {}
  for i, p in enumerate(prompts):
    d = per_prompt.setdefault(p, {'reward_sum': 0.0, 'passed': 0, 'n': 0})
    d['reward_sum'] += float(rewards[i])
    d['passed'] += int(passed[i]) if passed is not None else 0
    d['n'] += 1
  report = {
      'step': step,
      **result['metrics'],
      'per_prompt': {
          p: {
              'reward_mean': d['reward_sum'] / d['n'],
              **({'pass_rate': d['passed'] / d['n']} if passed is not None else {}),
          }
          for p, d in per_prompt.items()
      },
  }
  with open(os.path.join(out_dir, f'eval_{step:06d}.json'), 'w') as f:
    json.dump(report, f, indent=1)
  # Grid: the first samples of the first `grid_prompts` prompts.
  n_per = result['metrics']['eval/samples_per_prompt']
  idx = [i for i in range(len(prompts)) if i // n_per < grid_prompts]
  caps = [
      ('PASS ' if passed is not None and passed[i] else 'FAIL ' if passed is not None else '')
      + f'{prompts[i]} r={rewards[i]:.2f}'
      for i in idx
  ]
  path = _save_grid(
      os.path.join(out_dir, f'eval_{step:06d}'),
      result['images'][idx],
      caps,
      cols=n_per,
      passed=None if passed is None else [bool(passed[i]) for i in idx],
  )
  # Every sample as uint8, for the end-of-run before/after grid (same prompts and noise at every
  # eval, so sample i of two evals is the same prompt and seed under two policies).
  np.savez_compressed(
      os.path.join(out_dir, f'eval_{step:06d}.npz'),
      images=visualize.to_uint8(result['images']),
      prompts=np.asarray(prompts),
      passed=(np.zeros(len(prompts), bool) if passed is None else passed),
      rewards=rewards,
  )
  return path


def before_after_grid(
    first_npz: str,
    last_npz: str,
    out_path: str,
    *,
    num_prompts: int = 12,
    samples: int = 2,
    labels=('base', 'final'),
) -> str:
  """A PNG with one row per prompt: `samples` eval samples of the first report, then the same
  prompts and noise from the last report, with PASS/FAIL frames. Prompts are picked evenly over
  the eval split (so single-object and relation prompts both show). Returns the path written:
  out_path, or for videos a GIF beside it (out_path with .gif)."""
  a, b = np.load(first_npz), np.load(last_npz)
  if list(a['prompts']) != list(b['prompts']):
    raise ValueError(f'{first_npz} and {last_npz} were evaluated on different prompts')
  prompts = list(a['prompts'])
  uniq = list(dict.fromkeys(prompts))
  n_per = len(prompts) // len(uniq)
  samples = min(samples, n_per)
  picks = [uniq[i] for i in np.linspace(0, len(uniq) - 1, min(num_prompts, len(uniq))).astype(int)]
  images, caps, passed = [], [], []
  for p in picks:
    first = prompts.index(p)
    for src, label in ((a, labels[0]), (b, labels[1])):
      for k in range(samples):
        i = first + k
        images.append(src['images'][i])  # uint8
        passed.append(bool(src['passed'][i]))
        caps.append(f'{label}: {p}' if k == 0 else f'{label}')
  os.makedirs(os.path.dirname(out_path) or '.', exist_ok=True)
  return _save_grid(
      os.path.splitext(out_path)[0], np.stack(images), caps, cols=2 * samples, passed=passed
  )


def _save_grid(stem: str, images, captions, **kw) -> str:
  """stem.png of images [B, H, W, 3], or stem.gif of videos [B, F, H, W, 3]; returns its path."""
  if np.asarray(images).ndim == 5:
    visualize.save_video_grid(stem + '.gif', images, captions, **kw)
    return stem + '.gif'
  Image.fromarray(visualize.image_grid(images, captions, **kw)).save(stem + '.png')
  return stem + '.png'
