"""Test session setup: fake several CPU devices before JAX is imported anywhere, and one JAX
compilation cache for the whole session (the tests and every process they start), so the same
tiny program is compiled once per session instead of once per test and process."""

import atexit
import os
import shutil
import tempfile

import pytest

from tests import run  # imports nothing from jax
from tests import xla_env  # imports nothing from jax

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
# A planner test whose costs are not in digen_jax/sim/costs_data/ fails at once instead of compiling the
# real programs for minutes (and writing into the repository): sim/cache.compute.
os.environ.setdefault("DIGEN_COSTS_CACHE_ONLY", "1")

if "DIGEN_DATA_DIR" not in os.environ:  # prompt datasets: one folder for the session's runs
  # A run whose config leaves data.data_dir empty prepares ShapesBench here once (under a lock)
  # instead of in every test's workdir (~0.6 s a run). Tests about a run's own data folder set
  # data.data_dir.
  _data = tempfile.mkdtemp(prefix="digen_test_data_")
  atexit.register(shutil.rmtree, _data, ignore_errors=True)
  os.environ["DIGEN_DATA_DIR"] = _data

# Seconds each slow test file took (setup + calls; `python -m pytest -n 2 --dist loadfile -m 'not
# serial' --durations=0` on a 2-core Intel Xeon host, 2026-11-28). tests/run.py hands files to its
# workers in collection order (--no-loadscope-reorder), so the longest go first and the many short
# ones fill the end: with xdist's default order (most tests first) a long file could start last
# and run on one worker while the other sat idle. Stale figures cost balance, never a test.
FILE_SECONDS = {
    "test_interrupt.py": 244,
    "test_schedule_modes.py": 200,
    "test_pretrain.py": 160,
    "test_sim_costs.py": 155,
    "test_qwenimage_pipeline.py": 145,
    "test_sweep.py": 131,
    "test_ratio_mmdit.py": 129,
    "test_flux_pipeline.py": 120,
    "test_ladder.py": 113,
    "test_benchmarks.py": 110,
    "test_shapes_rl.py": 97,
    "test_disagg.py": 85,
    "test_fuzz_cli.py": 70,
    "test_peers.py": 45,
    "test_memory_bench.py": 54,
    "test_rl.py": 39,
    "test_vae.py": 34,
    "test_faults_numeric.py": 30,
    "test_train.py": 29,
    "test_workdir.py": 25,
    "test_initialize.py": 29,
    "test_checker_adversarial.py": 25,
    "test_plan.py": 22,
    "test_rewards.py": 22,
    "test_streaming.py": 22,
    "test_flux_vae.py": 20,
    "test_checkpoint_faults.py": 18,
    "test_programs.py": 17,
    "test_encode_prompts.py": 16,
    # New on 2026-11-29: estimates from single runs of each file on a loaded 2-core AMD host.
    "test_ocr_pipeline.py": 260,
    "test_wan_pipeline.py": 200,
    "test_sequence_memory.py": 150,
    "test_bad_checkpoints.py": 100,
    "test_reward_workers.py": 90,
    "test_metrics_rows.py": 70,
    "test_sequence_parallel.py": 60,
    "test_preference_rewards.py": 50,
    "test_export.py": 45,
}


def pytest_collection_modifyitems(items):
  """Longest files first (FILE_SECONDS; unlisted files after, in their own order); a file's
  tests keep their order, so its module fixtures are built once. Also: tests/run.py's second
  phase collects only run.serial_files(); a serial test elsewhere would never run."""
  weight = lambda item: -FILE_SECONDS.get(item.path.name, 0)
  items.sort(key=weight)  # stable
  scanned = {os.path.join(run.REPO, f) for f in run.serial_files()}
  missed = sorted({str(i.path) for i in items if i.get_closest_marker("serial")} - scanned)
  if missed:
    raise pytest.UsageError(
        f"serial tests in {missed}, but tests/run.py.serial_files() does not find them: mark "
        f"them with the text {run.SERIAL_MARK!r}"
    )


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
