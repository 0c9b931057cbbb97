"""A run resumed with a changed config: refused when the change alters what the run is.

An existing workdir with checkpoints is a run in progress. Resuming it under other settings of
the optimizer, batch, group size, seed, reward, sampler, model, schedule or objective would
continue a different experiment from the old one's weights and data position, and its figures
would describe neither (orbax and maxtext likewise resume a run only as the config it was
saved with). So, before anything compiles or is written:

  - a changed field outside BENIGN is refused in one line naming each such field (old -> new)
    and the ways on: the old values, a new --workdir, or --config.runtime.resume_changed=
    FIELD,... which accepts them and records the change in <workdir>/config_history.jsonl;
  - a changed BENIGN field (logging, eval cadence, total_steps, checkpoint cadence, where
    things are written or scored) is accepted and logged.

A field a newer version of the code added (absent from the old config.json) counts as changed
only when its value is not the default (an old run resumes under new code).
"""

from __future__ import annotations

import json
import os
import time

from digen_jax.experiment import config as configlib

# Fields whose change leaves the run the same experiment (dotted prefixes; a prefix ending in
# '.' covers its section).
BENIGN = (
    'total_steps',
    'log_every',
    'checkpoint_every',
    'keep_checkpoints',
    'sample_grid_every',
    'eval.',
    'data.data_dir',
    'text.cache',
    'runtime.transfer_guard',
    'runtime.shutdown_timeout_s',
    'runtime.max_consecutive_skips',
    'runtime.resume_changed',
    'reward.timeout_s',
    'reward.start_timeout_s',
    'reward.retries',
    'reward.max_restarts',
    'reward.batch_size',
    'reward.workers',
    'reward.worker_devices',
    'reward.device_s_per_sample',
    'reward.cost_accelerator',
    'reward.cost_source',
    'cluster.transfer_host',
    'baseline.',  # the planner's comparison; no program reads it
)
HISTORY = 'config_history.jsonl'


def _flat(d, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    key = f'{prefix}{k}'
    if isinstance(v, dict):
      out.update(_flat(v, key + '.'))
    else:
      out[key] = v
  return out


def _benign(field: str) -> bool:
  return any(field == b or (b.endswith('.') and field.startswith(b)) for b in BENIGN)


def changes(old: dict, new: dict) -> dict[str, tuple]:
  """{field: (old value, new value)} of two resolved configs (JSON dicts); a field only one
  side has is a change unless the side that has it holds the default."""
  a, b = _flat(old), _flat(new)
  defaults = _flat(json.loads(configlib.base_config().to_json_best_effort()))
  out = {}
  for field in sorted(set(a) | set(b)):
    missing = object()
    x, y = a.get(field, missing), b.get(field, missing)
    if x is missing or y is missing:
      present = y if x is missing else x
      if field in defaults and _same(present, defaults[field]):
        continue
      out[field] = (None if x is missing else x, None if y is missing else y)
    elif not _same(x, y):
      out[field] = (x, y)
  return out


def _same(x, y) -> bool:
  norm = lambda v: list(v) if isinstance(v, (list, tuple)) else v
  return norm(x) == norm(y)


def has_checkpoint(workdir: str) -> bool:
  d = os.path.join(workdir, 'checkpoints')
  return os.path.isdir(d) and any(name.isdigit() for name in os.listdir(d))


def check(workdir: str, config_json: str, accepted: str, *, record: bool = True) -> list[str]:
  """Raises ValueError (one line) when resuming `workdir` under `config_json` (the resolved
  config) would change the run's meaning; returns the lines to log for accepted changes. With
  `record`, an accepted meaning change is appended to <workdir>/config_history.jsonl."""
  path = os.path.join(workdir, 'config.json')
  if not (os.path.isfile(path) and has_checkpoint(workdir)):
    return []
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(
        f'{path} is unreadable ({e}); the run it describes cannot be resumed safely: restore it '
        'or use a new --workdir'
    ) from None
  diff = changes(old, json.loads(config_json))
  if not diff:
    return []
  allowed = {f.strip() for f in accepted.split(',') if f.strip()}
  meaning = {f: v for f, v in diff.items() if not _benign(f)}
  stray = sorted(allowed - set(meaning))
  if stray:
    raise ValueError(
        f'config.runtime.resume_changed names {", ".join(stray)}, which this resume does not '
        f'change; changed fields: {", ".join(meaning) or "none that need accepting"}'
    )
  refused = {f: v for f, v in meaning.items() if f not in allowed}
  said = lambda items: '; '.join(f'{f} {v[0]!r} -> {v[1]!r}' for f, v in items.items())
  if refused:
    raise ValueError(
        f'{workdir} holds a run saved with other settings that change what it trains: '
        f'{said(refused)}. Rerun with the old values, give a new --workdir, or accept the '
        f'change with --config.runtime.resume_changed={",".join(refused)} (recorded in '
        f'{HISTORY})'
    )
  if meaning and record:
    with open(os.path.join(workdir, HISTORY), 'a') as f:
      row = {
          'time': time.strftime('%Y-%m-%dT%H:%M:%S'),
          'accepted': {k: list(v) for k, v in meaning.items()},
      }
      f.write(json.dumps(row) + '\n')
  lines = [f'resume: {f} changed {v[0]!r} -> {v[1]!r}' for f, v in diff.items() if _benign(f)]
  lines += [
      f'resume: {f} changed {v[0]!r} -> {v[1]!r} (accepted, {HISTORY})' for f, v in meaning.items()
  ]
  return lines
