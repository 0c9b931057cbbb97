"""python -m digen_jax.eval --config=configs/X.py --workdir=DIR

Evaluates the latest checkpoint in DIR/checkpoints (or the config's initial model when there is
none) on the eval split: strict accuracy and mean reward with deterministic ODE sampling and
eval.samples_per_prompt samples per prompt. Appends a row to metrics.jsonl and writes
DIR/eval/eval_<step>.json and .png."""

from __future__ import annotations

import os
import sys

from absl import app
from absl import logging

from digen_jax.process import cli
from digen_jax.outputs import faults


def main(argv):
  del argv
  from digen_jax.process import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  config, workdir, n = cli.setup()
  # eval appends to metrics.jsonl and writes eval/: not beside a run training in this workdir.
  try:
    lock = workdir_lib.acquire(workdir)
  except faults.RunError as e:
    cli.fail(str(e))
  try:
    _evaluate(config, workdir, n)
  finally:
    lock.release()


def _evaluate(config, workdir: str, n: int):
  import jax  # pylint: disable=g-import-not-at-top
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)
  from digen_jax.experiment import entry  # pylint: disable=g-import-not-at-top
  from digen_jax.outputs import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import evaluation  # pylint: disable=g-import-not-at-top
  from digen_jax.outputs import eval_report  # pylint: disable=g-import-not-at-top
  from digen_jax.outputs import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  exp = entry.build_experiment(config, workdir, n)
  mesh = mesh_lib.make_mesh(jax.local_devices()[:n])
  from digen_jax.experiment import weights as weights_lib  # pylint: disable=g-import-not-at-top

  params, step = weights_lib.host_params(exp.weights), 0
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  if os.path.isdir(ckpt_dir):
    checkpointer = ckpt_lib.Checkpointer(ckpt_dir)
    template = {
        'params': params,
        'opt_state': jax.eval_shape(exp.optimizer.init, params),
        'rng': ckpt_lib.key_to_data(jax.random.key(0)),
    }
    try:
      # The newest readable step; eval only reads, so a corrupt one stays where it is.
      restored = checkpointer.restore_latest(template, move_aside=False)
    except faults.RunError as e:
      checkpointer.close()
      cli.fail(str(e))
    if restored is not None:
      step, state, _ = restored
      params = state['params']
    checkpointer.close()
  logging.info('evaluating %s at step %d', 'checkpoint' if step else 'the initial model', step)
  evaluator = evaluation.Evaluator(exp, mesh, evaluation.eval_prompts(exp, workdir))
  result = evaluator(params, seed=config.eval.seed)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=False)
  writer.write({'step': step, **result['metrics']})
  writer.close()
  grid = eval_report.write_report(result, os.path.join(workdir, 'eval'), step)
  print(f"digen_jax eval: step={step} {result['metrics']} grid={grid}", flush=True)


if __name__ == '__main__':
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__, ('digen_jax.process.cli',))
  app.run(main, flags_parser=cli.parse_flags)
