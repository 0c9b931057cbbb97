"""Runs many command lines of the package's CLIs fast: imports the heavy libraries once, then forks
one child per case, which runs the entry point as `python -m MODULE ARGS` / `python SCRIPT ARGS`
would (runpy, as __main__, its own argv, stdout/stderr to files, its own exit code).

  python tests/cli_zygote.py < cases.json > results.json

cases: [{"id", "argv": ["-m", "digen_jax.main", ...] or ["launch/sweep.py", ...], "cwd",
"timeout_s"}]; results: [{"id", "code", "stdout", "stderr", "seconds"}] (code -9: timed out).
Nothing here initialises a JAX backend or defines a flag before the fork: every child starts
from the state a fresh interpreter reaches after these imports.
"""

import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback

# `python -m` puts the working directory first on sys.path; the package is imported from there.
sys.path.insert(0, os.getcwd())

# The libraries every entry point imports; none of them defines absl flags or starts a backend.
import jax  # noqa: F401
import flax.nnx  # noqa: F401
import orbax.checkpoint  # noqa: F401
import optax  # noqa: F401
import tensorflow_datasets  # noqa: F401
import digen_jax.experiment.build  # noqa: F401
import digen_jax.runtime.loop  # noqa: F401
import digen_jax.tasks  # noqa: F401


def _child(case: dict, out: str, err: str) -> None:
  fd_out, fd_err = os.open(out, os.O_WRONLY), os.open(err, os.O_WRONLY)
  os.dup2(fd_out, 1)
  os.dup2(fd_err, 2)
  os.chdir(case['cwd'])
  argv = case['argv']
  code = 1
  try:
    if argv[0] == '-m':
      sys.path[0] = case['cwd']
      sys.argv = [argv[1]] + argv[2:]
      runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
    else:
      sys.argv = list(argv)
      sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
      runpy.run_path(argv[0], run_name='__main__')
    code = 0
  except SystemExit as e:
    if e.code is None:
      code = 0
    elif isinstance(e.code, int):
      code = e.code
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # pylint: disable=broad-except  (what an interpreter prints and exits 1)
    traceback.print_exc()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main():
  cases = json.load(sys.stdin)
  results = []
  tmp = tempfile.mkdtemp(prefix='cli_zygote_')
  for i, case in enumerate(cases):
    out, err = os.path.join(tmp, f'{i}.out'), os.path.join(tmp, f'{i}.err')
    open(out, 'w').close()
    open(err, 'w').close()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
      _child(case, out, err)
    deadline = t0 + case.get('timeout_s', 120)
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        code = os.waitstatus_to_exitcode(status)
        break
      if time.perf_counter() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        code = -9
        break
      time.sleep(0.02)
    results.append(
        {
            'id': case['id'],
            'code': code,
            'seconds': time.perf_counter() - t0,
            'stdout': open(out, errors='replace').read(),
            'stderr': open(err, errors='replace').read(),
        }
    )
  shutil.rmtree(tmp, ignore_errors=True)
  json.dump(results, sys.stdout)


if __name__ == '__main__':
  main()
