"""Per-device memory of a run on a stated mesh, from XLA's own memory analysis of the run's real
compiled programs: no weights are read and nothing is allocated.

    python benchmarks/memory.py --config=configs/qwenimage.py --devices=16 --out=/tmp/mem.json
    python benchmarks/memory.py --config=configs/qwenimage.py:full --devices=8 --remat=on
    python benchmarks/memory.py --config=configs/qwenimage.py --devices=8 --per_device_batch=2 \
        --config.sampler.num_steps=20

The script fakes `--devices` CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N,
set before jax is imported), builds the run's Experiment from the config alone (the MMDiT under
nnx.eval_shape, LoRA adapters under jax.eval_shape of lora.init_adapters, the VAE via
vae.abstract_vae; no text encoder, prompts or reward: the programs do not take them), and for
a 1-D mesh of N devices lowers and compiles, ahead of time on ShapeDtypeStructs with shardings:

  update              programs.make_update exactly as runtime/trainer.py builds it: FSDP float32
                      params and optimizer state (mesh.fsdp_shardings), the batch as
                      the trainer's batch shardings, the frozen LoRA base FSDP in
                      model.frozen_dtype (the VAE too when schedule.tag is on).
  rollout_<layout>    programs.make_rollout (sampling scan + VAE decode) with the rollout copy of
                      the weights laid out as <layout> (--rollout_layouts, default both
                      'replicated' and 'fsdp', i.e. config.cluster.rollout.param_sharding), the
                      LoRA base laid out the same way (--rollout_base), the VAE replicated.

Per program the JSON has XLA's per-device argument / output / alias / temp bytes
(compiled.memory_analysis()), total = argument + output - alias + temp (donated buffers counted
once), held_total (the same with every argument the runtime holds for the program: jit drops
unread ones, such as the VAE's encoder, from XLA's argument bytes), XLA's cost_analysis() FLOPs
(a while/scan body counts ONCE: the sampler's T steps and the model's layer scan each count as
one iteration, far below the real count) next to analytic MMDiT matmul FLOPs, the per-device
bytes of each argument group, and the lower/compile seconds. Each program is compiled with
every --pipelines entry: 'default' (XLA:CPU as is) and 'no_hoist' (without
while-loop-invariant-code-motion: XLA:CPU converts bf16 dot operands to f32 and that pass
hoists the convert of whole stacked weights / remat residuals out of the loops, f32 copies an
accelerator with bf16 dots never makes; NOTES in the JSON). 'analytic' has the parameter /
optimizer / adapter / frozen byte counts; 'colocated_estimate' combines the programs into the
peak of a one-mesh run (the trainer state stays resident while the rollout runs).

Batch: by default the whole logical batch (rl.prompts_per_step x rl.group_size) split over the
N devices, for both programs; --per_device_batch=P makes it P x N (e.g. a GAP fragment or a
rollout share).  --vae: 'auto' reads vae/config.json from config.model.checkpoint when it is a
pipeline folder (configuration only), else uses the real Qwen-Image VAE when
config.latent.channels is 16 and the toy VAE of digen_jax/experiment/tiny_pipeline.py otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

# Make `import digen_jax` work when run as `python benchmarks/memory.py` from anywhere.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from digen_jax.perf import devices as devices_lib  # pylint: disable=g-import-not-at-top  (no jax)

if __name__ == '__main__':
  devices_lib.force_host_devices(sys.argv[1:])  # before anything imports jax

# pylint: disable=g-import-not-at-top,wrong-import-position  (after force_host_devices)
from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

import common
from digen_jax import programs
from digen_jax.rl import timesteps as timesteps_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.perf import abstract as abstract_lib
from digen_jax.perf.abstract import abstract_cond
from digen_jax.perf.abstract import frozen_tree
from digen_jax.perf.abstract import laid_out
from digen_jax.perf.abstract import per_device_bytes
from digen_jax.perf.abstract import whole_bytes

# pylint: enable=g-import-not-at-top,wrong-import-position

CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    'Config file[:variant], e.g. ' 'configs/qwenimage.py or configs/qwenimage.py:full.',
)
DEVICES = flags.DEFINE_integer(
    'devices', None, 'N: fake CPU devices, the 1-D mesh of both ' 'programs.', lower_bound=1
)
PER_DEVICE_BATCH = flags.DEFINE_integer(
    'per_device_batch',
    0,
    'Samples per device in both programs (batch = P x N); 0: the whole '
    'logical batch rl.prompts_per_step x rl.group_size split over the N devices.',
    lower_bound=0,
)
REMAT = flags.DEFINE_enum(
    'remat', 'config', ['config', 'on', 'off'], 'model.remat: as the config says, or forced on/off.'
)
LORA = flags.DEFINE_bool(
    'lora',
    None,
    "--lora: LoRA (the config's rank, else --lora_rank); "
    '--nolora / --full: full fine-tuning. Default: as the config says.',
)
FULL = flags.DEFINE_bool('full', False, 'Full fine-tuning (same as --nolora).')
LORA_RANK = flags.DEFINE_integer('lora_rank', 64, 'Rank for --lora when the config has rank 0.')
VAE = flags.DEFINE_string(
    'vae',
    'auto',
    "'auto', 'real' (Qwen-Image VAE), 'tiny' "
    "(tiny_pipeline's toy VAE), or a vae/config.json or pipeline folder "
    '(its config only). Ignored for pixel-space configs.',
)
PROGRAMS = flags.DEFINE_list('programs', ['update', 'rollout'], 'Which programs to compile.')
ROLLOUT_LAYOUTS = flags.DEFINE_list(
    'rollout_layouts', ['replicated', 'fsdp'], 'Layouts of the rollout copy of the weights.'
)
ROLLOUT_BASE = flags.DEFINE_enum(
    'rollout_base',
    'layout',
    ['layout', 'runtime', 'replicated', 'fsdp'],
    "The LoRA base's layout in the rollout program: like the rollout copy ('layout'), as the "
    "runtime lays it ('runtime': colocated -> the trainer's FSDP copy, disagg -> replicated), "
    'or fixed.',
)
ROLLOUT_PARAM_DTYPE = flags.DEFINE_enum(
    'rollout_param_dtype',
    'runtime',
    ['runtime', 'float32', 'bfloat16'],
    "The rollout copy's dtype: 'runtime' = float32 colocated, config.cluster.rollout.param_dtype "
    'in disagg runs (LoRA adapters are always float32).',
)
PIPELINES = flags.DEFINE_list(
    'pipelines',
    ['default', 'no_hoist'],
    "XLA CPU pass pipelines to compile each program with (the first one's figures are the "
    "program's 'per_device'): 'default', and 'no_hoist' = without while-loop-invariant-code-"
    'motion, which on the CPU hoists f32 copies of whole bf16 weight / residual stacks out of '
    'the loops (see NOTES).',
)
OUT = flags.DEFINE_string('out', None, 'Write the JSON here (it is also printed).')

GIB = 1024**3
COMPILER_OPTIONS = {
    'default': None,
    'no_hoist': {'xla_disable_hlo_passes': 'while-loop-invariant-code-motion'},
}
NOTES = (
    'Figures are XLA:CPU buffer assignments of the real programs on fake CPU devices, per '
    'device. total = argument + output - alias + temp; held_total counts every argument the '
    'runtime holds for the program (jit drops unread ones, e.g. the VAE encoder, from '
    'argument). XLA:CPU has no native bf16 dot: it converts bf16 operands to f32, and '
    'while-loop-invariant-code-motion then hoists the convert of a WHOLE stacked tensor (all '
    "layers' weights, all layers' remat residuals) out of the layer / sampler loops, so the "
    "'default' temp holds f32 copies that a GPU or TPU (native bf16 dots) never makes. "
    "'no_hoist' compiles without that pass: the converts stay per layer inside the loop, which "
    'is closer to an accelerator (still an upper bound: CPU dots keep f32 activations). '
    'Neither is an accelerator compile: XLA:GPU fuses and schedules differently.'
)
FLOPS_NOTE = (
    'xla_flops: compiled.cost_analysis() per device; XLA counts a while/scan body '
    'once, so the sampler scan (T steps) and the layer scan (num_layers) each count '
    'one iteration: far below the real count. analytic_mmdit_flops: every MMDiT '
    'matmul (family.flops_per_forward) of the real loop counts, per device.'
)


# ---------------------------------------------------------------------------------------------
# The run, without weights.


def run_config():
  """The config with the command line's --remat / --lora / --full applied."""
  config = CONFIG.value
  if REMAT.value != 'config':
    config.model.remat = REMAT.value == 'on'
  full = FULL.value or LORA.value is False
  if full and LORA.value:
    raise app.UsageError('--lora and --full contradict each other')
  if full:
    config.model.lora.rank = 0
  elif LORA.value and config.model.lora.rank == 0:
    config.model.lora.rank = LORA_RANK.value
    config.model.lora.alpha = float(2 * LORA_RANK.value)
  return config


