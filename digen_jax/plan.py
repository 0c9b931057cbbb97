"""Plans a config on a described cluster: memory per device per role, predicted samples/s and
utilization of every mode, the best rollout/trainer split, a simulated timeline.

    python -m digen_jax.plan --config=configs/qwenimage.py --cluster=8xH100+8xH20 --out=/tmp/p
    python -m digen_jax.plan --config=configs/flux.py:full --cluster=16xH100 \
        [--config.k=v ...] [--trainer=8xH100] [--roofline=bytes] [--recompute]

Costs come from the real compiled programs (perf/costs.py via the cache of perf/cache.py:
digen_jax/perf/costs_data/ holds the real Qwen-Image-20B and FLUX.1 configs'; a config without an entry
is compiled once, in a child process, and stored). perf/runmodel.py scales them to each role's
devices and accelerator, perf/search.py runs every mode through the simulator (perf/engine.py:
the runtime's own schedule on a virtual clock) over the splits of the cluster, and this file
validates the input, prints the figures and writes DIR/plan.json, DIR/timeline.png (the best
mode's simulated spans, drawn like a real run's), DIR/trace.json and DIR/timelines/<mode>.png.
"""

from __future__ import annotations

import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file[:variant].')
_CLUSTER = flags.DEFINE_string(
    'cluster', None, "Devices, e.g. '16xH100' or '8xH100+8xH20' " '(kinds: perf/hardware.py).'
)
_OUT = flags.DEFINE_string('out', None, 'Directory for plan.json, timeline.png, trace.json.')
_TRAINER = flags.DEFINE_string(
    'trainer',
    None,
    "Fix the trainer's devices instead of "
    "searching, e.g. '8xH100' or '12' (one-kind clusters); the rest "
    'roll out.',
)
_RECOMPUTE = flags.DEFINE_bool(
    'recompute', False, 'Compile the programs again even if the ' 'costs cache has them.'
)
_COST_DEVICES = flags.DEFINE_integer(
    'cost_devices',
    0,
    'Fake devices to compile for when the '
    'cache has no entry (0: 16, or the largest power of two '
    'dividing the batches).',
    lower_bound=0,
)
_ROOFLINE = flags.DEFINE_enum(
    'roofline',
    'compute',
    ['compute', 'bytes'],
    "'compute': seconds = FLOPs / (peak x MFU); 'bytes': the max with "
    "XLA's bytes accessed / HBM bandwidth (XLA:CPU's counts: an upper "
    'bound on an accelerator).',
)
_MFU = flags.DEFINE_float(
    'mfu',
    0.0,
    'One achieved fraction of peak bf16 FLOP/s for every program; 0: the calibrated fractions '
    '(sampling and training measured apart, per accelerator: perf/hardware.py).',
)
_HBM = flags.DEFINE_float('hbm_efficiency', 0.8, 'Achieved fraction of HBM bandwidth.')
_LINK = flags.DEFINE_float('link_efficiency', 0.8, 'Achieved fraction of link bandwidth.')
_PER_NODE = flags.DEFINE_integer('devices_per_node', 8, 'Accelerators per node.', lower_bound=1)
_MEM_FRACTION = flags.DEFINE_float('memory_fraction', 0.9, 'Usable fraction of device memory.')
_SHARDED_DECODE = flags.DEFINE_bool(
    'sharded_decode',
    False,
    "Model the rollout's VAE decode " 'sharded over devices (the compiled program replicates it).',
)
_STEPS = flags.DEFINE_integer('steps', 6, 'Simulated optimizer steps per candidate (>= 2).')
_TOP = flags.DEFINE_integer(
    'simulate_top', 6, 'Candidates simulated per mode (best bounds).', lower_bound=1
)
_GRID = flags.DEFINE_integer(
    'grid',
    16,
    'Trainer counts tried per part: all up to GRID, ' 'else a GRID-step grid plus powers of two.',
    lower_bound=1,
)
_TCSS = flags.DEFINE_float('tcss_fraction', 0.0, "TCSS phi (0: the config's, else 0.5).")
_TIMELINES = flags.DEFINE_enum(
    'timelines',
    'all',
    ['all', 'best'],
    "With --out: every mode's " "timeline (timelines/<mode>.png) or the best mode's only.",
)
_TERMS = flags.DEFINE_string(
    'colocated_terms',
    'all',
    "The baseline's terms (perf/baseline.py): all, none, or a subset of engine,reward,"
    'behaviour_pass,offload,engine_sleep,layered_sync.',
)
_COSTS = flags.DEFINE_enum(
    'costs',
    'xla',
    ['xla', 'analytic'],
    "'xla': the compiled programs' costs (the cache, else compiled once); 'analytic': the "
    "family's FLOPs and the weights' bytes, nothing compiled (perf/analytic.py).",
)
_OVERLAP = flags.DEFINE_bool(
    'overlap',
    True,
    "FSDP's all-gathers and reduce-scatters overlapped with the layers' compute (XLA's "
    'pipelined collectives on GPUs, process/xla_flags.py); --nooverlap: after it.',
)
_TRAINED_STEPS = flags.DEFINE_list(
    'trained_steps',
    [],
    "Trained steps per trajectory to plan instead of the config's K, e.g. 1,2,5 (a window "
    'of K steps: Flow-GRPO-Fast, veRL-Omni); each is planned, the best of each summarised.',
)
_PRICES = flags.DEFINE_string(
    'prices',
    '',
    'USD per accelerator-hour over the cited list (perf/prices.py), KIND=USD,...: e.g. '
    'H20=1.2. A kind without a price gets no per-dollar figures.',
)
_ACCELERATORS = flags.DEFINE_string(
    'accelerators', None, 'JSON file of more accelerator kinds ' '(perf/hardware.load_json).'
)


