"""Entry point: python -m digen_jax.main --config=configs/X.py[:variant] --workdir=DIR [--config.a.b=v].

runtime.mode='colocated' runs in one process. runtime.mode='disagg' runs in one process (a mesh
per role over its devices) or in two (python launch/local.py --num_processes=2 -- python -m
digen_jax.main ...: process 0 trains, process 1 rolls out). Every mode runs runtime/loop.py.
"""

from __future__ import annotations

import math
import os
import signal
import sys

from absl import app
from absl import logging

from digen_jax.process import cli
from digen_jax.outputs import faults
from digen_jax.process import interrupt
from digen_jax.process import launch_env
from digen_jax.process import peers
from digen_jax.process import xla_flags


def main(argv):
  del argv
  # A process alone (no launcher variables) takes its workdir's lock first, before JAX is even
  # imported: a second run on a busy workdir is refused in a second or two, not after JAX's
  # import and backend start (39.6 s beside a training run). A job of several processes shares
  # one lock through jax.distributed's key-value store (_lock_workdir).
  lock = None
  try:
    if launch_env.launcher_env() is None:
      from digen_jax.process import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

      lock = workdir_lib.acquire(cli.WORKDIR.value)
  except ValueError:
    pass  # a bad launcher variable: distributed.maybe_initialize says which, below
  except faults.RunError as e:
    cli.fail(str(e))
  try:
    _main()
  finally:
    if lock is not None:
      lock.release()


def _main():
  # Before anything touches a JAX backend: FSDP's collectives overlapped on GPUs, then the
  # launcher's jax.distributed job joined, if any.
  xla_flags.install()
  from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top

  try:
    info = distributed.maybe_initialize()
  except ValueError as e:
    cli.fail(str(e))
  if info.num_processes > 1:
    # A peer's death is one line here, also when the jax.distributed client aborts this process.
    peers.watch_stderr(info.process_id)
  try:
    try:
      _run(info)
    except interrupt.Interrupted as e:  # SIGTERM/SIGINT: checkpointed; 128 + signum
      print(f'digen_jax: {e}', file=sys.stderr, flush=True)
      sys.exit(e.exit_code)
    except faults.RunError as e:  # a fault with its own explanation: one line, no traceback
      cli.fail(str(e))
  except SystemExit as e:
    if info.num_processes > 1 and e.code not in (None, 0):
      # A normal exit would wait in jax.distributed's shutdown for peers that may be waiting
      # for this process (e.g. at a barrier): report and leave now; the launcher stops the rest.
      # An int code comes after the line that says why.
      peers.last_line(e.code if isinstance(e.code, str) else None)
      sys.stdout.flush()
      os._exit(e.code if isinstance(e.code, int) else 1)
    raise


def prepare_tiny_pipeline(config, workdir: str):
  """configs/qwenimage.py:tiny_pipeline, configs/flux.py:tiny_pipeline: builds the toy diffusers folder at
  config.model.checkpoint if absent and encodes the prompts the run can draw into
  config.text.cache, each in a child process (torch never runs in the training process)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from digen_jax.data import prompts as prompt_data  # pylint: disable=g-import-not-at-top
  from digen_jax.models.text import text_cache  # pylint: disable=g-import-not-at-top

  def child(args):
    logging.info('tiny_pipeline: %s', ' '.join(args))
    done = subprocess.run([sys.executable, '-m', *args], check=False)
    if done.returncode:
      cli.fail(f'{args[0]} exited with {done.returncode} while preparing the tiny pipeline')

  folder = config.model.checkpoint
  if not os.path.isfile(os.path.join(folder, 'model_index.json')):
    child(
        ['digen_jax.experiment.tiny_pipeline', f'--out={folder}', f'--family={config.model.family}']
    )
  config_flags = [a for a in sys.argv[1:] if a.startswith('--config')]
  data_dir = prompt_data.resolve_data_dir(config.data.data_dir, workdir)
  # verify=False: only the index is read here (the run's own open hashes every shard).
  try:
    cache = (
        text_cache.EmbeddingCache(config.text.cache, config.text.max_length, verify=False)
        if os.path.isdir(config.text.cache)
        else None
    )
  except ValueError as e:
    cli.fail(
        f'config.text.cache={config.text.cache!r} (config.text.max_length='
        f'{config.text.max_length}): {e}'
    )

  def prompts_of(split: str, field: str) -> list[str]:
    try:
      return list(
          prompt_data.load_prompts(
              config.data.prompts, split, data_dir, config.data.max_prompt_chars
          )
      )
    except ValueError as e:
      cli.fail(f'config.data.prompts={config.data.prompts!r} ({field}={split!r}): {e}')

  missing = [
      split
      for split, field in {
          config.data.split: 'config.data.split',
          config.eval.split: 'config.eval.split',
      }.items()
      if cache is None or cache.missing(prompts_of(split, field))
  ]
  if missing:  # one child for every split: the text encoders load once (torch's start is ~7 s)
    child(
        [
            'digen_jax.encode_prompts',
            *config_flags,
            f'--prompts={config.data.prompts}',
            f'--split={",".join(missing)}',
            f'--data_dir={data_dir}',
            f'--out={config.text.cache}',
        ]
    )


def _run(info):
  """One run per workdir, decided before anything is written there (data/, config.json,
  metrics, checkpoints): a lone process took its lock in main; a job's processes share one."""
  config, workdir, n = cli.setup()
  job_lock = _lock_workdir(workdir, info) if info.num_processes > 1 else None
  try:
    _train(info, config, workdir, n)
  finally:
    if job_lock is not None:
      job_lock.release()


