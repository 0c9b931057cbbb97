"""Costs of a run's real programs from XLA's own analyses: FLOPs, bytes accessed and per-device
memory of the rollout, the GRPO fragment gradient and the optimizer apply, compiled ahead of time
for a 1-D mesh of N fake CPU devices (nothing is read or allocated: every argument is a
jax.ShapeDtypeStruct with its sharding).

(`python -m digen_jax.perf.costs` is the command line: perf/costs.py.)

Programs (digen_jax/programs.py, built as the runtime builds them):
  rollout   make_rollout: the whole sampling scan (CFG as one batched call where the config
            uses it) and the VAE decode; the rollout copy of the weights laid out as
            config.cluster.rollout.param_sharding (or --rollout_layout).
  grad      make_fragment_grad: one GAP fragment's GRPO forward + backward over the K trained
            steps (TSP when config.schedule.tsp), FSDP params and gradient accumulator.
  apply     make_apply: the optimizer step on the accumulated gradient (FSDP).

Trip counts. XLA's cost analysis counts a while loop's body ONCE: the sampler's T steps, the
model's layer scan, the VAE's lax.map chunks and an objective 'scan' over K steps would each
count as one iteration. The real program's figure is kept as `raw_*`; the counted figures come
from loop-free variants of the same program: every lax.scan / lax.map traced unrolled (see
`unrolled_loops`) and the model's layers unrolled (model.scan_layers=False), at small trip
counts, then extrapolated exactly. A program's cost is affine in its outer trip count t (T
sampler steps for the rollout, K trained steps for a fragment) and in each layer count L_k:

    cost(t, L) = a + sum_k L_k d_k + t (b + sum_k L_k c_k)

(d_k: per-layer work done once, e.g. the LoRA merge; c_k: per-layer work per step; b: per-step
work outside the layers, e.g. embeddings and the SDE step; a: the rest, e.g. the VAE decode).
2 + 2 * kinds compiles at t in {t1, t2} and L in {1, 1 + e_k} determine it (method
'extrapolate'); method 'unrolled' compiles the variant at the real trip counts instead (exact,
slow at real size: the tests use it as ground truth on toy sizes). What stays rolled: threefry's
5-round loops in jax.random (a few u32 ops per random word).

Memory (argument / output / alias / temp bytes per device) is XLA's buffer assignment of the
real program as the runtime compiles it (layers scanned as the config says). Figures are
XLA:CPU's: it has no native bf16 dot (bf16 operands are converted to f32, which inflates bytes
and temp memory; see benchmarks/memory.py's NOTES), and it fuses differently from XLA:GPU/TPU.
FLOP counts are op-level and do not depend on the backend's fusion.
"""

from __future__ import annotations

import sys

import contextlib
import copy
import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.parallel import mesh as mesh_lib
from digen_jax.perf import abstract
from digen_jax.perf import program_flops

PROGRAMS = ('rollout', 'grad', 'apply')
METHODS = ('extrapolate', 'unrolled', 'raw')
GIB = 1024**3
_COST_KEYS = ('flops', 'bytes accessed', 'transcendentals')


# ---------------------------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class Memory:
  """XLA's buffer assignment of one compiled program, bytes per device."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments (counted once)
  temp_bytes: int

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass
class ProgramCost:
  """One program on `devices` devices. FLOPs and bytes are per device, every loop iteration
  counted (see the module docstring); raw_* are XLA's figures for the real program (loop bodies
  once); analytic_flops counts the model's matmuls only (family.flops_per_forward)."""

  name: str
  devices: int
  batch: int  # samples in the program, all devices together
  flops: float
  bytes_accessed: float
  transcendentals: float
  analytic_flops: float
  memory: Memory
  raw_flops: float
  raw_bytes_accessed: float
  trip_counts: dict[str, int]  # {'steps': T or K, 'layers': L, ..., 'cfg_branches': 1|2}
  method: str  # how loops were counted: extrapolate | unrolled | raw
  compile_s: float  # lower + compile of the real program
  count_compile_s: float  # lower + compile of the loop-free variants
  # FLOP coefficients a, b, c_k, d_k of the extrapolation (empty for the other methods).
  fit: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def xla_vs_analytic(self) -> float:
    """flops / analytic_flops (> 1: XLA also counts elementwise ops, norms, softmax, decode)."""
    return self.flops / self.analytic_flops if self.analytic_flops else float('nan')


