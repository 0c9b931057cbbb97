"""An override of a field the config lacks, said in full: the override as typed, the path of the
section it reaches, and the nearest valid names there. No flags are defined here (plan defines
its own --config beside it)."""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections


def _load(config_arg: str):
  """The ConfigDict of --config=PATH[:variant] (None when it cannot be loaded: the caller keeps
  its own message)."""
  path, _, variant = config_arg.partition(':')
  if not os.path.isfile(path):
    return None
  try:
    spec = importlib.util.spec_from_file_location('_digen_config_for_error', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception:  # pylint: disable=broad-except  (the error being explained is the user's)
    return None


def _broken(override: str, config) -> tuple[str, str] | None:
  """(the name that does not resolve, the message) for an override whose path leaves the config,
  else None."""
  flag = override.split('=', 1)[0]
  path = flag[len('--config.') :].split('.')
  node, where = config, 'config'
  for i, name in enumerate(path):
    if not isinstance(node, ml_collections.ConfigDict):
      return name, (
          f'{flag}: {where} = {node!r} ({type(node).__name__}), not a section: it has no '
          f'field {name!r}'
      )
    if name not in node:
      fields = sorted(node.keys())
      near = difflib.get_close_matches(name, fields, n=3, cutoff=0.5)
      hint = f'nearest: {", ".join(near)}' if near else 'no field is close'
      rest = '.'.join(path[i + 1 :])
      return name, (
          f'{flag}: {where} has no field {name!r}'
          + (f' (so no {where}.{name}.{rest})' if rest else '')
          + f'; {hint}; {where} has: {", ".join(fields)}'
      )
    node, where = node[name], f'{where}.{name}'
  return None


def unknown_field(argv: list[str], leaf: str = '') -> str | None:
  """'--config.rl.grup_size: config.rl has no field 'grup_size'; nearest: group_size; config.rl
  has: ...' for the override in argv whose path leaves the config (the one missing `leaf`
  first), or None when none does or the config cannot be loaded."""
  config_arg = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '')
  config = _load(config_arg) if config_arg else None
  if config is None:
    return None
  broken = [b for a in argv if a.startswith('--config.') and (b := _broken(a, config))]
  if not broken:
    return None
  return next((said for name, said in broken if name == leaf), broken[0][1])
