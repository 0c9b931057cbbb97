"""`--help` on every entry point: its usage and its own flags on stdout, exit 0 (absl's own
--help exits 1, and plan's parser refused the flag outright)."""

import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

# entry point -> (a line of its usage, flags it must list)
ENTRY_POINTS = {
    'digen_jax.main': ('Entry point: python -m digen_jax.main', ('--config', '--workdir')),
    'digen_jax.eval': ('digen_jax.eval', ('--config', '--workdir')),
    'digen_jax.plan': (
        'Plans a config on a described cluster',
        ('--cluster', '--prices', '--config'),
    ),
    'digen_jax.export': ('python -m digen_jax.export', ('--workdir', '--out')),
    'digen_jax.encode_prompts': ('encode_prompts', ('--prompts', '--batch_size', '--config')),
    'digen_jax.perf.costs': ('digen_jax.perf.costs', ('--config', '--programs')),
    'digen_jax.tasks.shapes.pretrain': ('pretrain', ('--config', '--workdir')),
}


# Every entry point with --help; -h once (the same code path: process/usage.py).
@pytest.mark.parametrize(
    'module, flag', [(m, '--help') for m in sorted(ENTRY_POINTS)] + [('digen_jax.plan', '-h')]
)
def test_help_prints_the_usage_and_its_flags_and_exits_0(module, flag):
  usage, names = ENTRY_POINTS[module]
  r = subprocess.run(
      [sys.executable, '-m', module, flag], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert usage in r.stdout, r.stdout[:500]
  for name in names:
    assert f'{name}:' in r.stdout, (module, name)
  assert 'Traceback' not in r.stderr and 'Try --helpfull' not in r.stdout
