"""--help for every entry point: its usage and its own flags, exit 0, before anything heavy is
imported or any flag parsed. No flags are defined here, so an entry point with flags of its own
(plan, export, perf.costs) can import it beside them."""

from __future__ import annotations

import sys

from absl import flags

HELP_ARGS = ('--help', '-h', '-help', '--helpshort', '--helpfull', '-?')


def exit_on_help(argv: list[str], usage: str, modules: tuple[str, ...] = ()):
  """With --help (or -h): the entry point's usage and its own flags on stdout, exit 0, before
  anything is imported or parsed. absl's --help exits 1 and lists only the flags of the module
  run as __main__; `modules` names the others whose flags the entry point takes."""
  if not any(a in HELP_ARGS for a in argv[1:]):
    return
  parts = [usage.strip(), '']
  own = flags.FLAGS.main_module_help().strip()
  if own:
    parts.append(own)
  for module in modules:
    text = flags.FLAGS.module_help(module).strip()
    if text:
      parts.append(text)
  print('\n'.join(parts))
  sys.exit(0)
