"""Shared pieces of the single-device benchmarks: the "bench-s" problem built in both frameworks, A/B
timing, the matmul roofline probe, compile-time and peak-memory measurement.

"bench-s" (fixed so figures compare across time): QwenImage transformer, 4 layers, 4 heads x 64, joint_attention_dim
256, in_channels 64 (16 latent channels packed 2x2), out_channels 16, axes_dims_rope (16, 24, 24); a 32x32 latent
(16x16 = 256 image tokens), 32 text tokens with a full mask, batch 8, 10 Euler steps, static shift 3.0, no CFG,
float32. ``SIZES["tiny"]`` is a seconds-long version for the smoke test.

Fairness: torch runs with ``torch.set_num_threads(2)`` (``setup_torch``); XLA's CPU client uses its default intra-op
pool, one thread per core (2 here). Both run in the same process, alternating call by call, with a short pause between
calls so that neither framework's spinning worker threads (OpenMP, Eigen) eat into the other's timed call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

# Make `import digen_jax` work when run as `python benchmarks/x.py` from the repo root or elsewhere.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

TORCH_THREADS = 2
SETTLE_S = (
    0.15  # pause between alternating calls (lets OpenMP / Eigen spin-waiting threads go to sleep)
)


@dataclasses.dataclass(frozen=True)
class BenchSize:
  """A benchmark problem: diffusers transformer config plus the sampling/training shape."""

  name: str
  model: dict  # QwenImageTransformer2DModel kwargs (also our MMDiTConfig via config_from_diffusers)
  latent_hw: tuple[int, int]  # latent pixels (before 2x2 packing)
  n_txt: int
  batch: int
  steps: int
  shift: float = 3.0

  @property
  def img_shape(self) -> tuple[int, int, int]:
    p = self.model["patch_size"]
    return (1, self.latent_hw[0] // p, self.latent_hw[1] // p)

  @property
  def n_img(self) -> int:
    return int(np.prod(self.img_shape))

  @property
  def latent_shape(self) -> tuple[int, int, int]:
    """Packed latents [B, N_img, in_channels]."""
    return (self.batch, self.n_img, self.model["in_channels"])


SIZES = {
    "bench-s": BenchSize(
        name="bench-s",
        model=dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=4,
            attention_head_dim=64,
            num_attention_heads=4,
            joint_attention_dim=256,
            axes_dims_rope=(16, 24, 24),
        ),
        latent_hw=(32, 32),
        n_txt=32,
        batch=8,
        steps=10,
    ),
    "tiny": BenchSize(
        name="tiny",
        model=dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=1,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(8, 12, 12),
        ),
        latent_hw=(8, 8),
        n_txt=8,
        batch=2,
        steps=3,
    ),
}


def get_size(name: str) -> BenchSize:
  if name not in SIZES:
    raise ValueError(f"--size={name!r}: use one of {sorted(SIZES)}")
  return SIZES[name]


# ----------------------------------------------------------------------------------------------------------------
# Building the same model in both frameworks.


def setup_torch():
  import torch

  torch.set_num_threads(TORCH_THREADS)
  return torch


def make_torch_model(size: BenchSize, seed: int = 0):
  """diffusers QwenImageTransformer2DModel with every tensor randomised (norm scales around 1, small biases),
  so that a parameter mapped to the wrong place shows up in the parity check."""
  torch = setup_torch()
  import diffusers

  torch.manual_seed(seed)
  model = diffusers.QwenImageTransformer2DModel(**size.model).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name and name.endswith(".weight") and p.ndim == 1:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.05 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))
  return model


def ours_from_torch(tmodel, **config_overrides):
  """Our MMDiT with the diffusers model's weights (digen_jax.models.io.convert)."""
  import jax.numpy as jnp
  from flax import nnx
  from digen_jax.models.io.convert import config_from_diffusers, load_diffusers_state
  from digen_jax.models.transformers.mmdit import MMDiT

  cfg = config_from_diffusers(dict(tmodel.config), **config_overrides)
  model = nnx.eval_shape(lambda: MMDiT(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32))
  sd = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
  return load_diffusers_state(model, sd)


def make_inputs(size: BenchSize, seed: int = 1) -> dict[str, np.ndarray]:
  """Initial noise [B, N_img, C_in], text embeddings [B, L, J] and a full text mask [B, L] (int64 ones)."""
  rng = np.random.default_rng(seed)
  return {
      "latents": rng.standard_normal(size.latent_shape, dtype=np.float32),
      "text": rng.standard_normal(
          (size.batch, size.n_txt, size.model["joint_attention_dim"]), dtype=np.float32
      ),
      "text_mask": np.ones((size.batch, size.n_txt), np.int64),
  }