def fail(message: str):
  sys.exit(f'digen_jax.plan: {message}')


def _config_arg(argv) -> str:
  return next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '')


def _overrides(argv) -> list[str]:
  return [a for a in argv if a.startswith('--config.')]


def main(argv):
  del argv
  from digen_jax.perf import baseline  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import plan_report  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import planner as planning  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import run_models  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import splits  # pylint: disable=g-import-not-at-top
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)

  t0 = time.time()
  if _CONFIG.value is None or _CLUSTER.value is None:
    fail(
        '--config and --cluster are required, e.g. --config=configs/qwenimage.py '
        '--cluster=8xH100+8xH20'
    )
  try:
    config = _CONFIG.value
    config.model  # pylint: disable=pointless-statement  (a failed load raises on first use)
  except OSError as e:
    fail('cannot load --config: ' + ' '.join(str(e.__cause__ or e).split()))
  settings = planning.Settings(
      roofline=_ROOFLINE.value,
      mfu=_MFU.value,
      hbm_efficiency=_HBM.value,
      link_efficiency=_LINK.value,
      devices_per_node=_PER_NODE.value,
      memory_fraction=_MEM_FRACTION.value,
      sharded_decode=_SHARDED_DECODE.value,
      steps=_STEPS.value,
      simulate_top=_TOP.value,
      grid=_GRID.value,
      tcss_fraction=_TCSS.value,
      recompute=_RECOMPUTE.value,
      cost_devices=_COST_DEVICES.value,
      colocated_terms=_TERMS.value,
      costs=_COSTS.value,
      overlap=_OVERLAP.value,
      prices=_PRICES.value,
  )
  try:
    parts, trainer = planning.validate(
        _CLUSTER.value, _TRAINER.value, settings, accelerators=_ACCELERATORS.value
    )
    config_arg, overrides = _config_arg(sys.argv[1:]), _overrides(sys.argv[1:])
    run = run_models.run_model(config_arg, config, overrides, settings)
    compute_split = None
    if settings.costs == 'xla':  # a split's memory the cache lacks: compiled (minutes)
      compute_split = splits.split_computer(config_arg, config, overrides, run)
    plans = [
        planning.plan(
            variant,
            parts,
            settings,
            trainer=trainer,
            cluster=_CLUSTER.value,
            recipe=baseline.recipe_of(config),
            sequence=int(config.parallel.sequence),
            split_memory=compute_split,
        )
        for variant in run_models.trained_step_variants(run, _TRAINED_STEPS.value)
    ]
  except planning.PlanError as e:
    fail(str(e))
  if len(plans) > 1:
    print(plan_report.format_k_summary(plans) + '\n')
  plan = plans[0]
  plan['plan_seconds'] = round(time.time() - t0, 2)
  plan['command'] = ' '.join(['python -m digen_jax.plan'] + sys.argv[1:])
  print(plan_report.format_plan(plan))
  if _OUT.value:
    for path in plan_report.write(plan, _OUT.value, every_mode=_TIMELINES.value == 'all'):
      print(f'[plan] {path}')
  print(f'[plan] {plan["plan_seconds"]:.1f} s')


def _run():
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__)
  try:
    argv = flags.FLAGS(sys.argv)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError, OSError) as e:
    text = ' '.join(str(e).replace('\\n', ' ').split())
    if isinstance(e, KeyError) or isinstance(e.args[0] if e.args else None, KeyError):
      from digen_jax.process import config_errors  # pylint: disable=g-import-not-at-top

      name = text.strip('\'"\\').split("'")[0].strip('\\')
      said = config_errors.unknown_field(sys.argv, name)
      if said:
        fail(f'bad --config: {said}')
    if 'Traceback' in text:
      text = text.split('Traceback')[0] + text.rsplit(':', 1)[-1]
    fail(f'bad flags: {text}')
  app.run(main, argv=argv, flags_parser=lambda a: a)


if __name__ == '__main__':
  _run()
