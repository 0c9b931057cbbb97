"""The costs cache: perf/costs.py's `Costs` of a config, stored as JSON and reused.

Computing a real config's costs compiles its programs (Qwen-Image-20B: 20-30 minutes on two CPU
cores), so python -m digen_jax.plan stores each computed `Costs` in the committed cache, this
package's costs_data/ (package data: an installed package finds it too; every function here also
takes another `directory`), and reads it back. An entry is keyed by what changes the compiled programs:

  config file and variant      'configs/qwenimage.py', 'full'
  overrides                    --config.k=v that reach the programs (schedule, runtime, data,
                               eval and bookkeeping fields do not; see IGNORED_OVERRIDES)
  finetune, LoRA rank, remat   'lora' 64 'on'
  devices, batches, method     16 fake devices, rollout batch 128, fragment batch 16, extrapolate

A lookup matches the config file and the digest of the config sections the programs read
(`config_digest`), so `:full` and `--full` find the same entry and a changed config file does
not find a stale one. Entries computed with method 'raw' at another batch are memory points:
the real program's memory at a second per-device batch (perf/roles.py fits temp memory in it);
their FLOPs are not used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

from digen_jax.perf import program_costs as costs_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The committed cache: package data beside this module, not a folder of the checkout.
COSTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'costs_data')
# Overrides that do not change the rollout, grad or apply programs.
IGNORED_OVERRIDES = (
    'schedule.',
    'runtime.',
    'cluster.layout',
    'cluster.trainer.',
    'eval.',
    'data.',
    'total_steps',
    'checkpoint',
    'keep_checkpoints',
    'sample_grid',
    'log_every',
    'seed',
    'optim.lr',
    'optim.schedule',
    'optim.warmup',
    'model.checkpoint',
    'cluster.transfer_host',  # where the transfer server listens: no program reads it
    # The rollout copy's dtype changes its bytes, not the programs' FLOPs or temp memory: the
    # run model takes the copy's size from the config (cached_run.from_cache).
    'cluster.rollout.param_dtype',
    'text.cache',
    'text.seed',  # the word encoder's table values, not its shapes
    # The image size in pixels: with a pipeline folder it sets latent.height/width (which the
    # digest keeps); the programs never read it.
    'latent.image_height',
    'latent.image_width',
    'model.remat',
    # The costs are XLA:CPU's, where 'auto' is the portable attention ('fused' needs a GPU): the
    # CPU programs, and so the cached figures, are the same for every value.
    'model.attention',
    'model.lora.rank',
    'model.lora.alpha',
    # The batch is in the key; the planner models rl.step_loop's two loops.
    'rl.prompts_per_step',
    'rl.group_size',
    'rl.adv_std',
    'rl.adv_eps',
    'rl.adv_clip',
    'rl.clip_range',
    'rl.step_loop',
)
# Set: a cache miss raises instead of compiling the programs (cache.compute; tests/conftest.py).
CACHE_ONLY_ENV = 'DIGEN_COSTS_CACHE_ONLY'
# Config sections the compiled programs read (the digest of a cached entry).
PROGRAM_SECTIONS = ('model', 'latent', 'text', 'sampler', 'rl', 'optim', 'cluster')
# config.rl's fields of the likelihood-free objectives (experiment/config.py), left out of a
# GRPO run's digest.
LIKELIHOOD_FREE_FIELDS = (
    'algorithm',
    'rollout_sampler',
    'train_noise_levels',
    'nft_beta',
    'old_policy_flat',
    'old_policy_uprate',
    'old_policy_uphold',
    'awm_weighting',
    'awm_ghuber_power',
    'awm_advantage_max',
    'awm_ema_kl_beta',
    'awm_timestep_fraction',
    'awm_include_init',
)


@dataclasses.dataclass(frozen=True)
class Key:
  """What a cached entry was computed for."""

  config: str  # config file as given, e.g. configs/qwenimage.py
  variant: str  # '' or the ':variant' part
  overrides: tuple[str, ...]  # sorted 'k=v' that reach the programs
  finetune: str  # 'lora' | 'full'
  lora_rank: int
  remat: bool
  devices: int
  rollout_batch: int
  fragment_batch: int
  method: str  # extrapolate | unrolled | raw
  programs: tuple[str, ...] = costs_lib.PROGRAMS
  # XLA:CPU's pass pipeline of the memory figures (program_costs.PIPELINES; 'no_hoist' is
  # closer to an accelerator's buffers); entries before it existed are 'default'.
  xla_pipeline: str = 'default'
  # The grad's real samples, the first of its fragment_batch rows (0: all; costs.py's
  # --fragment_samples: with a sequence split the program computes fewer rows than devices).
  fragment_samples: int = 0
  # The grad's loop over the K trained steps: '' the config's (rl.step_loop, which the digest
  # leaves out), 'scan' forced (a scan's memory: the planner's scan option at a split).
  step_loop: str = ''

  def filename(self) -> str:
    stem = os.path.splitext(os.path.basename(self.config))[0]
    parts = [
        stem + (f'-{self.variant.replace(",", "-")}' if self.variant else ''),
        f'{self.finetune}{self.lora_rank if self.finetune == "lora" else ""}',
        f'remat-{"on" if self.remat else "off"}',
        f'd{self.devices}',
        f'r{self.rollout_batch}',
        f'f{self.fragment_batch}',
        self.method,
        '-'.join(self.programs),
    ]
    if self.fragment_samples:
      parts.append(f's{self.fragment_samples}')
    if self.step_loop:
      parts.append(self.step_loop)
    if self.xla_pipeline != 'default':
      parts.append(self.xla_pipeline.replace('_', '-'))
    if self.overrides:
      parts.append(hashlib.sha256('\n'.join(self.overrides).encode()).hexdigest()[:8])
    return '_'.join(parts) + '.json'

  def to_json(self) -> dict:
    return dict(
        dataclasses.asdict(self), overrides=list(self.overrides), programs=list(self.programs)
    )

  @staticmethod
  def from_json(d: dict) -> 'Key':
    return Key(**dict(d, overrides=tuple(d['overrides']), programs=tuple(d['programs'])))


def finetuning(config) -> tuple[str, int]:
  """The fine-tuning an entry of `config` is cached under: ('lora', rank) or ('full', 0)."""
  rank = int(config.model.lora.rank)
  return ('lora', rank) if rank > 0 else ('full', 0)


def split_config_arg(arg: str) -> tuple[str, str]:
  """'configs/qwenimage.py:full' -> ('configs/qwenimage.py', 'full')."""
  path, _, variant = arg.partition(':')
  return path, variant


def program_overrides(overrides: list[str]) -> tuple[str, ...]:
  """The 'k=v' overrides (without '--config.') that change the programs, sorted."""
  out = []
  for o in overrides:
    o = o[len('--config.') :] if o.startswith('--config.') else o
    if not o.startswith(IGNORED_OVERRIDES):
      out.append(o)
  return tuple(sorted(out))


def config_digest(config) -> str:
  """sha256 of the config sections the programs read (PROGRAM_SECTIONS), 12 hex digits. The
  fields IGNORED_OVERRIDES names are left out (they do not change the programs)."""
  d = json.loads(config.to_json_best_effort())
  keep = {}
  for section in PROGRAM_SECTIONS:
    keep[section] = d.get(section)
  # config.parallel (sequence parallelism) came later: keyed only when it splits, so entries
  # cached before it existed keep their digest.
  if d.get('parallel', {}).get('sequence', 1) != 1:
    keep['parallel'] = d['parallel']
  # The likelihood-free objectives' fields (config.rl.algorithm and after) came later too:
  # keyed only for those objectives, so GRPO's entries keep their digest.
  rl = keep.get('rl')
  if isinstance(rl, dict) and rl.get('algorithm', 'grpo') == 'grpo':
    for name in LIKELIHOOD_FREE_FIELDS:
      rl.pop(name, None)
  for dotted in IGNORED_OVERRIDES:
    path = dotted.rstrip('.').split('.')
    node = keep
    for p in path[:-1]:
      node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict):
      node.pop(path[-1], None)
  return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def costs_from_json(d: dict) -> costs_lib.Costs:
  """A Costs back from Costs.to_json() (extra keys ignored)."""
  progs = {}
  for name, p in d['programs'].items():
    mem = {
        k: p['memory'][k] for k in ('argument_bytes', 'output_bytes', 'alias_bytes', 'temp_bytes')
    }
    fields = {f.name for f in dataclasses.fields(costs_lib.ProgramCost)}
    kw = {k: v for k, v in p.items() if k in fields and k != 'memory'}
    progs[name] = costs_lib.ProgramCost(memory=costs_lib.Memory(**mem), **kw)
  fields = {f.name for f in dataclasses.fields(costs_lib.Costs)} - {'programs'}
  return costs_lib.Costs(programs=progs, **{k: d[k] for k in fields})


@dataclasses.dataclass
class Entry:
  key: Key
  costs: costs_lib.Costs
  path: str
  digest: str
  command: str = ''


def load(path: str) -> Entry:
  with open(path) as f:
    d = json.load(f)
  return Entry(
      Key.from_json(d['key']),
      costs_from_json(d),
      path,
      d.get('config_digest', ''),
      d.get('command', ''),
  )


def save(entry_json: dict, key: Key, digest: str, directory: str = COSTS_DIR) -> str:
  """Writes a Costs JSON (costs.to_json() plus 'command') as the entry of `key`."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, key.filename())
  doc = dict(entry_json, key=key.to_json(), config_digest=digest)
  with open(path, 'w') as f:
    json.dump(doc, f, indent=1)
  return path