def bench_sigmas(size: BenchSize) -> np.ndarray:
  """Our schedule for the benchmark: static shift, float32 [T+1]."""
  from digen_jax.diffusion.sigmas import SchedulerConfig, sigmas

  return sigmas(SchedulerConfig(shift=size.shift), size.steps)


def torch_scheduler(size: BenchSize):
  """diffusers FlowMatchEulerDiscreteScheduler set up the way QwenImagePipeline does (sigmas=linspace(1, 1/T, T)),
  with a static shift."""
  from diffusers import FlowMatchEulerDiscreteScheduler

  sched = FlowMatchEulerDiscreteScheduler(shift=size.shift, use_dynamic_shifting=False)
  sched.set_timesteps(sigmas=np.linspace(1.0, 1 / size.steps, size.steps))
  return sched


def torch_forward(tmodel, latents, sigma, text, size: BenchSize, text_mask=None):
  """One diffusers forward exactly as QwenImagePipeline calls it (timestep = t / 1000 = sigma). The pipeline
  drops an all-ones prompt mask (``encoder_hidden_states_mask=None``), which is also torch's fastest path.
  """
  return tmodel(
      hidden_states=latents,
      timestep=sigma,
      guidance=None,
      encoder_hidden_states_mask=text_mask,
      encoder_hidden_states=text,
      img_shapes=[[size.img_shape]] * latents.shape[0],
      return_dict=False,
  )[0]


# ----------------------------------------------------------------------------------------------------------------
# Timing.


def block(x):
  """Wait for every JAX array in a pytree (no-op for torch tensors / numpy)."""
  import jax

  return jax.block_until_ready(x)


def alternate(
    fns: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    settle_s: float = SETTLE_S,
    progress: bool = False,
) -> dict[str, list[float]]:
  """Time each zero-arg callable `repeats` times, interleaved A, B, C, ... with the order reversed every other
  round (so no callable always follows the same neighbour). Warm-up calls are run first and not timed.
  Each callable must finish its work before returning (block on JAX outputs). Returns {name: [seconds]}.
  """
  names = list(fns)
  for _ in range(warmup):
    for n in names:
      fns[n]()
  times = {n: [] for n in names}
  for r in range(repeats):
    for n in (names if r % 2 == 0 else names[::-1]):
      time.sleep(settle_s)
      t0 = time.perf_counter()
      fns[n]()
      times[n].append(time.perf_counter() - t0)
    if progress:  # one line per round, so a run cut short still leaves its rounds on stdout
      print(
          f"  round {r + 1}/{repeats}: "
          + ", ".join(f"{n} {1e3 * times[n][-1]:.0f} ms" for n in names),
          flush=True,
      )
  return times


def median(xs) -> float:
  return float(statistics.median(xs))


def spread(xs) -> str:
  """'median (min-max)' in ms."""
  return f"{1e3 * median(xs):.1f} ms ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


# ----------------------------------------------------------------------------------------------------------------
# Matmul roofline: what a plain float32 matmul reaches on this machine, measured in the same run.

ROOFLINE_N = 1536  # square float32 matmul: compute-bound, and one fits in L3 with room to spare


def probe_reps(flops: float, n: int = ROOFLINE_N) -> int:
  """How many chained n^3 matmuls do about `flops` FLOPs. The probe is sized like the call it is compared with,
  so that on a shared machine both see the same mix of quiet and contended time slices (a 40 ms probe next to
  a 2 s sampling call would catch quiet moments more often and overstate the roofline or understate it).
  """
  return max(1, int(round(flops / (2.0 * n**3))))


def jax_matmul_probe(n: int = ROOFLINE_N, reps: int = 1):
  """(callable running `reps` chained jitted [n,n]@[n,n] float32 matmuls to completion, their FLOPs).
  Chained (x <- x @ b) inside one lax.fori_loop so the matmuls run one after another, as the model's do.
  """
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
  b = jnp.asarray(
      rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)
  )  # keeps |x| ~ constant
  mm = jax.jit(lambda a, b: jax.lax.fori_loop(0, reps, lambda i, x: x @ b, a))
  mm(a, b).block_until_ready()
  return (lambda: mm(a, b).block_until_ready()), 2.0 * n**3 * reps


def torch_matmul_probe(n: int = ROOFLINE_N, reps: int = 1):
  torch = setup_torch()
  g = torch.Generator().manual_seed(0)
  a = torch.randn(n, n, generator=g)
  b = torch.randn(n, n, generator=g) / math.sqrt(n)

  def run():
    x = a
    for _ in range(reps):
      x = torch.mm(x, b)
    return x

  return run, 2.0 * n**3 * reps


# ----------------------------------------------------------------------------------------------------------------
# Compilation.


