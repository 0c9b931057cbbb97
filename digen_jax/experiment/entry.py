"""The experiment build as the entry points (main, eval, the profiler) run it: the fields the
command line set explicitly passed along, and bad input one line before anything compiles."""

from __future__ import annotations

import sys

from digen_jax.experiment import build as experiment
from digen_jax.experiment import folder_config
from digen_jax.process import cli


def build_experiment(config, workdir: str, num_devices: int):
  """experiment.build with bad input reported as one line before anything compiles or is written."""
  try:
    return experiment.build(
        config, workdir, num_devices, explicit=folder_config.explicit_fields(sys.argv[1:])
    )
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))