def entries(directory: str = COSTS_DIR) -> list[Entry]:
  if not os.path.isdir(directory):
    return []
  return [
      load(os.path.join(directory, n)) for n in sorted(os.listdir(directory)) if n.endswith('.json')
  ]


def matching(
    config: str, digest: str, finetune: str, lora_rank: int, directory: str = COSTS_DIR
) -> list[Entry]:
  """Every cached entry of this config file whose programs read the same config sections
  (`digest`: a variant or override that does not reach the programs matches too), with this
  fine-tuning (any remat, device count, batch or method)."""
  norm = os.path.normpath
  return [
      e
      for e in entries(directory)
      if norm(e.key.config) == norm(config)
      and e.digest == digest
      and e.key.finetune == finetune
      and (finetune == 'full' or e.key.lora_rank == lora_rank)
  ]


def stale(config: str, finetune: str, lora_rank: int, directory: str = COSTS_DIR) -> list[Entry]:
  """Entries of this config file and fine-tuning computed from other program settings (the
  config changed since, or another variant / override)."""
  norm = os.path.normpath
  return [
      e
      for e in entries(directory)
      if norm(e.key.config) == norm(config)
      and e.key.finetune == finetune
      and (finetune == 'full' or e.key.lora_rank == lora_rank)
  ]