def compile_seconds(jitted, *args, **kwargs) -> tuple[Any, float, float]:
  """(compiled, lower_s, compile_s) of a jax.jit function for these arguments, with JAX's persistent compilation
  cache disabled for the call and JAX's in-memory caches cleared first, so the figure is a cold compile whatever
  ran before (jitted functions recompile on their next call)."""
  import jax

  prev = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  jax.clear_caches()
  try:
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
  finally:
    jax.config.update("jax_enable_compilation_cache", prev)
  return compiled, t1 - t0, t2 - t1


def warm_cache_compile_seconds(jitted, *args, **kwargs) -> float | None:
  """Compile time when JAX's persistent compilation cache already holds the program (a restarted run): compile
  once into a fresh temporary cache, drop the in-memory caches, compile again (a disk-cache hit) and time that.
  Clears JAX's in-memory caches (jitted functions recompile on their next call). Returns None if this jax wrote nothing to the cache (persistent cache unsupported here).
  """
  import tempfile
  import jax
  from jax._src import compilation_cache as cc  # reset_cache: the cache module memoises its first set-up

  keys = (
      "jax_compilation_cache_dir",
      "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes",
      "jax_enable_compilation_cache",
  )
  prev = {k: getattr(jax.config, k) for k in keys}
  with tempfile.TemporaryDirectory(prefix="digen_cc_") as d:
    try:
      cc.reset_cache()
      jax.config.update("jax_enable_compilation_cache", True)
      jax.config.update("jax_compilation_cache_dir", d)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      jax.config.update(
          "jax_persistent_cache_min_entry_size_bytes", 1
      )  # 0 would mean "jax's default"
      jax.clear_caches()  # else the in-memory executable cache answers and nothing reaches the disk cache
      jitted.lower(*args, **kwargs).compile()
      if not any(os.scandir(d)):
        return None
      jax.clear_caches()
      t0 = time.perf_counter()
      jitted.lower(*args, **kwargs).compile()
      return time.perf_counter() - t0
    finally:
      for k, v in prev.items():
        jax.config.update(k, v)
      cc.reset_cache()


# ----------------------------------------------------------------------------------------------------------------
# Peak memory: measured in a child process per framework (one process's high-water mark cannot be split between two
# frameworks). Linux: /proc/self/clear_refs "5" resets VmHWM, so the step's own peak is HWM - RSS before the step.


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def release_free_memory() -> bool:
  """glibc malloc_trim(0): hand freed heap pages back to the OS so that RSS counts live memory only (both XLA's
  CPU buffers and torch's CPU tensors come from malloc). False where unavailable."""
  try:
    import ctypes

    return bool(ctypes.CDLL("libc.so.6").malloc_trim(0)) or True
  except (OSError, AttributeError):
    return False


def measure_peak_rss(step: Callable[[], Any]) -> dict[str, float]:
  """Run `step` once (already warmed up: compiled, optimizer state allocated) and return {"live_mib",
  "peak_mib", "step_extra_mib"}: the process's RSS before the step once freed memory is returned to the OS
  (params, optimizer state, data, runtime), its high-water mark during the step, and the difference: what the
  step itself needs on top (activations, gradients, temporaries, new params before the old are freed).
  """
  release_free_memory()
  ok = reset_peak_rss()
  before = _status_kb("VmRSS")
  step()
  peak = _status_kb("VmHWM")
  if not ok:  # HWM could not be reset: it may date from before the step (e.g. compilation); say so
    peak = max(peak, before)
  return {
      "live_mib": before / 1024,
      "peak_mib": peak / 1024,
      "step_extra_mib": (peak - before) / 1024,
      "hwm_reset": ok,
  }


def run_child(script: str, args: list[str], timeout: int = 1800) -> dict:
  """Run `python script args...` and parse the last stdout line as JSON (memory probes)."""
  from digen_jax.perf import devices  # pylint: disable=g-import-not-at-top

  env = dict(os.environ)
  # No fake multi-device CPU in a single-device benchmark; the caller's other XLA flags stay.
  env["XLA_FLAGS"] = devices.flags_with_device_count(env.get("XLA_FLAGS", ""), None)
  out = subprocess.run(
      [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env
  )
  if out.returncode != 0:
    raise RuntimeError(
        f"{script} {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-4000:]}"
    )
  return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# Reporting.


def machine_info() -> dict:
  import jax

  info = {
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "cpu_count": os.cpu_count(),
      "jax_devices": [str(d) for d in jax.devices()],
      "date": time.strftime("%Y-%m-%d %H:%M %Z"),
  }
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    info["cpu"] = names[0] if names else "?"
  except OSError:
    info["cpu"] = "?"
  try:
    import torch
    import diffusers

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["diffusers"] = diffusers.__version__
  except ImportError:
    pass
  info["load_avg_1m"] = os.getloadavg()[0]
  return info


def rel_err(a, b) -> float:
  """max |a - b| / max |b| in float64."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def write_json(path: str | None, payload: dict):
  if path:
    with open(path, "w") as f:
      json.dump(payload, f, indent=2, sort_keys=True)