def _lock_workdir(workdir: str, info):
  """A multi-process run's workdir lock: process 0 takes it (and holds it for the run), the
  others learn the outcome from the key-value store and refuse with the same line."""
  import json  # pylint: disable=g-import-not-at-top
  from digen_jax.process import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top

  key = 'digen/workdir_lock'
  if info.process_id != 0:
    outcome = json.loads(distributed.kv_get(key, timeout_s=600))
    if outcome['error']:
      # Said and acknowledged before process 0, which hosts the jax.distributed service, exits
      # (its exit aborts this process). The launcher's SIGTERM, sent once process 0 has exited,
      # may come before this process's own exit: it is ending with its line already.
      for sig in interrupt.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
      peers.last_line(f'digen_jax: {outcome["error"]}')
      try:
        distributed.kv_set(f'{key}/read/{info.process_id}', '1')
      except Exception:  # pylint: disable=broad-except  (process 0 may leave before the reply)
        pass
      os._exit(1)
    return None
  try:
    lock = workdir_lib.acquire(workdir, processes=info.num_processes)
  except workdir_lib.WorkdirError as e:
    distributed.kv_set(key, json.dumps({'error': str(e)}))
    for p in range(1, info.num_processes):
      try:
        distributed.kv_get(f'{key}/read/{p}', timeout_s=30)
      except Exception:  # pylint: disable=broad-except  (a peer that is gone reads nothing)
        pass
    raise
  distributed.kv_set(key, json.dumps({'error': None}))
  return lock


def _train(info, config, workdir: str, n: int):
  from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top  (after absl parsed flags such as --jax_*)
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)
  from digen_jax.experiment import entry  # pylint: disable=g-import-not-at-top
  from digen_jax.outputs import report  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import loop  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import transfer  # pylint: disable=g-import-not-at-top

  interrupt.install(config.runtime.shutdown_timeout_s)  # after jax.distributed's own handler
  if info.num_processes == 1:
    # Until the first update (runtime/loop.py) nothing is lost by stopping: a signal during the
    # start (restoring, compiling for minutes) exits at once in one line. (Two processes stop
    # together through the schedule's safe points.)
    interrupt.nothing_to_save('before its first update (while starting or compiling)')
  tiny_pipeline = config.model.get('build_tiny_pipeline', False)
  if config.runtime.mode != 'disagg':
    if info.num_processes > 1:
      cli.fail(
          f'config.runtime.mode={config.runtime.mode!r} runs in one process, but this job has '
          f'{info.num_processes}; use --config.runtime.mode=disagg (e.g. '
          'configs/qwenimage.py:tiny_disagg) or launch one process'
      )
    if tiny_pipeline:
      prepare_tiny_pipeline(config, workdir)
    exp = entry.build_experiment(config, workdir, n)  # also rejects unknown modes
    for line in entry.check_resume(workdir, exp, config):
      logging.info('%s', line)
    logging.info(
        'workdir %s  mode %s  devices %d  batch %d', workdir, config.runtime.mode, n, exp.batch_size
    )
    cluster = cluster_lib.colocated(jax.local_devices()[:n], exp.publish.param_dtype)
    loop.train(exp, workdir, cluster)
    report.finish(workdir)
    return

  try:
    cluster = cluster_lib.resolve(run_lib.cluster_spec(config))
  except ValueError as e:
    cli.fail(str(e))
  writer = info.process_id == cluster.writer_process
  peers.set_roles({p: cluster.role_of(p) for p in range(info.num_processes)})
  # The fragment plan lays fragments out for a device count both roles divide (padding rows of
  # weight 0 where the batch does not divide it: experiment/fragments.py).
  n_check = math.lcm(cluster.rollout.size, cluster.trainer.size)
  if info.num_processes > 1 and not writer:
    distributed.barrier('digen/experiment_built', timeout_s=1800)  # the writer prepares data first
  elif tiny_pipeline:
    prepare_tiny_pipeline(config, workdir)
  exp = entry.build_experiment(config, workdir, n_check)
  for line in entry.check_resume(workdir, exp, config, record=writer):
    logging.info('%s', line)
  transfer.set_host(config.cluster.transfer_host)  # checked by configlib.validate above
  if info.num_processes > 1 and writer:
    distributed.barrier('digen/experiment_built', timeout_s=1800)
  logging.info(
      'workdir %s  mode disagg  process %d/%d (%s)  pid %d  batch %d  %s',
      workdir,
      info.process_id,
      info.num_processes,
      cluster.role_of(info.process_id),
      os.getpid(),
      exp.batch_size,
      cluster.describe(),
  )
  loop.train(exp, workdir, cluster)
  if writer:
    report.finish(workdir)


if __name__ == '__main__':
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__, ('digen_jax.process.cli',))
  app.run(main, flags_parser=cli.parse_flags)