def compute(
    key: Key, overrides: list[str], digest: str, *, directory: str = COSTS_DIR, log=sys.stderr
) -> Entry:
  """Runs python -m digen_jax.perf.costs for `key` in a child process (it must fix the fake
  device count before jax starts), stores the result as the entry of `key` and returns it.
  With $DIGEN_COSTS_CACHE_ONLY set (the test suite sets it) a missing entry is an error instead:
  a config change that moved the digest must not make a test compile a 20B model for minutes."""
  if os.environ.get(CACHE_ONLY_ENV):
    stale_entries = stale(key.config, key.finetune, key.lora_rank, directory)
    raise RuntimeError(
        f'no cached costs for {key.filename()} (config digest {digest}; '
        f'{len(stale_entries)} entries of {key.config} are for other settings or digests) and '
        f'${CACHE_ONLY_ENV} is set: recompute them (python -m digen_jax.plan --config=... '
        '--recompute) or, if the change does not reach the programs, leave the field out of '
        'perf/cache.config_digest'
    )
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, '.' + key.filename() + '.part')
  arg = key.config + (f':{key.variant}' if key.variant else '')
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.perf.costs',
      f'--config={arg}',
      f'--devices={key.devices}',
      f'--remat={"on" if key.remat else "off"}',
      f'--rollout_batch={key.rollout_batch}',
      f'--fragment_batch={key.fragment_batch}',
      f'--method={key.method}',
      f'--programs={",".join(key.programs)}',
      f'--xla_pipeline={key.xla_pipeline}',
      f'--fragment_samples={key.fragment_samples}',
      f'--json={tmp}',
  ]
  cmd += ['--full'] if key.finetune == 'full' else ['--lora', f'--lora_rank={key.lora_rank}']
  cmd += [o if o.startswith('--config.') else f'--config.{o}' for o in overrides]
  cmd += [f'--config.rl.step_loop={key.step_loop}'] if key.step_loop else []
  print(
      f'[plan] computing costs (compiles the real programs; minutes for a 20B config): '
      f'{" ".join(cmd[1:])}',
      file=log,
      flush=True,
  )
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(
          [REPO] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
      ),
  )
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['(no output)']
    raise RuntimeError(f'computing costs failed: {tail[0]}')
  with open(tmp) as f:
    doc: dict[str, Any] = json.load(f)
  os.remove(tmp)
  doc['command'] = 'python -m digen_jax.perf.costs ' + ' '.join(
      a for a in cmd[3:] if not a.startswith('--json=')
  )
  path = save(doc, key, digest, directory)
  return load(path)


def describe(entry: Entry) -> str:
  k = entry.key
  return (
      f'{os.path.relpath(entry.path, REPO)} ({k.finetune}, remat {"on" if k.remat else "off"},'
      f' {k.devices} devices, batches {k.rollout_batch}/{k.fragment_batch}, {k.method})'
  )
