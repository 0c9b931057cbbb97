"""The GPU check: everything a GPU shows that a CPU cannot, in one command, JSON out.

  python benchmarks/gpu_check.py --out DIR               # real sizes, one GPU (H100/H200 class)
  python benchmarks/gpu_check.py --out DIR --size tiny   # the same at toy sizes: CI runs it on a CPU

Parts (--parts, default all), each measurement in a process of its own (so a process's peak
memory is its own programs', and JAX and PyTorch never share a device's memory):

  runs          configs/qwenimage.py:tiny, configs/flux.py:tiny and the main job
                (configs/shapes.py) through `python -m digen_jax.main`, unchanged (transfer guard
                'disallow'): wall time of each, the main job's base and final eval accuracy.
  transformers  the Qwen-Image 20B and FLUX.1-dev 12B transformers at the sizes users train
                (512 px: 1024 image tokens; 128 / 512 text tokens; bf16; random weights built
                on the device, nothing downloaded), ours (JAX) and diffusers' (PyTorch, eager):
                forward at a rollout batch (16 rows: 8 prompts x CFG), forward + backward with
                per-block checkpointing at a fragment batch (2); ms, MFU from the analytic FLOP
                count (3x forward for forward + backward, recompute not counted), peak device
                memory after each phase and XLA's memory analysis of each JAX program. Ratios
                (diffusers ms / ours) in `summary`.
  programs      the project's own programs at real size for configs/qwenimage.py (LoRA, as
                users train): the rollout (sampler scan with CFG + VAE decode, a rollout batch)
                and one fragment's update (gradient + optimizer step, a fragment batch), built
                exactly as the runtime builds them (digen_jax/perf/abstract.run_programs).

Targets (benchmark figures, not pass/fail): forward >= 1.25x diffusers, forward + backward
>= 2x torch, our gradient program's peak <= 1.1x torch's at the same batch and checkpointing,
the main job <= 2 minutes on one H200. `--size tiny` shrinks every model and run so the whole
check takes a few minutes on a 2-core CPU (tests/perf/test_gpu_check.py), so it cannot rot.

A GPU machine whose Python lacks diffusers, ml-collections, tensorflow-datasets, array-record
or tensorboardX: bring them as wheels (README "Running on GPUs", benchmarks/gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

PARTS = ('runs', 'transformers', 'programs')
FAMILIES = ('qwenimage', 'flux')
GIB = 2**30
# Dense bf16 peak of the device, for MFU (None: not reported). H100/H200 SXM: 989 TFLOP/s.
PEAK_TFLOPS = {'H100': 989.0, 'H200': 989.0, 'A100': 312.0}
# The main job, reduced for --size tiny (steps, eval size); real size runs it unchanged.
TINY_MAIN = ['--config.total_steps=2', '--config.eval.every=2', '--config.eval.num_prompts=8']
TINY_RUNS = ['--config.total_steps=2']


def _env():
  env = dict(os.environ)
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # per-process peaks, not 75 % of HBM
  env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH', '')) if p)
  return env


def _child(args: list[str], timeout: int) -> dict:
  """This script as a child (`--child ...`); its last stdout line is its JSON."""
  cmd = [sys.executable, os.path.abspath(__file__), *args]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
  if out.returncode != 0:
    return {'error': f'exit {out.returncode}: {out.stderr.strip()[-2000:]}'}
  return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Part 1: the configs, unchanged, through the main entry point.


def run_configs(size: str, out_dir: str, timeout: int) -> dict:
  runs = {
      'qwenimage_tiny': ['configs/qwenimage.py:tiny', TINY_RUNS if size == 'tiny' else []],
      'flux_tiny': ['configs/flux.py:tiny', TINY_RUNS if size == 'tiny' else []],
      'main_job': ['configs/shapes.py', TINY_MAIN if size == 'tiny' else []],
  }
  results = {}
  for name, (config, extra) in runs.items():
    workdir = os.path.join(out_dir, 'runs', name)
    cmd = [
        sys.executable,
        '-m',
        'digen_jax.main',
        f'--config={config}',
        f'--workdir={workdir}',
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO
    )
    entry = {'command': ' '.join(['python', *cmd[1:]]), 'wall_s': time.perf_counter() - t0}
    if proc.returncode != 0:
      entry['error'] = f'exit {proc.returncode}: {proc.stderr.strip()[-2000:]}'
    summary = os.path.join(workdir, 'summary.json')
    if os.path.exists(summary):
      with open(summary) as f:
        s = json.load(f)
      entry.update({k: s[k] for k in ('steps', 'train_s') if k in s})
      entry.update({k: v for k, v in s.items() if k.startswith(('base_', 'final_'))})
    results[name] = entry
  return results


# ---------------------------------------------------------------------------------------------
# Part 2: the transformers, ours against diffusers'.


def family_config(family: str, size: str):
  """configs/<family>.py's real architecture, or a toy of it (--size tiny)."""
  from configs import flux as flux_config  # pylint: disable=g-import-not-at-top
  from configs import qwenimage as qwen_config  # pylint: disable=g-import-not-at-top

  c = (qwen_config if family == 'qwenimage' else flux_config).get_config()
  c.model.remat, c.model.scan_layers = True, True
  if size == 'tiny':
    m = c.model
    m.num_layers, m.num_attention_heads, m.attention_head_dim = 2, 2, 32
    m.axes_dims_rope, m.joint_attention_dim = (8, 12, 12), 64
    m.num_single_layers = 2 if family == 'flux' else 0
    m.pooled_projection_dim = 32
    c.latent.height = c.latent.width = 8
    c.text.max_length = 8
  return c


