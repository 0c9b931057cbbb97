"""No program holds a device array as a compile-time constant.

A jax.Array closed over by a jitted function is embedded in the compiled program; lowering copies
it to the host, which a GPU under our default transfer guard ('disallow') refuses: the first GPU
run of the main job failed that way (`jnp.asarray(exp.sigmas)` closed over by the rollout). On
the CPU the array already lives on the host, so nothing fails there. This test traces every
program that every config in configs/ builds (each variant; the RL programs of every mode on 4
fake devices, abstract arguments, nothing compiled; the pretraining programs of the pretraining
config) and fails on any captured jax.Array.
"""

import glob
import importlib
import os

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest

from digen_jax.experiment import build as experiment
from digen_jax.tasks.shapes import pretrain
from digen_jax import programs
from digen_jax.diffusion import sde as sde_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.perf import abstract
from tests.helpers.paths import REPO

CONFIG_NAMES = sorted(
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
    if not p.endswith('__init__.py')
)


def _module(name):
  return importlib.import_module(f'configs.{name}')


def _specs(pretraining: bool):
  """Every config and variant; the variants' RL programs are slow-marked (2-4 s of tracing
  each, ~30 of them): the fast tier traces each config file's default, the full suite every
  variant."""
  out = []
  for name in CONFIG_NAMES:
    for variant in ('',) + tuple(_module(name).VARIANTS):
      if hasattr(_module(name).get_config(variant or None), 'pretrain') == pretraining:
        spec = f'{name}:{variant}' if variant else name
        slow = variant and not pretraining
        out.append(pytest.param(spec, marks=pytest.mark.slow) if slow else spec)
  return out


def _config(spec):
  name, _, variant = spec.partition(':')
  return _module(name).get_config(variant or None)


def test_every_config_lists_its_variants():
  assert CONFIG_NAMES, 'no config files found'
  for name in CONFIG_NAMES:
    variants = getattr(_module(name), 'VARIANTS', None)
    assert isinstance(variants, tuple), f'configs/{name}.py must define VARIANTS (a tuple)'


def test_the_check_finds_a_captured_array():
  table = jnp.arange(3.0)  # a device array closed over: what the GPU refused
  host = np.arange(3.0, dtype=np.float32)  # numpy: staged as a literal, fine

  def body(c, i):
    return c + table[i], None

  traced = jax.jit(lambda x: jax.lax.scan(body, x * host, jnp.arange(3))[0]).trace(jnp.ones(3))
  assert programs.captured_arrays(traced.jaxpr) == ['float32[3] (top level)']
  assert programs.captured_arrays(jax.jit(lambda x: x * host).trace(jnp.ones(3)).jaxpr) == []


@pytest.mark.parametrize('spec', _specs(pretraining=False))
def test_rl_programs_capture_no_device_array(spec):
  config = _config(spec)
  exp, _ = abstract.abstract_run(config)
  mesh = mesh_lib.make_mesh(jax.devices()[:4])
  layout = config.cluster.rollout.param_sharding
  found = {}
  for name, (program, args) in abstract.run_programs(exp, mesh, 4, rollout_layout=layout).items():
    captured = programs.captured_arrays(program.trace(*args).jaxpr)
    if captured:
      found[name] = captured
  assert not found, f'{spec}: programs holding device arrays as constants: {found}'


@pytest.mark.parametrize('spec', _specs(pretraining=True))
def test_pretrain_programs_capture_no_device_array(spec):
  config = _config(spec)
  mcfg = experiment.model_config_from(config)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: experiment.family_lib.of(config).new(mcfg, 0)))
  grid, patch = int(config.latent.height), int(config.model.patch_size)
  img_shape = (1, grid // patch, grid // patch)
  tokens = img_shape[1] * img_shape[2]
  codec = pretrain.latent_codec(config)
  sigmas = experiment.build_schedule(config, tokens)
  b, length = 2, int(config.text.max_length)
  sds = jax.ShapeDtypeStruct
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), state)
  text = sds((b, length, int(config.model.joint_attention_dim)), jnp.float32)
  mask = sds((b, length), jnp.int32)
  uncond = (np.zeros((1, *text.shape[1:]), np.float32), np.ones((1, length), np.int32))
  key = sds((), jax.random.key(0).dtype)
  x1 = sds((b, tokens, int(config.model.in_channels)), jnp.float32)
  size = int(config.pretrain.image_size)
  images = sds((b, size, size, 3), jnp.float32)
  sde_cfg = sde_lib.SDEConfig(kind=config.sampler.sde, noise_level=config.sampler.noise_level)
  optimizer = experiment.build_optimizer(config)
  opt = jax.eval_shape(optimizer.init, params)
  traced = {
      'to_tokens': jax.jit(codec.to_tokens).trace(codec.params, images),
      'train_step': pretrain.make_train_step(graphdef, optimizer, config.pretrain, img_shape).trace(
          params, opt, params, sds((), jnp.float32), x1, text, mask, uncond, key
      ),
  }
  for name, kind in (('ode', None), ('sde', sde_cfg)):
    sampler = pretrain.make_sampler(
        graphdef, sigmas, img_shape, codec.to_images, kind, guidance=(3.0, False, uncond)
    )
    traced[name] = sampler.trace(params, codec.params, x1, text, mask, key)
  found = {n: c for n, t in traced.items() if (c := programs.captured_arrays(t.jaxpr))}
  assert not found, f'{spec}: programs holding device arrays as constants: {found}'
