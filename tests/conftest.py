"""Test session setup: fake several CPU devices before JAX is imported anywhere, and one JAX
compilation cache for the whole session (the tests and every process they start), so the same
tiny program is compiled once per session instead of once per test and process."""

import atexit
import os
import shutil
import tempfile

import pytest

from tests import run  # imports nothing from jax
from tests.helpers import xla_env  # imports nothing from jax
from tests.helpers import durations  # imports nothing from jax
from tests.helpers import paths
from tests.helpers.paths import REPO

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=4",
        *xla_env.COMPILE_FAST_FLAGS,
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "DIGEN_COMPILATION_CACHE" not in os.environ:  # a cold cache per session, never ~/.cache
  _cache = tempfile.mkdtemp(prefix="digen_test_jax_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["DIGEN_COMPILATION_CACHE"] = _cache  # the CLIs' compile_cache.enable()
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache  # in-process programs and library subprocesses
  # Every program, however small: each process of the suite would otherwise recompile its few
  # dozen sub-0.5 s programs (about 1 s a process).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The session's runs skip reward.png and timeline.png (about a second each: matplotlib); the
# tests that check the figures ask for them with the `plots` fixture.
os.environ.setdefault("DIGEN_PLOTS", "0")
# A planner test whose costs are not in digen_jax/perf/costs_data/ fails at once instead of compiling the
# real programs for minutes (and writing into the repository): perf/cache.compute.
os.environ.setdefault("DIGEN_COSTS_CACHE_ONLY", "1")

if "DIGEN_DATA_DIR" not in os.environ:  # prompt datasets: one folder for the session's runs
  # A run whose config leaves data.data_dir empty prepares ShapesBench here once (under a lock)
  # instead of in every test's workdir (~0.6 s a run). Tests about a run's own data folder set
  # data.data_dir.
  _data = tempfile.mkdtemp(prefix="digen_test_data_")
  atexit.register(shutil.rmtree, _data, ignore_errors=True)
  os.environ["DIGEN_DATA_DIR"] = _data


def pytest_addoption(parser):
  parser.addoption(
      durations.OPTION,
      action="store_true",
      help=f"merge this run's seconds per test file into {durations.file_key(durations.PATH)}",
  )


def pytest_configure(config):
  # In xdist's controller only: the workers' reports reach it, and one process writes the file.
  if config.getoption(durations.OPTION) and not hasattr(config, "workerinput"):
    config.pluginmanager.register(durations.Recorder(), "digen_durations")


def pytest_collection_modifyitems(items):
  """Longest files first (tests/durations.json, pytest's own figures; a file it lacks after the
  listed ones, in its own order); a file's tests keep their order, so its module fixtures are
  built once. Also: tests/run.py's second phase collects only run.serial_files(); a serial test
  elsewhere would never run."""
  durations.order(items, durations.load())
  loose = sorted({f for f in map(_folder_without_init, {i.path.parent for i in items}) if f})
  if loose:
    raise pytest.UsageError(
        f"{loose}: add an __init__.py (the suite is one package, `tests`, so test files in "
        "different folders may share a name)"
    )
  scanned = {os.path.join(REPO, f) for f in run.serial_files()}
  missed = sorted({str(i.path) for i in items if i.get_closest_marker("serial")} - scanned)
  if missed:
    raise pytest.UsageError(
        f"serial tests in {missed}, but tests/run.py.serial_files() does not find them: mark "
        f"them with the text {run.SERIAL_MARK!r}"
    )


def _folder_without_init(folder) -> str | None:
  """The first folder from `folder` up to tests/ that lacks an __init__.py, repo-relative (None
  when all have one, or for a folder outside tests/)."""
  folder, top = os.path.realpath(folder), os.path.realpath(paths.TESTS)
  if os.path.commonpath([folder, top]) != top:
    return None
  if not os.path.isfile(os.path.join(folder, "__init__.py")):
    return os.path.relpath(folder, REPO)
  return None if folder == top else _folder_without_init(os.path.dirname(folder))


@pytest.fixture
def plots(monkeypatch):
  """DIGEN_PLOTS=1 for this test and the processes it starts: the runs draw their figures."""
  monkeypatch.setenv("DIGEN_PLOTS", "1")


@pytest.fixture(scope="session", autouse=True)
def tasks_registered():
  """The built-in tasks' prompt sets, rewards, vocabulary, latent space and eval metrics
  registered, as the entry points register them (the core never imports digen_jax.tasks).
  Imported here, after collection, so no test module's own device set-up runs after jax."""
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top