def abstract_run(config):
  """(Run, description) with every weight a ShapeDtypeStruct and --vae's VAE
  (digen_jax/perf/abstract.py)."""
  try:
    return abstract_lib.abstract_run(config, VAE.value)
  except ValueError as e:
    raise app.UsageError(f'--vae: {e}') from e


# ---------------------------------------------------------------------------------------------
# Compiling and measuring.


def analyse(compiled, held_argument_bytes: int) -> dict:
  """Per-device bytes and FLOPs of one compiled program (XLA's memory and cost analyses)."""
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
    cost = cost[0] if cost else {}
  pd = {
      'argument_bytes': int(m.argument_size_in_bytes),
      'output_bytes': int(m.output_size_in_bytes),
      'alias_bytes': int(m.alias_size_in_bytes),
      'temp_bytes': int(m.temp_size_in_bytes),
      'generated_code_bytes': int(m.generated_code_size_in_bytes),
  }
  pd['total_bytes'] = (
      pd['argument_bytes'] + pd['output_bytes'] - pd['alias_bytes'] + pd['temp_bytes']
  )
  # jit drops arguments the program never reads (e.g. the VAE's encoder weights in the rollout)
  # from the executable, so XLA's argument bytes can be below what the runtime holds for it.
  pd['held_argument_bytes'] = held_argument_bytes
  pd['held_total_bytes'] = (
      held_argument_bytes + pd['output_bytes'] - pd['alias_bytes'] + pd['temp_bytes']
  )
  return {
      'per_device': pd,
      'per_device_gib': {k.replace('_bytes', ''): round(v / GIB, 3) for k, v in pd.items()},
      'xla_flops': float((cost or {}).get('flops', 0.0)),
  }


