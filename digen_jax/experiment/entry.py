"""The experiment build as the entry points (main, eval, the profiler) run it: the fields the
command line set explicitly passed along, and bad input one line before anything compiles."""

from __future__ import annotations

import sys

from digen_jax.experiment import build as experiment
from digen_jax.experiment import folder_config
from digen_jax.experiment import resume_guard
from digen_jax.process import cli


def build_experiment(config, workdir: str, num_devices: int):
  """experiment.build with bad input reported as one line before anything compiles or is written."""
  try:
    return experiment.build(
        config, workdir, num_devices, explicit=folder_config.explicit_fields(sys.argv[1:])
    )
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))


def check_resume(workdir: str, exp, config, *, record: bool = True) -> list[str]:
  """resume_guard.check for a run about to train in `workdir`: a resume under settings that
  change the run is one line before anything compiles; returns the accepted changes' lines."""
  try:
    return resume_guard.check(
        workdir, exp.output.config_json, config.runtime.resume_changed, record=record
    )
  except ValueError as e:
    cli.fail(str(e))
