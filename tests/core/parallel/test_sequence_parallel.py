"""Sequence parallelism (config.parallel.sequence; models/attention/sequence_parallel.py, parallel/
sequence.py): each sample's tokens split over devices, attention through all-to-alls over
heads ("Ulysses"). Exact: the split Wan transformer equals the unsplit one to float32 rounding,
forward and gradient, on 4 fake CPU devices, with token counts the split does not divide; the
image families' attention likewise; the split reaches the model as an argument (token_mesh)
through the family's forward and the programs' velocity function; and a program with the split
equals it without. The 14B's
memory with and without the split is tests/perf/test_sequence_memory.py's (slow)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import wan21
from digen_jax import programs
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.models.transformers import mmdit
from digen_jax.models import family as family_lib
from digen_jax.models.transformers import wan
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.parallel import sequence
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.experiment import run as run_lib

TOL = 1e-5


def _wan(heads=4):
  config = wan.WanConfig(
      patch_size=2,
      in_channels=4,
      out_channels=4,
      num_layers=2,
      attention_head_dim=16,
      num_attention_heads=heads,
      joint_attention_dim=32,
      ffn_dim=48,
  )
  return wan.Wan(config, rngs=nnx.Rngs(0))


def _inputs(model, batch, img_shape, text_len=7):
  cfg = model.config
  ks = jax.random.split(jax.random.key(1), 3)
  n = int(np.prod(img_shape))
  latents = jax.random.normal(ks[0], (batch, n, cfg.token_channels))
  sigma = jax.random.uniform(ks[1], (batch,))
  text = jax.random.normal(ks[2], (batch, text_len, cfg.joint_attention_dim))
  return latents, sigma, text


def _program(graphdef, img_shape, view, batch):
  """(forward, gradient) jitted over the 4 devices' 1-D mesh, the batch sharded as the programs
  shard it where 4 divides it (else replicated); `view` the token split (None: none)."""
  mesh = mesh_lib.make_mesh(jax.devices()[:4])

  def forward(params, latents, sigma, text):
    model = nnx.merge(graphdef, params)
    return model(latents, sigma, text, img_shape=img_shape, token_mesh=view)

  def loss(params, latents, sigma, text):
    out = forward(params, latents, sigma, text)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

  rep = mesh_lib.replicated(mesh)
  data = lambda nd: mesh_lib.batch_sharding(mesh, nd) if batch % 4 == 0 else rep
  in_sh = (rep, data(3), data(1), data(3))
  return (
      jax.jit(forward, in_shardings=in_sh),
      jax.jit(jax.grad(loss), in_shardings=in_sh),
      mesh,
  )


def _max_rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.mark.parametrize(
    'split, batch, img_shape',
    [
        (4, 2, (3, 2, 3)),  # 18 tokens over 4 devices: padded to 20; 2 samples on 1 group
        pytest.param(2, 3, (3, 3, 1), marks=pytest.mark.slow),  # 3 samples, 9 tokens over 2
        pytest.param(2, 2, (5, 2, 2), marks=pytest.mark.slow),  # 20 tokens: no padding
        pytest.param(4, 4, (1, 2, 2), marks=pytest.mark.slow),  # one frame, batch sharded
    ],
)
def test_split_wan_equals_unsplit_forward_and_gradient(split, batch, img_shape):
  model = _wan()
  graphdef, params = nnx.split(model)
  args = _inputs(model, batch, img_shape)
  fwd, grad, mesh = _program(graphdef, img_shape, None, batch)
  view = sequence.token_mesh(mesh, split)
  fwd_s, grad_s, _ = _program(graphdef, img_shape, view, batch)
  assert view.shape == {sequence.SAMPLES: 4 // split, sequence.TOKENS: split}
  want, got = fwd(params, *args), fwd_s(params, *args)
  assert _max_rel(got, want) <= TOL
  g_want, g_got = grad(params, *args), grad_s(params, *args)
  leaves = jax.tree_util.tree_leaves_with_path(g_want)
  assert len(leaves) == len(jax.tree.leaves(g_got)) > 20
  for (path, a), b in zip(leaves, jax.tree.leaves(g_got)):
    assert _max_rel(b, a) <= TOL, (jax.tree_util.keystr(path), _max_rel(b, a))
  # The split program runs all-to-alls (Ulysses), the unsplit one none.
  hlo = fwd_s.lower(params, *args).compile().as_text()
  assert 'all-to-all' in hlo
  assert 'all-to-all' not in fwd.lower(params, *args).compile().as_text()


def test_the_velocity_function_passes_the_split_to_the_model():
  """programs.make_velocity_fn's token_mesh reaches the Wan forward through the family table:
  the velocity it computes equals the model called with the same token_mesh (and the unsplit
  one), its program runs the all-to-alls, and without the argument nothing is split. A mesh
  that is not (samples, tokens) fails naming the argument."""
  model = _wan()
  graphdef, params = nnx.split(model)
  img_shape = (3, 2, 3)
  latents, sigma, text = _inputs(model, 2, img_shape)
  cond = {'text': text, 'text_mask': jnp.ones(text.shape[:2], jnp.int32)}
  mesh = mesh_lib.make_mesh(jax.devices()[:4])
  view = sequence.token_mesh(mesh, 2)
  fam = family_lib.get('wan')
  velocity = {
      m: jax.jit(programs.make_velocity_fn(graphdef, img_shape, jnp.float32, fam, token_mesh=m))
      for m in (None, view)
  }
  direct = jax.jit(
      lambda p: nnx.merge(graphdef, p)(latents, sigma, text, img_shape=img_shape, token_mesh=view)
  )
  want = velocity[None](params, latents, sigma, cond)
  got = velocity[view](params, latents, sigma, cond)
  assert _max_rel(got, direct(params)) == 0.0
  assert _max_rel(got, want) <= TOL
  hlo = lambda m: velocity[m].lower(params, latents, sigma, cond).compile().as_text()
  assert 'all-to-all' in hlo(view) and 'all-to-all' not in hlo(None)
  with pytest.raises(ValueError, match=r'token_mesh must be a \(samples, tokens\) mesh'):
    fam.forward(model, latents, sigma, cond, img_shape, 0.0, token_mesh=mesh)


def test_split_mmdit_equals_unsplit_with_a_text_mask():
  """The image families share the attention: Qwen-Image's MMDiT, 5 text + 12 image tokens (17:
  padded to 18 over 2 devices) with padded text keys, split over 2 of 4 devices."""
  cfg = mmdit.MMDiTConfig(
      in_channels=8,
      out_channels=2,
      num_layers=2,
      attention_head_dim=16,
      num_attention_heads=2,
      joint_attention_dim=12,
      axes_dims_rope=(4, 6, 6),
  )
  graphdef, params = nnx.split(mmdit.MMDiT(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(3)
  lat = jnp.asarray(rng.normal(size=(2, 12, 8)), jnp.float32)
  text = jnp.asarray(rng.normal(size=(2, 5, 12)), jnp.float32)
  mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], jnp.int32)
  sigma = jnp.asarray([0.3, 0.8])
  view = sequence.token_mesh(mesh_lib.make_mesh(jax.devices()[:4]), 2)

  def forward(params, split):
    model = nnx.merge(graphdef, params)
    return model(lat, sigma, text, mask, img_shape=(1, 3, 4), token_mesh=split)

  want = jax.jit(lambda p: forward(p, None))(params)
  got = jax.jit(lambda p: forward(p, view))(params)
  assert _max_rel(got, want) <= TOL


# ------------------------------------------------------------------------------ programs


@pytest.mark.slow
def test_programs_with_the_split_equal_them_without(tmp_path):
  """configs/wan21.py:tiny (2 heads, 3 frames of 8 x 8 tokens) on 4 devices, its tokens split
  over 2: the rollout program's trajectory and the fragment gradient (2 real samples of 4 rows:
  the split computes 2 rows, one per pair of devices; without it 4, two of weight 0) equal the
  unsplit programs'."""
  config = configlib.apply_overrides(
      wan21.get_config('tiny'),
      {'sampler.num_steps': 3, 'rl.group_size': 2},
  )
  exp = experiment.build(config, str(tmp_path), 4)
  split_config = configlib.apply_overrides(copy.deepcopy(config), {'parallel.sequence': 2})
  configlib.validate(split_config, 4)
  exp_split = experiment.respec(exp, split_config)
  mesh = mesh_lib.make_mesh(jax.devices()[:4])
  assert programs.row_unit(exp, mesh) == 4 and programs.row_unit(exp_split, mesh) == 2
  prompts = [p for p in exp.prompts.next_batch() for _ in range(2)]
  cond = jax.device_put(
      exp.conditioning(prompts), programs.cond_shardings(mesh, exp.cond_abstract(1))
  )
  key, step = jax.random.key(3), np.int32(0)
  psh = mesh_lib.fsdp_shardings(exp.params, mesh)
  traj_sh = programs.trajectory_shardings(mesh)
  out = {}
  for name, e in (('plain', exp), ('split', exp_split)):
    params = jax.device_put(jax.device_get(exp.params), psh)
    traj, videos = programs.make_rollout(e, mesh, psh, traj_sh)(params, cond, cond, key, step)
    adv = jax.device_put(
        np.array([1.0, 0.5, 0.0, 0.0], np.float32), mesh_lib.batch_sharding(mesh, 1)
    )
    valid = jax.device_put(np.array([True, True, False, False]), mesh_lib.batch_sharding(mesh, 1))
    indices = programs.make_select(e, mesh)(key, step)
    grad = programs.make_fragment_grad(e, mesh, psh, traj_sh, samples=2)
    acc = grad(
        params,
        programs.make_zero_acc(psh, mesh)(params),
        traj,
        cond,
        cond,
        adv,
        valid,
        indices,
        None,
        None,
    )
    out[name] = jax.device_get((traj.latents, traj.log_probs, videos, acc))
  (lat, lp, vid, acc), (lat_s, lp_s, vid_s, acc_s) = out['plain'], out['split']
  assert vid.shape == (4, 3, 16, 16, 3)
  assert _max_rel(lat_s, lat) <= TOL and _max_rel(lp_s, lp) <= TOL
  assert np.abs(vid_s.astype(int) - vid.astype(int)).max() <= 1  # uint8 rounding of equal floats
  assert acc['sums']['weight_sum'] == acc_s['sums']['weight_sum'] > 0
  assert abs(acc_s['sums']['loss'] - acc['sums']['loss']) <= TOL * abs(acc['sums']['loss'])
  g, g_s = jax.tree.leaves(acc['grads']), jax.tree.leaves(acc_s['grads'])
  scale = max(float(np.abs(x).max()) for x in g)
  assert max(float(np.abs(x - y).max()) for x, y in zip(g_s, g)) <= TOL * scale