def shapes_of(config, size: str) -> dict:
  p = config.model.patch_size
  hw = (config.latent.height // p, config.latent.width // p)
  return {
      'img_shape': (1, *hw),
      'n_img': hw[0] * hw[1],
      'n_txt': int(config.text.max_length),
      'batch': 16 if size == 'real' else 4,  # a rollout batch: 8 prompts x CFG
      'grad_batch': 2,  # a fragment batch
  }


def diffusers_kwargs(config) -> dict:
  """The diffusers transformer's constructor arguments for config.model."""
  m = config.model
  kw = dict(
      num_layers=m.num_layers,
      attention_head_dim=m.attention_head_dim,
      num_attention_heads=m.num_attention_heads,
      joint_attention_dim=m.joint_attention_dim,
      axes_dims_rope=tuple(m.axes_dims_rope),
  )
  if m.family == 'flux':
    return dict(
        kw,
        patch_size=1,
        in_channels=m.in_channels,
        num_single_layers=m.num_single_layers,
        pooled_projection_dim=m.pooled_projection_dim,
        guidance_embeds=bool(m.guidance_embeds),
    )
  return dict(kw, patch_size=m.patch_size, in_channels=m.in_channels, out_channels=m.out_channels)


def _timed(fn, reps: int, sync) -> dict:
  """Median and best ms of `reps` calls after one warm-up call."""
  sync(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return {'ms': 1e3 * statistics.median(times), 'best_ms': 1e3 * min(times)}


def transformer_jax(family: str, size: str, reps: int) -> dict:
  """Our transformer: forward, then forward + backward (per-block remat), bf16 params."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import build as experiment  # pylint: disable=g-import-not-at-top
  from digen_jax import programs  # pylint: disable=g-import-not-at-top
  from digen_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top

  config = family_config(family, size)
  sh = shapes_of(config, size)
  fam = family_lib.of(config)
  mcfg = experiment.model_config_from(config)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: fam.new(mcfg, 0)))
  out = {'attention': experiment.attention_choice(config)}
  params = random_tree(abstract, jnp.bfloat16)
  out['memory_after_init'] = device_memory()
  velocity = programs.make_velocity_fn(
      graphdef, sh['img_shape'], jnp.bfloat16, fam, float(config.sampler.distilled_guidance)
  )

  def inputs(b):
    keys = iter(jax.random.split(jax.random.key(1), 4))
    normal = lambda shape: jax.random.normal(next(keys), shape, jnp.bfloat16)
    cond = {
        'text': normal((b, sh['n_txt'], config.model.joint_attention_dim)),
        'text_mask': jnp.ones((b, sh['n_txt']), jnp.int32),
    }
    if 'pooled' in fam.cond_keys:
      cond['pooled'] = normal((b, config.model.pooled_projection_dim))
    return normal((b, sh['n_img'], config.model.in_channels)), jnp.full((b,), 0.5), cond

  out['forward'] = program_figures(jax.jit(velocity), (params, *inputs(sh['batch'])), reps)
  out['memory_after_forward'] = device_memory()
  gx, gs, gc = inputs(sh['grad_batch'])
  grad = jax.jit(jax.grad(lambda p: jnp.mean(jnp.square(velocity(p, gx, gs, gc)))))
  out['grad'] = program_figures(grad, (params,), reps)
  out['memory_after_grad'] = device_memory()
  return out


def program_figures(jitted, args, reps: int) -> dict:
  """Compile (with XLA's memory analysis of the program), then time it on `args`."""
  import jax  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  figures = {'compile_s': time.perf_counter() - t0, **xla_memory(compiled)}
  figures.update(_timed(lambda: compiled(*args), reps, jax.block_until_ready))
  return figures


def random_tree(abstract, dtype=None):
  """Arrays shaped like the ShapeDtypeStructs of `abstract` (None leaves stay None), on their
  shardings (default device without one): floats N(0, 0.02) in `dtype` (None: the leaf's),
  integers and bools 1, PRNG keys. One small program per leaf, so the peak is the largest
  leaf's float32 draw, not the whole model's."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def one(i, leaf):
    sharding = getattr(leaf, 'sharding', None)
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.device_put(jax.random.key(i), sharding)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      dt = dtype or leaf.dtype
      draw = lambda k: (0.02 * jax.random.normal(k, leaf.shape)).astype(dt)
      return jax.jit(draw, out_shardings=sharding)(jax.random.key(i))
    return jax.jit(lambda: jnp.ones(leaf.shape, leaf.dtype), out_shardings=sharding)()

  leaves, treedef = jax.tree.flatten(abstract)
  return jax.block_until_ready(
      jax.tree.unflatten(treedef, [one(i, x) for i, x in enumerate(leaves)])
  )


def device_memory() -> dict:
  """Bytes in use and peak of device 0, GiB (CPU devices report none)."""
  import jax  # pylint: disable=g-import-not-at-top

  stats = jax.devices()[0].memory_stats() or {}
  return {
      'in_use_gib': stats.get('bytes_in_use', 0) / GIB,
      'peak_gib': stats.get('peak_bytes_in_use', 0) / GIB,
  }


def xla_memory(compiled) -> dict:
  """XLA's buffer assignment of a compiled program (GiB): arguments, outputs, temporaries,
  aliased (donated) bytes, and their sum less the aliases: the program's own peak."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  total = (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
  )
  return {
      'xla_argument_gib': m.argument_size_in_bytes / GIB,
      'xla_output_gib': m.output_size_in_bytes / GIB,
      'xla_temp_gib': m.temp_size_in_bytes / GIB,
      'xla_alias_gib': m.alias_size_in_bytes / GIB,
      'xla_peak_gib': total / GIB,
  }


def torch_spec(family: str, size: str) -> dict:
  """What transformer_torch needs of configs/<family>.py, as JSON: the diffusers constructor's
  arguments, the shapes and the input widths. The parent passes it to the torch child, which
  then never imports the configs (they import JAX and the package: ~8 s a child)."""
  config = family_config(family, size)
  m = config.model
  widths = ('in_channels', 'joint_attention_dim', 'pooled_projection_dim', 'guidance_embeds')
  return {
      'kwargs': diffusers_kwargs(config),
      'shapes': shapes_of(config, size),
      'model': {k: m.get(k) for k in widths},
  }


def transformer_torch(family: str, size: str, reps: int, spec: dict | None = None) -> dict:
  """diffusers' transformer, eager, bf16: forward under inference_mode, then forward + backward
  with gradient checkpointing; peak memory reset between phases. `spec`: torch_spec's (None:
  computed here)."""
  import types  # pylint: disable=g-import-not-at-top

  import diffusers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  spec = json.loads(json.dumps(spec or torch_spec(family, size)))  # the child's view of it
  sh = dict(spec['shapes'], img_shape=tuple(spec['shapes']['img_shape']))
  kwargs = dict(spec['kwargs'], axes_dims_rope=tuple(spec['kwargs']['axes_dims_rope']))
  dev = 'cuda' if torch.cuda.is_available() else 'cpu'
  cuda = dev == 'cuda'
  torch.manual_seed(0)
  cls = (
      diffusers.FluxTransformer2DModel
      if family == 'flux'
      else diffusers.QwenImageTransformer2DModel
  )
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(dev):
    model = cls(**kwargs)
  torch.set_default_dtype(torch.float32)
  model = model.to(dev, torch.bfloat16)
  sync = (lambda _: torch.cuda.synchronize()) if cuda else (lambda _: None)
  out = {'torch': torch.__version__, 'diffusers': diffusers.__version__}
  gen = torch.Generator(device=dev).manual_seed(1)
  m = types.SimpleNamespace(**spec['model'])

  def inputs(b):
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=torch.bfloat16)
    kw = dict(
        hidden_states=rand(b, sh['n_img'], m.in_channels),
        encoder_hidden_states=rand(b, sh['n_txt'], m.joint_attention_dim),
        timestep=torch.full((b,), 0.5, device=dev, dtype=torch.bfloat16),
        return_dict=False,
    )
    if family == 'flux':
      h, w = sh['img_shape'][1:]
      ids = torch.zeros(h, w, 3, device=dev)
      ids[..., 1] = torch.arange(h, device=dev)[:, None]
      ids[..., 2] = torch.arange(w, device=dev)[None, :]
      kw.update(
          pooled_projections=rand(b, m.pooled_projection_dim),
          img_ids=ids.reshape(-1, 3),
          txt_ids=torch.zeros(sh['n_txt'], 3, device=dev),
          guidance=torch.full((b,), 3.5, device=dev) if m.guidance_embeds else None,
      )
    else:
      kw.update(encoder_hidden_states_mask=None, img_shapes=[[sh['img_shape']]] * b)
    return kw

  def peak():
    return torch.cuda.max_memory_allocated() / GIB if cuda else 0.0

  if cuda:
    torch.cuda.reset_peak_memory_stats()
  out['memory_after_init'] = {'peak_gib': peak()}
  fwd_in = inputs(sh['batch'])

  def forward():
    with torch.inference_mode():
      return model(**fwd_in)[0]

  if cuda:
    torch.cuda.reset_peak_memory_stats()
  out['forward'] = _timed(forward, reps, sync)
  out['forward']['peak_gib'] = peak()
  model.enable_gradient_checkpointing()
  model.train()
  grad_in = inputs(sh['grad_batch'])

  def step():
    loss = model(**grad_in)[0].float().pow(2).mean()
    loss.backward()
    for p in model.parameters():
      p.grad = None
    return loss

  if cuda:
    torch.cuda.reset_peak_memory_stats()
  out['grad'] = _timed(step, reps, sync)
  out['grad']['peak_gib'] = peak()
  return out


def transformer_flops(family: str, size: str) -> dict:
  from digen_jax.experiment import build as experiment  # pylint: disable=g-import-not-at-top
  from digen_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top

  config = family_config(family, size)
  sh = shapes_of(config, size)
  fam, mcfg = family_lib.of(config), experiment.model_config_from(config)
  fwd = fam.flops_per_forward(mcfg, sh['batch'], sh['n_img'], sh['n_txt'])
  grad = 3 * fam.flops_per_forward(mcfg, sh['grad_batch'], sh['n_img'], sh['n_txt'])
  return {'forward': fwd, 'grad': grad, **{k: v for k, v in sh.items() if k != 'img_shape'}}


# ---------------------------------------------------------------------------------------------
# Part 3: the project's own programs.


def project_programs(size: str, reps: int) -> dict:
  """The rollout (sampling scan with CFG + VAE decode) and one fragment's update (gradient +
  optimizer step) of configs/qwenimage.py as the runtime builds them, on one device."""
  import jax  # pylint: disable=g-import-not-at-top
  from digen_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import abstract  # pylint: disable=g-import-not-at-top

  config = family_config('qwenimage', size)
  if size == 'tiny':
    config.latent.channels, config.model.in_channels, config.model.out_channels = 4, 16, 4
    config.sampler.num_steps = 3
  exp, vae_what = abstract.abstract_run(config, 'auto' if size == 'real' else 'tiny')
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  prompts = 8 if size == 'real' else 2
  grad_name = 'grad_tsp' if config.schedule.tsp else 'grad'
  built = abstract.run_programs(exp, mesh, prompts, only=('rollout',))
  built.update(abstract.run_programs(exp, mesh, 2, only=(grad_name, 'apply')))
  out = {'vae': vae_what, 'rollout_prompts': prompts, 'fragment_batch': 2}

  # The rollout, with its frozen weights (the LoRA base, the VAE) and copy of the params.
  rollout, args = built['rollout']
  frozen = random_tree(rollout.frozen)
  args = random_tree(args)
  out['memory_after_init'] = device_memory()
  compiled = rollout.program.lower(*args, frozen).compile()
  out['rollout'] = xla_memory(compiled)
  last = {}

  def run_rollout():
    last['traj'] = compiled(*args, frozen)[0]
    return last['traj']

  out['rollout'].update(_timed(run_rollout, reps, jax.block_until_ready))
  out['memory_after_rollout'] = device_memory()
  del compiled, args

  # One fragment's gradient on the first 2 trajectories of that batch (the accumulator it
  # donates is threaded through the calls), then the optimizer step (params and state too).
  grad, args = built[grad_name]
  g_frozen = {  # the trainer's layout of the same frozen weights
      k: None if a is None else jax.device_put(frozen[k], jax.tree.map(lambda x: x.sharding, a))
      for k, a in grad.frozen.items()
  }
  args = list(random_tree(args))
  traj = jax.tree.map(lambda a: a[:, :2] if a.ndim >= 2 else a, last.pop('traj'))
  args[2] = jax.device_put(traj, jax.tree.map(lambda a: a.sharding, args[2]))
  compiled = grad.program.lower(*args, g_frozen).compile()
  out['grad'] = xla_memory(compiled)

  def run_grad():
    args[1] = compiled(*args, g_frozen)
    return args[1]

  out['grad'].update(_timed(run_grad, reps, jax.block_until_ready))
  out['memory_after_grad'] = device_memory()
  apply, (params, opt, acc) = built['apply']
  state = {'params': random_tree(params), 'opt': random_tree(opt)}
  acc = random_tree(acc)
  compiled = apply.lower(state['params'], state['opt'], acc).compile()
  out['apply'] = xla_memory(compiled)

  def run_apply():
    state['params'], state['opt'], metrics = compiled(state['params'], state['opt'], acc)
    return metrics

  out['apply'].update(_timed(run_apply, reps, jax.block_until_ready))
  out['memory_after_apply'] = device_memory()
  return out


# ---------------------------------------------------------------------------------------------
# The whole check.


def device_info() -> dict:
  import flax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  d = jax.devices()[0]
  info = {
      'device': getattr(d, 'device_kind', str(d)),
      'platform': d.platform,
      'jax': jax.__version__,
      'flax': flax.__version__,
      'python': sys.version.split()[0],
      'date': time.strftime('%Y-%m-%d %H:%M %Z'),
  }
  # The versions from the installed packages' metadata: importing torch and diffusers here would
  # cost this process ~15 s (the torch children import them anyway). Only a GPU machine asks
  # torch which device it sees.
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  try:
    info.update(torch=metadata.version('torch'), diffusers=metadata.version('diffusers'))
  except metadata.PackageNotFoundError as e:
    info['torch_missing'] = f'No module named {str(e)!r}'
    return info
  if d.platform == 'gpu':
    try:
      import torch  # pylint: disable=g-import-not-at-top

      if torch.cuda.is_available():
        info['torch_device'] = torch.cuda.get_device_name()
    except ImportError as e:
      info['torch_missing'] = str(e)
  return info


def peak_tflops(device: str) -> float | None:
  return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)