@dataclasses.dataclass
class Costs:
  """Every program of a run on one mesh, plus the byte counts the time model's transfers use."""

  config: str
  devices: int
  settings: dict[str, Any]
  trainable_bytes: int  # float32 trainable params (the MMDiT, or LoRA adapters)
  optimizer_state_bytes: int
  frozen_base_bytes: int  # the LoRA base in model.frozen_dtype (0 for full fine-tuning)
  published_bytes: int  # what the trainer publishes to the rollout per optimizer step
  rollout_param_bytes: int  # the rollout's whole copy of the weights it samples with
  gathered_bytes: int  # what one FSDP all-gather of the forward's weights moves, whole
  programs: dict[str, ProgramCost] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    for name, p in self.programs.items():
      out['programs'][name]['memory']['total_bytes'] = p.memory.total_bytes
      out['programs'][name]['xla_vs_analytic'] = p.xla_vs_analytic
    return out


# ---------------------------------------------------------------------------------------------
# Loop-free variants.


@contextlib.contextmanager
def unrolled_loops():
  """While tracing inside, every jax.lax.scan and jax.lax.map is fully unrolled (no while loop
  reaches XLA, so its cost analysis counts every iteration). Patches jax.lax.scan and the scan
  that lax.map calls; restores both on exit. Trace-time only: the math is unchanged."""
  from jax._src.lax.control_flow import loops  # pylint: disable=g-import-not-at-top

  original_public, original_internal = jax.lax.scan, loops.scan

  def scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    del unroll
    return original_internal(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  jax.lax.scan = loops.scan = scan
  try:
    yield
  finally:
    jax.lax.scan, loops.scan = original_public, original_internal


def layer_kinds(family: str) -> tuple[str, ...]:
  """config.model fields that count the `family`'s stacked blocks (FLUX has two kinds)."""
  return ('num_layers', 'num_single_layers') if family == 'flux' else ('num_layers',)


def variant_config(config, *, steps: int, layers: dict[str, int]):
  """`config` with `steps` sampler steps (all but the last trained: K = steps - 1), `layers`
  blocks per kind and the layers unrolled."""
  c = copy.deepcopy(config)
  c.sampler.num_steps = steps
  c.rl.timesteps = 'all_but_last'
  c.model.scan_layers = False
  for kind, n in layers.items():
    c.model[kind] = n
  return c


# ---------------------------------------------------------------------------------------------
# The programs, on abstract arguments.


def rollout_param_dtype(exp):
  """The rollout copy's dtype as the runtime publishes it (abstract.rollout_param_dtype)."""
  return abstract.rollout_param_dtype(exp)


def _lower(name: str, exp, mesh, batch: int, layout: str = 'replicated', samples=None):
  """lower() -> Lowered of one of abstract.run_programs' programs (`samples` as there)."""
  kw = dict(rollout_layout=layout, only=(name,), samples=samples)
  program, args = abstract.run_programs(exp, mesh, batch, **kw)[name]

  def lower():
    lowered = program.lower(*args)
    return getattr(lowered, 'lowered', lowered)  # a programs.Bound's lowering wraps jax's

  return lower


def build_rollout(exp, mesh, batch: int, layout: str):
  """lower() -> Lowered of the rollout as the rollout role compiles it (`layout` of its copy)."""
  return _lower('rollout', exp, mesh, batch, layout)


def build_grad(exp, mesh, batch: int, samples=None):
  """lower() of the GAP fragment gradient (forward + backward over the K trained steps) as the
  trainer compiles it: FSDP float32 params and accumulator, TSP when config.schedule.tsp;
  `samples` real samples of its `batch` rows (None: all)."""
  name = 'grad_tsp' if exp.schedule.tsp else 'grad'
  return _lower(name, exp, mesh, batch, samples=samples)


def build_apply(exp, mesh, batch: int):
  """lower() of the optimizer step on an accumulated gradient (FSDP params, state, gradient)."""
  return _lower('apply', exp, mesh, batch)


# ---------------------------------------------------------------------------------------------
# Compiling and reading XLA's analyses.


def _cost_vector(compiled) -> np.ndarray:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
    cost = cost[0] if cost else {}
  return np.array([float((cost or {}).get(k, 0.0)) for k in _COST_KEYS])


def _memory(compiled) -> Memory:
  m = compiled.memory_analysis()
  return Memory(
      int(m.argument_size_in_bytes),
      int(m.output_size_in_bytes),
      int(m.alias_size_in_bytes),
      int(m.temp_size_in_bytes),
  )


# XLA:CPU pass pipelines. 'no_hoist': without the pass that hoists the f32 converts of WHOLE bf16
# weight / residual stacks out of the loops (XLA:CPU has no bf16 dot), closer to an accelerator
# (benchmarks/memory.py's NOTES).
PIPELINES = {
    'default': None,
    'no_hoist': {'xla_disable_hlo_passes': 'while-loop-invariant-code-motion'},
}


def compile_and_read(lower: Callable[[], Any], *, unrolled: bool = False, pipeline='default'):
  """(cost vector [flops, bytes accessed, transcendentals], Memory, seconds); `pipeline`: the
  XLA:CPU passes (PIPELINES)."""
  t0 = time.perf_counter()
  with unrolled_loops() if unrolled else contextlib.nullcontext():
    lowered = lower()
  compiled = lowered.compile(PIPELINES[pipeline])
  seconds = time.perf_counter() - t0
  out = _cost_vector(compiled), _memory(compiled), seconds
  del compiled
  jax.clear_caches()
  return out


BUILDERS = {'rollout': build_rollout, 'grad': build_grad, 'apply': build_apply}


def _build(name, config, mesh, batch, layout, vae, samples=None):
  exp, _ = abstract.abstract_run(config, vae)
  if name == 'rollout':
    return exp, build_rollout(exp, mesh, batch, layout)
  if name == 'grad':
    return exp, build_grad(exp, mesh, batch, samples)
  return exp, BUILDERS[name](exp, mesh, batch)


def outer_trip(name: str, exp, mesh) -> int:
  """The trip count t of the program's outer loop: T sampler steps, or a fragment's steps."""
  return len(exp.sigmas) - 1 if name == 'rollout' else program_flops.trained_steps(exp, mesh)


def fit_counts(name: str, config, mesh, batch: int, layout: str, vae: str, samples=None):
  """Counts every loop iteration by extrapolating loop-free variants (module docstring).
  Returns (cost vector [flops, bytes accessed, transcendentals] at the real trip counts, the FLOP
  coefficients a, b, c_k, d_k, compile seconds of the variants)."""
  kinds = layer_kinds(config.model.family)
  base = {k: 1 for k in kinds}
  if name == 'rollout':
    ts, steps_of = (2, 3), (lambda t: t)  # T sampler steps
  else:  # K = steps - 1 trained steps
    unit = mesh.devices.size if config.schedule.tsp else 1  # TSP pads K to the mesh size
    ts, steps_of = (unit, 2 * unit), (lambda t: t + 1)
  seconds = 0.0
  cost = {}
  for t in ts:
    for extra in (None,) + kinds:
      layers = dict(base)
      if extra:
        layers[extra] += 1
      c = variant_config(config, steps=steps_of(t), layers=layers)
      _, lower = _build(name, c, mesh, batch, layout, vae, samples)
      cost[t, extra], _, s = compile_and_read(lower, unrolled=True)
      seconds += s
  t1, t2 = ts
  c = {
      k: ((cost[t2, k] - cost[t2, None]) - (cost[t1, k] - cost[t1, None])) / (t2 - t1)
      for k in kinds
  }
  d = {k: (cost[t1, k] - cost[t1, None]) - t1 * c[k] for k in kinds}
  slope = (cost[t2, None] - cost[t1, None]) / (t2 - t1)
  b = slope - sum(c.values())
  a = cost[t1, None] - t1 * slope - sum(d.values())
  exp, _ = abstract.abstract_run(config, vae)
  t_real = outer_trip(name, exp, mesh)
  real_layers = {k: int(config.model[k]) for k in kinds}
  total = (
      a
      + sum(real_layers[k] * d[k] for k in kinds)
      + t_real * (b + sum(real_layers[k] * c[k] for k in kinds))
  )
  coefficients = {
      'a': a[0],
      'b': b[0],
      **{f'c_{k}': c[k][0] for k in kinds},
      **{f'd_{k}': d[k][0] for k in kinds},
  }
  return total, coefficients, seconds


def count_unrolled(name: str, config, mesh, batch: int, layout: str, vae: str, samples=None):
  """(cost vector, seconds) of the program at its real trip counts with every loop unrolled:
  exact, and slow to compile at real sizes."""
  unrolled_config = copy.deepcopy(config)
  unrolled_config.model.scan_layers = False
  _, lower = _build(name, unrolled_config, mesh, batch, layout, vae, samples)
  counted, _, seconds = compile_and_read(lower, unrolled=True)
  return counted, seconds


def trip_counts(name: str, exp, mesh) -> dict[str, int]:
  out = {k: int(getattr(exp.model, k)) for k in layer_kinds(exp.model.family)}
  if name == 'apply':
    return {}
  out['steps'] = outer_trip(name, exp, mesh)
  out['cfg_branches'] = program_flops.cfg_branches(exp)
  return out


def program_cost(
    name: str,
    config,
    mesh,
    *,
    batch: int,
    method: str = 'extrapolate',
    rollout_layout: str | None = None,
    vae: str = 'auto',
    samples: int | None = None,
    pipeline: str = 'default',
) -> ProgramCost:
  """Compiles program `name` (rollout | grad | apply) of `config` for `mesh` and reads XLA's
  analyses; `method` says how loop iterations are counted (module docstring). `samples`: the
  grad's real samples of its `batch` rows (None: all); `pipeline`: the XLA:CPU passes of the
  real program's compile, whose memory it reports (PIPELINES)."""
  if name not in PROGRAMS:
    raise ValueError(f'program {name!r}: expected one of {PROGRAMS}')
  if method not in METHODS:
    raise ValueError(f'method {method!r}: expected one of {METHODS}')
  layout = rollout_layout or config.cluster.rollout.param_sharding
  if batch % mesh.devices.size:
    raise ValueError(f'{name}: batch {batch} is not divisible by {mesh.devices.size} devices')
  exp, lower = _build(name, config, mesh, batch, layout, vae, samples)
  raw, memory, compile_s = compile_and_read(lower, pipeline=pipeline)
  fit, count_s = {}, 0.0
  if name == 'apply' or method == 'raw':
    # The apply has no loop (optax over the param tree), so XLA's figure counts everything.
    counted = raw
    method = 'raw' if name != 'apply' else 'exact'
  elif method == 'unrolled':
    counted, count_s = count_unrolled(name, config, mesh, batch, layout, vae, samples)
  else:
    counted, fit, count_s = fit_counts(name, config, mesh, batch, layout, vae, samples)
  return ProgramCost(
      name=name,
      devices=mesh.devices.size,
      batch=batch,
      flops=float(counted[0]),
      bytes_accessed=float(counted[1]),
      transcendentals=float(counted[2]),
      analytic_flops=program_flops.analytic_flops(name, exp, mesh, batch),
      memory=memory,
      raw_flops=float(raw[0]),
      raw_bytes_accessed=float(raw[1]),
      trip_counts=trip_counts(name, exp, mesh),
      method=method,
      compile_s=round(compile_s, 2),
      count_compile_s=round(count_s, 2),
      fit={k: float(v) for k, v in fit.items()},
  )


# ---------------------------------------------------------------------------------------------
# A whole run.


def weight_bytes(exp) -> dict[str, int]:
  """A run's weights in bytes (Costs' fields): the float32 trainable params, the optimizer
  state, the LoRA base (frozen dtype), the publish and the rollout's whole copy (the config's
  rollout dtype) and one FSDP gather (the trainable params in the compute dtype, and the base)."""
  w = exp.weights
  base = _bytes(w.base_abstract, w.frozen_dtype) if w.lora is not None else 0
  f32 = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
      ),
      exp.params,
  )
  rollout_copy = _bytes(exp.params, rollout_param_dtype(exp))
  return dict(
      trainable_bytes=_bytes(exp.params, jnp.float32),
      optimizer_state_bytes=_bytes(jax.eval_shape(exp.optimizer.init, f32)),
      frozen_base_bytes=base,
      published_bytes=rollout_copy,
      rollout_param_bytes=rollout_copy + base,
      gathered_bytes=_bytes(exp.params, exp.compute_dtype) + base,
  )