def measure(bound, args: dict, shared: tuple[str, ...] = ()) -> dict:
  """Lowers `bound` (a programs.Bound) on the abstract `args` (an ordered dict of argument
  groups), compiles it once per --pipelines entry and reads XLA's analyses. The first pipeline's
  figures are the program's 'per_device'; every pipeline's are under 'pipelines'. `shared`:
  groups the runtime passes as the very buffers of another group (held once)."""
  groups = {k: 0 if k in shared else per_device_bytes(v) for k, v in args.items()}
  groups['frozen'] = per_device_bytes(bound.frozen)
  t0 = time.perf_counter()
  lowered = bound.lower(*args.values()).lowered
  out = {
      'argument_groups_bytes': groups,
      'lower_s': round(time.perf_counter() - t0, 2),
      'pipelines': {},
  }
  for name in PIPELINES.value:
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=COMPILER_OPTIONS[name])
    one = analyse(compiled, sum(groups.values()))
    one['compile_s'] = round(time.perf_counter() - t0, 2)
    out['pipelines'][name] = one
    del compiled
  first = out['pipelines'][PIPELINES.value[0]]
  out.update(
      pipeline=PIPELINES.value[0],
      per_device=first['per_device'],
      per_device_gib=first['per_device_gib'],
      xla_flops=first['xla_flops'],
      compile_s=first['compile_s'],
  )
  jax.clear_caches()
  return out


def mmdit_forward_flops(exp, batch: int) -> float:
  return exp.family.flops_per_forward(
      exp.model_config, batch, exp.latent_shape[0], exp.model.text_max_length
  )


