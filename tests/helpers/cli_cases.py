"""Many entry-point command lines through one forking process (tests/cli_zygote.py), and what a
failed start must look like: one last stderr line, nothing written to its workdir."""

import json
import os
import subprocess
import sys

from tests.helpers import xla_env
from tests.helpers.paths import REPO


def run_cases(cases, env_extra=None, timeout_s=120):
  """[(id, argv, workdir)] through tests/cli_zygote.py -> {id: result}."""
  payload = [{'id': i, 'argv': argv, 'cwd': REPO, 'timeout_s': timeout_s} for i, argv, _ in cases]
  env = xla_env.env_with_devices(4, JAX_PLATFORMS='cpu', **(env_extra or {}))
  r = subprocess.run(
      [sys.executable, os.path.join(REPO, 'tests', 'cli_zygote.py')],
      input=json.dumps(payload),
      capture_output=True,
      text=True,
      cwd=REPO,
      env=env,
      timeout=60 + timeout_s * len(cases),
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return {x['id']: x for x in json.loads(r.stdout)}


def last_line(stderr: str) -> str:
  lines = [l for l in stderr.splitlines() if l.strip()]
  return lines[-1] if lines else ''


def written(workdir) -> list[str]:
  """What a failed start left in its workdir that a run would read back (data/ is only the
  prompt datasets, built and checked per content)."""
  if not os.path.isdir(workdir):
    return []
  return sorted(n for n in os.listdir(workdir) if n != 'data')