def _bytes(tree, dtype=None) -> int:
  """Whole bytes of a tree of ShapeDtypeStructs, floating leaves counted as `dtype` if given."""
  total = 0
  for x in jax.tree.leaves(tree):
    d = jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    total += int(np.prod(x.shape)) * d.itemsize
  return total


def default_batches(config, devices: int) -> tuple[int, int]:
  """(rollout batch, fragment batch): the logical batch rl.prompts_per_step x rl.group_size,
  and one of its schedule.fragments GAP fragments."""
  whole = config.rl.prompts_per_step * config.rl.group_size
  return whole, whole // max(1, config.schedule.fragments)


def run_costs(
    config,
    devices: int,
    *,
    programs_: tuple[str, ...] = PROGRAMS,
    method: str = 'extrapolate',
    rollout_batch: int = 0,
    fragment_batch: int = 0,
    rollout_layout: str | None = None,
    vae: str = 'auto',
    name: str = '',
    fragment_samples: int = 0,
    pipeline: str = 'default',
) -> Costs:
  """Costs of `config`'s programs on a 1-D mesh of the first `devices` jax devices (fake CPU
  devices: set --xla_force_host_platform_device_count before jax starts). Batches are global
  sample counts; 0 takes default_batches. fragment_samples: the grad's real samples, the first
  of its fragment_batch rows (0: all); pipeline: as program_cost's."""
  if jax.device_count() < devices:
    raise ValueError(
        f'{devices} devices asked for but jax sees {jax.device_count()}: set '
        'XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts'
    )
  mesh = mesh_lib.make_mesh(jax.devices()[:devices])
  whole, fragment = default_batches(config, devices)
  batches = {'rollout': rollout_batch or whole, 'grad': fragment_batch or fragment, 'apply': 0}
  exp, vae_what = abstract.abstract_run(config, vae)
  lora = exp.weights.lora is not None
  compute = exp.compute_dtype
  layout = rollout_layout or config.cluster.rollout.param_sharding
  costs = Costs(
      config=name,
      devices=devices,
      settings={
          'finetune': 'lora' if lora else 'full',
          'lora_rank': int(config.model.lora.rank),
          'remat': bool(exp.model_config.remat),
          'cfg': program_flops.cfg_branches(exp) == 2,
          'compute_dtype': jnp.dtype(compute).name,
          'num_steps': len(exp.sigmas) - 1,
          'trained_steps': program_flops.trained_steps(exp, mesh),
          'tsp': bool(config.schedule.tsp),
          'image_tokens': exp.latent_shape[0],
          'text_tokens': int(config.text.max_length),
          'latent_hw': [int(config.latent.height), int(config.latent.width)],
          'rollout_layout': layout,
          'rollout_batch': batches['rollout'],
          'fragment_batch': batches['grad'],
          'vae': vae_what,
          'method': method,
          'mmdit_params': int(exp.family.count_params(exp.model_config)),
          'sequence_split': int(config.parallel.sequence),
          'fragment_samples': fragment_samples or batches['grad'],
          'xla_pipeline': pipeline,
      },
      **weight_bytes(exp),
  )
  for p in programs_:
    print(
        f'[costs] {p}: batch {batches[p]}, {devices} devices, method {method}',
        file=sys.stderr,
        flush=True,
    )
    costs.programs[p] = program_cost(
        p,
        config,
        mesh,
        batch=batches[p],
        method=method,
        rollout_layout=layout,
        vae=vae,
        samples=fragment_samples or None,
        pipeline=pipeline,
    )
  return costs