def update_program(exp, mesh, batch: int) -> dict:
  """The trainer's fused GRPO update (one fragment) as runtime/trainer.py compiles it, measured."""
  rep = mesh_lib.replicated(mesh)
  param_sh = mesh_lib.fsdp_shardings(exp.params, mesh)
  params = laid_out(exp.params, param_sh, jnp.float32)
  opt_shapes = jax.eval_shape(exp.optimizer.init, params)
  opt_sh = mesh_lib.fsdp_shardings(opt_shapes, mesh)
  opt_state = laid_out(opt_shapes, opt_sh)
  data = mesh_lib.batch_sharding(mesh, 1)
  batch_sh = {'traj': programs.trajectory_shardings(mesh), 'adv': data, 'valid': data}
  frozen = frozen_tree(exp, mesh, base='fsdp', decode=bool(exp.schedule.tag))
  bound = programs.make_update(
      exp, mesh, param_sh, opt_sh, traj_shardings=batch_sh['traj'], frozen=frozen
  )
  cond = abstract_cond(exp, batch, mesh)
  ref = params if programs.ref_shardings(exp, param_sh) is not None else None
  args = {
      'params': params,
      'opt_state': opt_state,
      'traj': laid_out(programs.abstract_trajectory(exp, batch), batch_sh['traj']),
      'cond': cond,
      'uncond': cond,
      'adv': jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=batch_sh['adv']),
      'valid': jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=batch_sh['valid']),
      'key': jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep),
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
      'ref_params': ref,
  }
  cfg = programs.guidance_of(exp)[0] is not None
  # Without CFG the workers pass the conditioning itself as `uncond`.
  out = measure(bound, args, shared=() if cfg else ('uncond',))
  k = timesteps_lib.num_selected(exp.selection, len(exp.sigmas) - 1)
  # forward + remat recompute + backward (~2 forwards; LoRA skips most weight gradients).
  passes = (4 if exp.model_config.remat else 3) * exp.rl.inner_epochs
  out.update(
      batch=batch,
      trained_steps=k,
      cfg_branches=2 if cfg else 1,
      step_loop=programs.step_loop_for(exp.rl.step_loop, mesh),
      analytic_mmdit_flops=(
          passes * k * (2 if cfg else 1) * mmdit_forward_flops(exp, batch) / mesh.devices.size
      ),
      analytic_flops_note=f'{passes} forward-equivalents (forward, '
      f'{"remat recompute, " if exp.model_config.remat else ""}backward as 2 '
      'forwards: an upper bound for LoRA, which skips most weight gradients) '
      f'x K={k} steps x {2 if cfg else 1} CFG branch(es)',
  )
  return out


def rollout_base_layout(exp, layout: str) -> str | None:
  """Where the rollout program's LoRA base lives (see --rollout_base)."""
  if exp.weights.lora is None:
    return None
  if ROLLOUT_BASE.value == 'layout':
    return layout
  if ROLLOUT_BASE.value == 'runtime':
    return 'fsdp' if exp.runtime.mode == 'colocated' else 'replicated'
  return ROLLOUT_BASE.value


def rollout_param_dtype(exp):
  if exp.weights.lora is not None:
    return jnp.float32  # LoRA publishes float32 adapters (configlib enforces it)
  name = ROLLOUT_PARAM_DTYPE.value
  if name == 'runtime':
    name = exp.publish.param_dtype if exp.runtime.mode == 'disagg' else 'float32'
  return jnp.bfloat16 if name == 'bfloat16' else jnp.float32


def rollout_program(exp, mesh, batch: int, layout: str) -> dict:
  """The rollout (sampling scan + decode) as the rollout role compiles it, measured."""
  rep = mesh_lib.replicated(mesh)
  param_sh = (
      mesh_lib.fsdp_shardings(exp.params, mesh)
      if layout == 'fsdp'
      else jax.tree.map(lambda _: rep, exp.params)
  )
  dtype = rollout_param_dtype(exp)
  base = rollout_base_layout(exp, layout)
  frozen = frozen_tree(exp, mesh, base=base, decode=True)
  bound = programs.make_rollout(
      exp, mesh, param_sh, programs.trajectory_shardings(mesh), frozen=frozen
  )
  cond = abstract_cond(exp, batch, mesh)
  args = {
      'params': laid_out(exp.params, param_sh, dtype),
      'cond': cond,
      'uncond': cond,
      'key': jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep),
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
  }
  cfg = programs.guidance_of(exp)[0] is not None
  out = measure(bound, args, shared=() if cfg else ('uncond',))
  t = len(exp.sigmas) - 1
  out.update(
      batch=batch,
      param_sharding=layout,
      param_dtype=jnp.dtype(dtype).name,
      base_sharding=base,
      vae_sharding='replicated' if exp.weights.vae is not None else None,
      analytic_mmdit_flops=(
          t * (2 if cfg else 1) * mmdit_forward_flops(exp, batch) / mesh.devices.size
      ),
      analytic_flops_note=f'T={t} steps x {2 if cfg else 1} CFG branch(es) x one forward; the '
      'VAE decode is not counted',
  )
  return out


