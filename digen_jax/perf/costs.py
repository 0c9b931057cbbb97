"""Costs of a config's real programs from XLA's own analyses, on the command line
(perf/program_costs.py computes them):

    python -m digen_jax.perf.costs --config=configs/qwenimage.py --devices=16 --lora --remat=on
    python -m digen_jax.perf.costs --config=configs/flux.py --devices=16 --fragment_batch=16

prints FLOPs, bytes and per-device memory of the rollout, grad and apply programs (and, with
--hardware, their roofline seconds per accelerator kind); --json writes them. With
--fit_gb=80 it chooses the sequence split (config.parallel.sequence, each sample's tokens over
that many devices) that fits 80 GB per device:

    python -m digen_jax.perf.costs --config=configs/wan21.py:disagg --devices=8 \
        --programs=rollout,grad --method=raw --rollout_batch=8 --rollout_layout=fsdp \
        --fragment_batch=8 --fragment_samples=1 --fit_gb=80
"""

from __future__ import annotations

import sys

if __name__ == '__main__':
  from digen_jax.perf import devices as _devices  # pylint: disable=g-import-not-at-top

  _devices.force_host_devices(sys.argv[1:])  # before jax is imported

# pylint: disable=g-import-not-at-top,wrong-import-position  (after force_host_devices)
import json

from digen_jax.perf import hardware
from digen_jax.perf import program_costs as costs_lib
from digen_jax.perf import sequence_fit
from digen_jax.perf import timing

# pylint: enable=g-import-not-at-top,wrong-import-position


def format_table(costs: costs_lib.Costs) -> str:
  """One row per program: counted and raw FLOPs against the analytic count, bytes, memory."""
  s = costs.settings
  head = (
      f'{costs.config or "config"}: {s["finetune"]}, remat {"on" if s["remat"] else "off"}, '
      f'CFG {"on" if s["cfg"] else "off"}, {costs.devices} devices, T={s["num_steps"]}, '
      f'K={s["trained_steps"]}, {s["image_tokens"]}+{s["text_tokens"]} tokens, '
      f'{s["mmdit_params"] / 1e9:.2f}B params, tokens split over '
      f'{s.get("sequence_split", 1)}; per device (XLA:CPU {s.get("xla_pipeline", "default")})'
  )
  cols = (
      f'{"program":<9}{"batch":>6}{"TFLOP":>10}{"analytic":>10}{"ratio":>7}{"raw TFLOP":>11}'
      f'{"GB acc.":>10}{"arg GiB":>9}{"temp GiB":>9}{"total GiB":>10}{"compile":>9}'
      f'{"counting":>10}  trips'
  )
  rows = [head, cols]
  for p in costs.programs.values():
    m = p.memory
    ratio = f'{p.xla_vs_analytic:.3f}' if p.analytic_flops else '-'
    rows.append(
        f'{p.name:<9}{p.batch:>6}{p.flops / 1e12:>10.4g}{p.analytic_flops / 1e12:>10.4g}'
        f'{ratio:>7}{p.raw_flops / 1e12:>11.4g}{p.bytes_accessed / 1e9:>10.4g}'
        f'{m.argument_bytes / costs_lib.GIB:>9.2f}{m.temp_bytes / costs_lib.GIB:>9.2f}{m.total_bytes / costs_lib.GIB:>10.2f}'
        f'{p.compile_s:>8.1f}s{p.count_compile_s:>9.1f}s  '
        + ','.join(f'{k}={v}' for k, v in p.trip_counts.items())
    )
  rows.append(
      f'trainable {costs.trainable_bytes / 1e9:.2f} GB f32, optimizer state '
      f'{costs.optimizer_state_bytes / 1e9:.2f} GB, frozen base '
      f'{costs.frozen_base_bytes / 1e9:.2f} GB, published per step '
      f'{costs.published_bytes / 1e9:.3f} GB, one FSDP gather '
      f'{costs.gathered_bytes / 1e9:.2f} GB'
  )
  return '\n'.join(rows)


def format_times(costs: costs_lib.Costs, kinds: list[str], mfu: float) -> str:
  """Roofline seconds of each program per accelerator kind (perf/timing.py), and the step's parts
  when all three programs are there."""
  eff = timing.Efficiency(mfu=mfu)
  rows = [f'roofline seconds per call (MFU {mfu:.0%}, {eff.hbm:.0%} of HBM and link bandwidth)']
  for kind in kinds:
    acc = hardware.get(kind)
    line = f'{acc.name:<10}' + ''.join(
        f'  {p.name} {timing.program_seconds(p, acc, eff):.3g}s' for p in costs.programs.values()
    )
    if {'rollout', 'grad', 'apply'} <= set(costs.programs):
      for mode in ('colocated', 'disagg'):
        parts = timing.step_breakdown(costs, acc, mode=mode, eff=eff)
        line += f'\n{"":<10}  step ({mode}, serial): ' + ', '.join(
            f'{k} {v:.3g}s' for k, v in parts.items()
        )
    rows.append(line)
  return '\n'.join(rows)


# ---------------------------------------------------------------------------------------------
# Command line.