# ------------------------------------------------------------------------------ config checks


@pytest.mark.parametrize(
    'overrides, devices, message',
    [
        ({'parallel.sequence': 4}, 4, r'config.parallel.sequence=4 must divide the model\'s 2 '),
        ({'parallel.sequence': 3, 'model.num_attention_heads': 6}, 4, r'divide the 4 devices'),
        ({'parallel.sequence': 0}, 4, r'parallel.sequence=0 must be an int >= 1'),
        ({'parallel.sequence': 2, 'schedule.tsp': True}, 4, r'do not combine yet'),
    ],
)
def test_a_bad_split_fails_at_config_load_naming_the_field(overrides, devices, message):
  config = configlib.apply_overrides(wan21.get_config('tiny'), overrides)
  with pytest.raises(ValueError, match=message):
    configlib.validate(config, devices)


def test_disagg_checks_the_split_against_each_role():
  config = configlib.apply_overrides(
      wan21.get_config('tiny,disagg'),
      {'model.num_attention_heads': 4, 'parallel.sequence': 4, 'model.attention_head_dim': 8},
  )
  configlib.validate(config, 4)  # 4 devices in all: each role has 2
  with pytest.raises(ValueError, match="must divide the trainer role's 2 devices: one of 1, 2"):
    cluster_lib.resolve(run_lib.cluster_spec(config), jax.devices()[:4])
  config.parallel.sequence = 2
  cluster_lib.resolve(run_lib.cluster_spec(config), jax.devices()[:4])