def summarize(result: dict) -> dict:
  """Ratios against diffusers, MFU and the targets, from the raw figures."""
  out = {}
  peak = peak_tflops(result['machine']['device'])
  for family, r in result.get('transformers', {}).items():
    ours, ref, flops = r.get('jax', {}), r.get('torch', {}), r['flops']
    s = {}
    for phase, target in (('forward', 1.25), ('grad', 2.0)):
      if 'ms' in ours.get(phase, {}) and 'ms' in ref.get(phase, {}):
        s[f'{phase}_speedup_vs_diffusers'] = ref[phase]['ms'] / ours[phase]['ms']
        s[f'{phase}_target'] = target
      if peak and 'ms' in ours.get(phase, {}):
        s[f'{phase}_mfu'] = flops[phase] / (ours[phase]['ms'] / 1e3) / (peak * 1e12)
      if peak and 'ms' in ref.get(phase, {}):
        s[f'{phase}_mfu_diffusers'] = flops[phase] / (ref[phase]['ms'] / 1e3) / (peak * 1e12)
    grad_peak = ours.get('memory_after_grad', {}).get('peak_gib', 0.0)
    torch_peak = ref.get('grad', {}).get('peak_gib', 0.0)
    if grad_peak and torch_peak:
      s['grad_peak_vs_torch'] = grad_peak / torch_peak
      s['grad_peak_target'] = 1.1
    out[family] = s
  main = result.get('runs', {}).get('main_job', {})
  if 'wall_s' in main:
    out['main_job'] = {
        'wall_s': main['wall_s'],
        'target_s': 120.0,
        **{k: v for k, v in main.items() if 'accuracy' in k},
    }
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--out', required=False, help='folder for gpu_check.json and the runs')
  p.add_argument('--size', choices=('real', 'tiny'), default='real')
  p.add_argument('--parts', default=','.join(PARTS), help=f'comma-separated subset of {PARTS}')
  p.add_argument('--families', default=','.join(FAMILIES))
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--timeout', type=int, default=900, help='seconds per child process')
  p.add_argument('--child', choices=('jax', 'torch', 'programs'), help=argparse.SUPPRESS)
  p.add_argument('--family', default='qwenimage', help=argparse.SUPPRESS)
  p.add_argument('--torch_spec', default=None, help=argparse.SUPPRESS)  # torch_spec's JSON
  a = p.parse_args(argv)
  if a.child:
    if a.child == 'torch':
      spec = json.loads(a.torch_spec) if a.torch_spec else None
      res = transformer_torch(a.family, a.size, a.reps, spec)
    elif a.child == 'jax':
      res = transformer_jax(a.family, a.size, a.reps)
    else:
      res = project_programs(a.size, a.reps)
    print(json.dumps(res))
    return
  if not a.out:
    p.error('--out is required')
  parts = [x for x in a.parts.split(',') if x]
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    p.error(f'--parts: unknown {unknown}; known: {PARTS}')
  os.makedirs(a.out, exist_ok=True)
  t0 = time.perf_counter()
  result = {
      'command': ' '.join(['python', 'benchmarks/gpu_check.py', *(argv or sys.argv[1:])]),
      'size': a.size,
      'machine': device_info(),
  }
  common = ['--size', a.size, '--reps', str(a.reps)]
  if 'runs' in parts:
    result['runs'] = run_configs(a.size, a.out, a.timeout)
  if 'transformers' in parts:
    result['transformers'] = {}
    for family in [f for f in a.families.split(',') if f]:
      result['transformers'][family] = {
          'flops': transformer_flops(family, a.size),
          'jax': _child(['--child', 'jax', '--family', family, *common], a.timeout),
          'torch': _child(
              [
                  *('--child', 'torch', '--family', family, *common),
                  f'--torch_spec={json.dumps(torch_spec(family, a.size))}',
              ],
              a.timeout,
          ),
      }
  if 'programs' in parts:
    result['programs'] = _child(['--child', 'programs', *common], a.timeout)
  result['summary'] = summarize(result)
  result['wall_s'] = time.perf_counter() - t0
  path = os.path.join(a.out, 'gpu_check.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2, sort_keys=True)
  print(json.dumps(result['summary'], indent=2, sort_keys=True))
  print(f'gpu_check: {path} ({result["wall_s"]:.0f} s)')


if __name__ == '__main__':
  main()
