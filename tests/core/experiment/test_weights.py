"""weights.Weights: frozen weights load once per mesh and layout, and the roles pick the layout
the config asks for (a colocated rollout shares the trainer's FSDP base, no second copy)."""

import jax
import numpy as np

from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.experiment import build as experiment
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import publish
from digen_jax.experiment import run as run_lib


def _lora_weights():
  c = qwenimage.get_config('tiny')
  c.model.lora.rank, c.model.lora.alpha = 2, 2.0
  return c, experiment.build_weights(c)[1]


def test_frozen_base_once_per_mesh_and_layout():
  _, w = _lora_weights()
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  fsdp = w.frozen(mesh, fsdp=True, decode=True)
  assert w.frozen(mesh, fsdp=True, decode=False)['base'] is fsdp['base']  # cached, shared
  rep = w.frozen(mesh, fsdp=False, decode=True)['base']
  assert rep is not fsdp['base']
  sharded = [x for x in jax.tree.leaves(fsdp['base']) if not x.sharding.is_fully_replicated]
  assert sharded and all(x.sharding.is_fully_replicated for x in jax.tree.leaves(rep))
  for a, b in zip(jax.tree.leaves(fsdp['base']), jax.tree.leaves(rep)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert fsdp['vae'] is None  # pixel space: no decoder weights


def test_rollout_frozen_layout_follows_the_cluster():
  c, _ = _lora_weights()
  assert publish.rollout_frozen_fsdp(cluster_lib.colocated(jax.devices()[:2]))
  configlib.set_disagg(c)
  assert not publish.rollout_frozen_fsdp(cluster_lib.resolve(run_lib.cluster_spec(c)))
  c.cluster.rollout.param_sharding = 'fsdp'
  assert publish.rollout_frozen_fsdp(cluster_lib.resolve(run_lib.cluster_spec(c)))


def test_lora_kl_reference_is_the_base(tmp_path):
  """With LoRA the KL reference is the frozen base (adapters off): no second copy of the base,
  and the KL is 0 while the adapters are still at their B = 0 init (to float rounding: the policy
  and the reference are two computations of the same function), clearly > 0 after."""
  import json
  from digen_jax.runtime import loop

  c, _ = _lora_weights()
  c.rl.kl_beta, c.total_steps, c.optim.lr = 0.1, 2, 3e-2
  exp = experiment.build(c, str(tmp_path), 2)
  out = loop.train(exp, str(tmp_path), cluster_lib.colocated(jax.devices()[:2]))
  assert set(out['params']) == set(exp.params)  # the trainer holds adapters only
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert rows[0]['kl'] <= 1e-12 and rows[1]['kl'] > 1e-9, rows