def analytic(exp, mesh) -> dict:
  """Parameter, optimizer, adapter and frozen byte counts (whole and per device)."""
  w = exp.weights
  count = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
  params32 = laid_out(exp.params, mesh_lib.fsdp_shardings(exp.params, mesh), jnp.float32)
  opt = jax.eval_shape(exp.optimizer.init, params32)
  opt = laid_out(opt, mesh_lib.fsdp_shardings(opt, mesh))
  base = w.base_abstract if w.lora is not None else None
  out = {
      'mmdit_params': exp.family.count_params(exp.model_config),
      'trainable': 'lora' if w.lora is not None else 'full',
      'trainable_params': count(exp.params),
      'trainable_bytes_f32': whole_bytes(params32),
      'optimizer_state_bytes': whole_bytes(opt),
      'trainer_params_per_device_bytes': per_device_bytes(params32),
      'trainer_opt_state_per_device_bytes': per_device_bytes(opt),
      'adapter_bytes_f32': whole_bytes(params32) if w.lora is not None else 0,
      'frozen_dtype': jnp.dtype(w.frozen_dtype).name,
      'frozen_base_bytes': (
          whole_bytes(laid_out(base, mesh_lib.replicated(mesh), w.frozen_dtype)) if base else 0
      ),
      'frozen_base_fsdp_per_device_bytes': (
          per_device_bytes(frozen_tree(exp, mesh, base='fsdp', decode=False)) if base else 0
      ),
  }
  if w.vae is not None:
    vae = laid_out(w.vae.abstract, mesh_lib.replicated(mesh), w.frozen_dtype)
    out.update(vae_params=count(vae), vae_bytes=whole_bytes(vae))
  return out


def colocated_estimate(u: dict, r: dict, base_sharding: str | None, a: dict, exp) -> dict:
  """Peak per device of a one-mesh run of these two programs (per_device dicts u, r): the
  trainer's params, optimizer state and frozen base stay resident while the rollout runs (its
  own copy of the weights is dropped before the update), the VAE while the update runs."""
  trainer_state = a['trainer_params_per_device_bytes'] + a['trainer_opt_state_per_device_bytes']
  if exp.weights.lora is not None and base_sharding != 'fsdp':
    trainer_state += a['frozen_base_fsdp_per_device_bytes']  # not the rollout's base copy
  during_rollout = r['held_total_bytes'] + trainer_state
  vae = a.get('vae_bytes', 0) if not exp.schedule.tag else 0
  during_update = u['held_total_bytes'] + vae
  peak = max(during_rollout, during_update)
  return {
      'during_rollout_bytes': during_rollout,
      'during_update_bytes': during_update,
      'peak_bytes': peak,
      'peak_gib': round(peak / GIB, 3),
  }


def describe(c, exp, vae_what: str, n: int, batch: int) -> dict:
  """The settings of the run `exp` of config `c` as the report lists them."""
  return {
      'devices': n,
      'mesh': f'1-D, {n} fake CPU devices',
      'batch': batch,
      'per_device_batch': batch // n,
      'logical_batch': exp.batch_size,
      'finetune': 'lora' if exp.weights.lora else 'full',
      'lora_rank': int(c.model.lora.rank),
      'lora_targets': c.model.lora.targets,
      'remat': bool(exp.model_config.remat),
      'scan_layers': bool(exp.model_config.scan_layers),
      'num_layers': exp.model_config.num_layers,
      'compute_dtype': c.optim.compute_dtype,
      'frozen_dtype': c.model.frozen_dtype,
      'runtime_mode': c.runtime.mode,
      'latent_hw': [c.latent.height, c.latent.width],
      'image_tokens': exp.latent_shape[0],
      'text_tokens': c.text.max_length,
      'num_steps': len(exp.sigmas) - 1,
      'trained_steps': timesteps_lib.num_selected(exp.selection, len(exp.sigmas) - 1),
      'guidance_scale': c.sampler.guidance_scale,
      'cfg': programs.guidance_of(exp)[0] is not None,
      'rl_step_loop': c.rl.step_loop,
      'inner_epochs': c.rl.inner_epochs,
      'vae': vae_what,
      'vae_batch_chunk': c.latent.vae_batch_chunk,
      'vae_tile': c.latent.vae_tile,
  }


