"""Entry point: python -m digen_jax.main --config=configs/X.py[:variant] --workdir=DIR [--config.a.b=v]."""
from __future__ import annotations

from absl import app
from absl import logging

from digen_jax import cli


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top  (after absl parsed flags such as --jax_*)
  from digen_jax import report  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import colocated  # pylint: disable=g-import-not-at-top

  config, workdir, n = cli.setup()
  exp = cli.build_experiment(config, workdir, n)
  cli.write_config(config, workdir)
  logging.info('workdir %s  mode %s  devices %d  batch %d', workdir, config.runtime.mode, n,
               exp.batch_size)
  colocated.train(exp, workdir, devices=jax.local_devices()[:n])
  report.finish(workdir)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
