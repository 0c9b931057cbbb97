"""What every entry point (main, eval, pretrain) shares: the --config/--workdir flags, a flag parser
that turns bad input into one clear line, quiet library logs. The experiment build with bad input
as one line is experiment/entry.py's (this module sits below the builder and knows nothing of it).
"""

from __future__ import annotations

import logging as logging_std
import os
import re
import sys
import traceback

from absl import flags
from absl import logging
from ml_collections import config_flags

from digen_jax.process import config_errors

CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file, e.g. configs/qwenimage.py:tiny.'
)
WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (metrics, checkpoints, samples).')
flags.mark_flags_as_required(['config', 'workdir'])
# The checkout's root (digen_jax/process/cli.py is three levels down): relative --config paths.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(message: str):
  sys.exit(f'digen_jax: {message}')


def _unquote(text: str) -> str:
  """Drops one pair of quotes around the whole text (str() of a KeyError adds them); a quote
  that only ends the text belongs to it (invalid literal ...: 'abc')."""
  if len(text) >= 2 and text[0] == text[-1] and text[0] in '\'"':
    return text[1:-1]
  return text


def _config_file_error(e: BaseException) -> BaseException | None:
  """What the config file raised, when ml_collections rebuilt it: it re-raises a TypeError or
  ValueError from get_config() as type(e)(its traceback as text), and that fails for a
  UnicodeDecodeError (5 arguments: 'function takes exactly 5 arguments (1 given)')."""
  rebuilt = e.__context__
  if (
      isinstance(rebuilt, (TypeError, ValueError))
      and rebuilt.__context__ is not None
      and rebuilt.__traceback__
  ):
    if traceback.extract_tb(rebuilt.__traceback__)[-1].filename.endswith('config_flags.py'):
      return rebuilt.__context__
  return None


def repo_config_path(argv: list[str]) -> list[str]:
  """argv with a --config=PATH[:variant] whose relative PATH is not a file here but is one under
  the checkout's root (configs/qwenimage.py) made absolute, so entry points run from any
  directory; every other argument as it is."""
  out = []
  for arg in argv:
    if arg.startswith('--config='):
      path, colon, variant = arg[len('--config=') :].partition(':')
      if path and not os.path.isabs(path) and not os.path.isfile(path):
        here = os.path.join(REPO, path)
        if os.path.isfile(here):
          arg = f'--config={here}{colon}{variant}'
    out.append(arg)
  return out


def _quoted_name(text: str) -> str:
  """The first 'quoted' name in an error text ('' when none)."""
  match = re.search(r"'([^'\\]+)'", text)
  return match.group(1) if match else ''


def parse_flags(argv):
  """absl's parser, but a bad config file/override is one clear line, not a traceback."""
  argv = repo_config_path(argv)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  (anything a config file raises is input)
    path = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '?')
    raised = _config_file_error(e)
    if raised is not None:
      fail(f'cannot load --config={path}: it raised {type(raised).__name__}: {raised}')
    text = _unquote(str(e)).replace("\\'", "'").replace('\\n', '\n')
    if not isinstance(
        e, (flags.Error, AttributeError, KeyError, ValueError, TypeError, OSError, SyntaxError)
    ):
      text = f'{type(e).__name__}: {text}'  # raised by the config file's own code
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if 'Traceback (most recent call last):' in lines:  # error raised inside a config file
      lines = [lines[0], lines[-1]]
    wrapped = e.args[0] if e.args else None
    if isinstance(e, SyntaxError) or isinstance(wrapped, SyntaxError):  # not a Python file
      fail(f'cannot load --config={path}: {" ".join(lines)} (not a Python config file?)')
    if isinstance(e, AttributeError) and "has no attribute 'get_config'" in str(e):
      fail(
          f'cannot load --config={path}: it defines no get_config() (a config file is Python '
          'with def get_config(variant=None) returning a ConfigDict, e.g. configs/shapes.py)'
      )
    if isinstance(e, (KeyError, AttributeError)) or isinstance(wrapped, KeyError):
      # An override whose path leaves the config (config_flags raises AttributeError(KeyError),
      # or AttributeError for a field of a leaf): the override, the section, the nearest names.
      said = config_errors.unknown_field(argv, _quoted_name(' '.join(lines)))
      if said:
        fail(f'bad --config: {said}')
    if isinstance(e, KeyError) or isinstance(wrapped, KeyError):
      lines = ['the config has no field ' + ' '.join(lines).replace("\\'", "'")]
    fail('bad --config: ' + ' '.join(lines))


def quiet_library_logs():
  """orbax logs every checkpoint phase at INFO through absl; keep our progress lines readable."""

  class _DropOrbaxInfo(logging_std.Filter):

    def filter(self, record):
      return record.levelno >= logging_std.WARNING or '/orbax/' not in record.pathname

  logging.get_absl_handler().addFilter(_DropOrbaxInfo())


def config_and_workdir():
  """The parsed config (a failed file load becomes one line) and --workdir."""
  try:
    config = CONFIG.value
    config.runtime  # pylint: disable=pointless-statement  (a failed load raises on first use)
  except Exception as e:  # pylint: disable=broad-except  (a deferred file load fails here)
    cause = e.__cause__ or e
    text = ' '.join(str(cause).split())
    if not isinstance(cause, OSError):
      text = f'{type(cause).__name__}: {text}'
    fail('cannot load --config: ' + text)
  return config, WORKDIR.value


def setup():
  """Common start of every entry point: logs, compilation cache, config. -> (config, workdir, n_dev)."""
  import jax  # pylint: disable=g-import-not-at-top
  from digen_jax.process import compile_cache  # pylint: disable=g-import-not-at-top

  from digen_jax.outputs import figures  # pylint: disable=g-import-not-at-top

  quiet_library_logs()
  try:
    figures.enabled()  # a bad DIGEN_PLOTS fails here, not after the run
  except ValueError as e:
    fail(str(e))
  compile_cache.enable()
  config, workdir = config_and_workdir()
  n = config.runtime.num_devices or jax.local_device_count()
  if n > jax.local_device_count():
    fail(f'config.runtime.num_devices={n} but only {jax.local_device_count()} local devices exist')
  return config, workdir, n
