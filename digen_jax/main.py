"""Entry point: python -m digen_jax.main --config=configs/X.py[:variant] --workdir=DIR [--config.a.b=v]."""
from __future__ import annotations

import logging as logging_std
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/qwenimage.py:tiny.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (metrics, checkpoints, samples).')
flags.mark_flags_as_required(['config', 'workdir'])


def _quiet_library_logs():
  """orbax logs every checkpoint phase at INFO through absl; keep our progress lines readable."""
  class _DropOrbaxInfo(logging_std.Filter):
    def filter(self, record):
      return record.levelno >= logging_std.WARNING or '/orbax/' not in record.pathname
  logging.get_absl_handler().addFilter(_DropOrbaxInfo())


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top  (after absl parsed flags such as --jax_*)
  from digen_jax import experiment  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import colocated  # pylint: disable=g-import-not-at-top

  _quiet_library_logs()
  try:
    config, workdir = _CONFIG.value, _WORKDIR.value
    config.runtime  # pylint: disable=pointless-statement  (a failed load raises on first use)
  except OSError as e:  # config_flags defers a failed file load to the first access
    cause = e.__cause__ or e
    sys.exit('digen_jax: cannot load --config: ' + ' '.join(str(cause).split()))
  n = config.runtime.num_devices or jax.local_device_count()
  if n > jax.local_device_count():
    sys.exit(f'digen_jax: config.runtime.num_devices={n} but only {jax.local_device_count()} '
             'local devices exist')
  try:
    exp = experiment.build(config, workdir, n)
  except ValueError as e:  # bad input: one clear line, before anything compiles or is written
    sys.exit(f'digen_jax: {e}')
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  logging.info('workdir %s  mode %s  devices %d  batch %d', workdir, config.runtime.mode, n,
               exp.batch_size)
  colocated.train(exp, workdir, devices=jax.local_devices()[:n])


def parse_flags(argv):
  """absl's parser, but a bad config file/override is one clear line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError, OSError) as e:
    text = str(e).strip('\'"').replace("\\'", "'").replace('\\n', '\n')
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if 'Traceback (most recent call last):' in lines:   # error raised inside a config file
      lines = [lines[0], lines[-1]]
    message = ' '.join(lines)
    sys.exit(f'digen_jax: bad --config: {message}')


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