def format_table(result: dict) -> str:
  """The per-device figures as a text table (GiB, or MiB when every total is below 1 GiB)."""
  cols = ('argument', 'output', 'alias', 'temp', 'total', 'held_total')
  ones = [
      (name, pipe, one)
      for name, p in result['programs'].items()
      for pipe, one in p['pipelines'].items()
  ]
  big = any(one['per_device']['held_total_bytes'] >= GIB for _, _, one in ones)
  unit, scale = ('GiB', GIB) if big else ('MiB', 1024**2)
  rows = [
      f'{"program":<20}{"pipeline":<10}'
      + ''.join(f'{c:>11}' for c in cols)
      + f'{"compile":>9}   ({unit} per device, {result["settings"]["devices"]} devices)'
  ]
  for name, pipe, one in ones:
    b = one['per_device']
    rows.append(
        f'{name:<20}{pipe:<10}'
        + ''.join(f'{b[c + "_bytes"] / scale:>11.2f}' for c in cols)
        + f'{one["compile_s"]:>8.1f}s'
    )
  for name, per_pipe in result.get('colocated_estimate', {}).items():
    rows.append(
        f'colocated peak (update + {name}): '
        + ', '.join(
            f'{e["peak_bytes"] / scale:.2f} {unit} ({pipe})' for pipe, e in per_pipe.items()
        )
    )
  return '\n'.join(rows)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  if CONFIG.value is None or DEVICES.value is None:
    raise app.UsageError('--config and --devices are required')
  n = DEVICES.value
  if jax.device_count() < n:
    raise app.UsageError(
        f'--devices={n} but jax sees {jax.device_count()} devices (was jax '
        'imported before XLA_FLAGS was set?)'
    )
  if not PIPELINES.value or set(PIPELINES.value) - set(COMPILER_OPTIONS):
    raise app.UsageError(f'--pipelines takes {",".join(COMPILER_OPTIONS)}')
  unknown = set(PROGRAMS.value) - {'update', 'rollout'}
  bad_layouts = set(ROLLOUT_LAYOUTS.value) - {'replicated', 'fsdp'}
  if unknown or bad_layouts:
    raise app.UsageError(
        f'--programs takes update,rollout; --rollout_layouts takes '
        f'replicated,fsdp (got {sorted(unknown | bad_layouts)})'
    )
  t_start = time.perf_counter()
  config = run_config()
  exp, vae_what = abstract_run(config)
  batch = PER_DEVICE_BATCH.value * n if PER_DEVICE_BATCH.value else exp.batch_size
  if batch % n:
    raise app.UsageError(
        f'batch {batch} (rl.prompts_per_step x rl.group_size) is not '
        f'divisible by --devices={n}; give --per_device_batch'
    )
  mesh = mesh_lib.make_mesh(jax.devices()[:n])
  print(f'[memory] params: {mesh_lib.fsdp_layout(exp.params, mesh).describe()}', flush=True)
  result = {
      'machine': common.machine_info(),
      'command': shlex.join(['python'] + sys.argv),
      'settings': describe(config, exp, vae_what, n, batch),
      'analytic': analytic(exp, mesh),
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'notes': NOTES,
      'flops_note': FLOPS_NOTE,
      'programs': {},
  }
  result['machine'].pop('jax_devices', None)
  if 'update' in PROGRAMS.value:
    print(f'[memory] compiling update (batch {batch}, {n} devices)...', flush=True)
    result['programs']['update'] = update_program(exp, mesh, batch)
  if 'rollout' in PROGRAMS.value:
    for layout in ROLLOUT_LAYOUTS.value:
      print(f'[memory] compiling rollout_{layout} (batch {batch}, {n} devices)...', flush=True)
      result['programs'][f'rollout_{layout}'] = rollout_program(exp, mesh, batch, layout)
  if 'update' in result['programs']:
    u = result['programs']['update']['pipelines']
    result['colocated_estimate'] = {
        name: {
            pipe: colocated_estimate(
                u[pipe]['per_device'], r['per_device'], p['base_sharding'], result['analytic'], exp
            )
            for pipe, r in p['pipelines'].items()
        }
        for name, p in result['programs'].items()
        if name.startswith('rollout_')
    }
  result['wall_s'] = round(time.perf_counter() - t_start, 1)
  print(format_table(result), flush=True)
  text = json.dumps(result, indent=2, sort_keys=True)
  if OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(OUT.value)), exist_ok=True)
    with open(OUT.value, 'w') as f:
      f.write(text + '\n')
  print(text)


if __name__ == '__main__':
  app.run(main)