def main(argv):
  from absl import app  # pylint: disable=g-import-not-at-top

  del argv
  f = _FLAGS
  if f['config'].value is None or f['devices'].value is None:
    raise app.UsageError('--config and --devices are required')
  config = f['config'].value
  if f['remat'].value != 'config':
    config.model.remat = f['remat'].value == 'on'
  if f['full'].value and f['lora'].value:
    raise app.UsageError('--lora and --full contradict each other')
  if f['full'].value or f['lora'].value is False:
    config.model.lora.rank = 0
  elif f['lora'].value and config.model.lora.rank == 0:
    config.model.lora.rank = f['lora_rank'].value
    config.model.lora.alpha = float(2 * f['lora_rank'].value)
  unknown = set(f['programs'].value) - set(costs_lib.PROGRAMS)
  if unknown:
    raise app.UsageError(f'--programs takes {",".join(costs_lib.PROGRAMS)}; got {sorted(unknown)}')
  name = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--config=')), '')
  for kind in f['hardware'].value:  # before minutes of compiling
    try:
      hardware.get(kind)
    except ValueError as e:
      raise app.UsageError(f'--hardware: {e}') from e
  kw = dict(
      programs_=tuple(f['programs'].value),
      method=f['method'].value,
      rollout_batch=f['rollout_batch'].value,
      fragment_batch=f['fragment_batch'].value,
      rollout_layout=f['rollout_layout'].value or None,
      vae=f['vae'].value,
      name=name,
      fragment_samples=f['fragment_samples'].value,
      pipeline=f['xla_pipeline'].value,
  )
  search = None
  try:
    if f['fit_gb'].value:
      budget = f['fit_gb'].value * 1e9
      split, tried = sequence_fit.fit_sequence_split(config, f['devices'].value, budget, **kw)
      for c in tried.values():
        print(format_table(c), flush=True)
      print(sequence_fit.format_fit(tried, split, budget), flush=True)
      costs = tried[split if split is not None else max(tried)]
      search = {
          'budget_bytes': budget,
          'chosen': split,
          'total_bytes': {
              s: {p.name: p.memory.total_bytes for p in c.programs.values()}
              for s, c in tried.items()
          },
      }
    else:
      costs = costs_lib.run_costs(config, f['devices'].value, **kw)
      print(format_table(costs), flush=True)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if f['hardware'].value:
    print(format_times(costs, f['hardware'].value, f['mfu'].value), flush=True)
  if f['json'].value:
    with open(f['json'].value, 'w') as out:
      extra = {} if search is None else {'sequence_search': search}
      command = ' '.join(['python -m digen_jax.perf.costs'] + sys.argv[1:])
      json.dump(dict(costs.to_json(), command=command, **extra), out, indent=2)


def _define_flags() -> dict:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  return {
      'config': config_flags.DEFINE_config_file('config', None, 'Config file[:variant].'),
      'devices': flags.DEFINE_integer(
          'devices', None, 'N fake CPU devices: the 1-D mesh.', lower_bound=1
      ),
      'programs': flags.DEFINE_list('programs', list(costs_lib.PROGRAMS), 'Programs to compile.'),
      'method': flags.DEFINE_enum(
          'method',
          'extrapolate',
          list(costs_lib.METHODS),
          'How loop iterations are counted (module docstring).',
      ),
      'remat': flags.DEFINE_enum('remat', 'config', ['config', 'on', 'off'], 'model.remat.'),
      'lora': flags.DEFINE_bool('lora', None, "LoRA (the config's rank, else --lora_rank)."),
      'full': flags.DEFINE_bool('full', False, 'Full fine-tuning.'),
      'lora_rank': flags.DEFINE_integer('lora_rank', 64, 'Rank for --lora at config rank 0.'),
      'rollout_batch': flags.DEFINE_integer(
          'rollout_batch', 0, 'Rollout samples (0: the ' 'logical batch).', lower_bound=0
      ),
      'fragment_batch': flags.DEFINE_integer(
          'fragment_batch',
          0,
          'Samples per gradient ' 'fragment (0: batch / schedule.fragments).',
          lower_bound=0,
      ),
      'fragment_samples': flags.DEFINE_integer(
          'fragment_samples',
          0,
          "The grad's real samples, the first of its --fragment_batch rows (0: all); with "
          'config.parallel.sequence = s it computes a multiple of devices / s rows.',
          lower_bound=0,
      ),
      'rollout_layout': flags.DEFINE_enum(
          'rollout_layout',
          '',
          ['', 'replicated', 'fsdp'],
          "The rollout copy's layout (default: the config's).",
      ),
      'vae': flags.DEFINE_string('vae', 'auto', "'auto', 'real', 'tiny' or a config path."),
      'json': flags.DEFINE_string('json', None, 'Also write the figures as JSON here.'),
      'xla_pipeline': flags.DEFINE_enum(
          'xla_pipeline',
          'default',
          list(costs_lib.PIPELINES),
          "XLA:CPU passes of the memory figures: 'no_hoist' keeps bf16->f32 converts of "
          'stacked weights and residuals inside the loops, as an accelerator with bf16 dots '
          '(perf/program_costs.PIPELINES).',
      ),
      'fit_gb': flags.DEFINE_float(
          'fit_gb',
          0.0,
          'Per-device memory in GB: compile with each config.parallel.sequence the devices and '
          'heads allow, smallest first, and choose the first whose every program fits (0: off).',
          lower_bound=0.0,
      ),
      'hardware': flags.DEFINE_list(
          'hardware',
          [],
          'Accelerator kinds (perf/hardware.py) to ' 'print roofline seconds for, e.g. H100,H20.',
      ),
      'mfu': flags.DEFINE_float('mfu', 0.4, 'Achieved fraction of peak FLOP/s for --hardware.'),
  }


if __name__ == '__main__':
  from absl import app as _app  # pylint: disable=g-import-not-at-top

  _FLAGS = _define_flags()
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__)
  _app.run(main)
