"""The importance ratio of the real QwenImage MMDiT (and of FLUX) is 1 before the first update.

Rollout through the rollout program (one jitted scan, data-parallel), then recompute every
step's log-prob from the stored trajectory with unchanged params through the training path:
|exp(logp_new - logp_old) - 1| <= 1e-5 for every step, every SDE variant, with and without CFG
(FLUX: with its distilled guidance input instead).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import flux
from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax import programs
from digen_jax.rl import objective
from digen_jax.parallel import mesh as mesh_lib


@pytest.mark.parametrize('sde', ['flow_grpo', 'dance', 'cps'])
@pytest.mark.parametrize('family,guidance', [('qwenimage', 0.0), ('qwenimage', 4.0), ('flux', 0.0)])
def test_ratio_is_one_for_every_step(tmp_path, sde, family, guidance):
  c = (qwenimage if family == 'qwenimage' else flux).get_config('tiny')
  c.sampler.sde = sde
  c.sampler.guidance_scale = guidance
  c.sampler.num_steps = 4
  exp = experiment.build(c, str(tmp_path), 2)
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  rollout = programs.make_rollout(exp, mesh)
  prompts = [p for p in exp.prompts.next_batch() for _ in range(c.rl.group_size)]
  cond = jax.tree.map(jnp.asarray, exp.conditioning(prompts))
  uncond = jax.tree.map(jnp.asarray, exp.conditioning([''] * len(prompts)))
  traj, _ = rollout(exp.params, cond, uncond, jax.random.key(0), jnp.int32(0))

  velocity_fn = programs.velocity_fn_of(exp)
  T = c.sampler.num_steps
  steps = jnp.arange(T)
  logp_new, _, _ = jax.jit(
      lambda p, t, cd, u: objective.step_log_probs(
          velocity_fn,
          p,
          t,
          cd,
          steps,
          sde_cfg=exp.sde_cfg,
          guidance_scale=guidance if guidance > 1 else None,
          uncond=u if guidance > 1 else None,
          norm_rescale=c.sampler.norm_rescale and guidance > 1,
      )
  )(exp.params, traj, cond, uncond)
  logp_old = traj.log_probs
  stochastic = np.asarray(traj.sde_steps)
  assert stochastic[:-1].all() and not stochastic[-1]  # all but the last step are SDE
  assert np.all(np.asarray(logp_old)[:-1] != 0)  # real log-probs, not placeholders
  ratio = np.exp(np.asarray(logp_new) - np.asarray(logp_old))
  assert np.abs(ratio - 1).max() <= 1e-5, np.abs(ratio - 1).max(axis=1)


def _max_ratio_dev(c, tmp_path, perturb_adapters=False):
  """max |exp(logp_trainer - logp_rollout) - 1| over the SDE steps of one rollout batch: the
  rollout program on a 2-device mesh with its own (replicated) frozen weights, the trainer's
  recomputation on another 2-device mesh with FSDP-sharded frozen weights (as the roles hold
  them)."""
  exp = experiment.build(c, str(tmp_path), 2)
  roll_mesh = mesh_lib.make_mesh(jax.devices()[:2])
  train_mesh = mesh_lib.make_mesh(jax.devices()[2:4])
  params = exp.params
  if perturb_adapters:  # B = 0 would make the adapters a no-op: give them real values
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), params
    )
  prompts = [p for p in exp.prompts.next_batch() for _ in range(c.rl.group_size)]
  emb, mask = exp.text_encoder.encode(prompts)
  cond = {'text': jnp.asarray(emb), 'text_mask': jnp.asarray(mask)}
  u_emb, u_mask = exp.text_encoder.encode([c.sampler.negative_prompt] * len(prompts))
  uncond = {'text': jnp.asarray(u_emb), 'text_mask': jnp.asarray(u_mask)}
  traj, _ = programs.make_rollout(exp, roll_mesh)(
      params, cond, uncond, jax.random.key(0), jnp.int32(0)
  )
  frozen = exp.weights.frozen(train_mesh, fsdp=True, decode=False)
  velocity_fn = programs.velocity_fn_of(exp)
  guidance = c.sampler.guidance_scale
  steps = jnp.arange(c.sampler.num_steps)
  logp_new, _, _ = jax.jit(
      lambda p, fr, t, cd, u: objective.step_log_probs(
          velocity_fn,
          exp.weights.effective(p, fr),
          t,
          cd,
          steps,
          sde_cfg=exp.sde_cfg,
          guidance_scale=guidance if guidance > 1 else None,
          uncond=u if guidance > 1 else None,
          norm_rescale=c.sampler.norm_rescale and guidance > 1,
      )
  )(
      jax.device_put(params, mesh_lib.fsdp_shardings(params, train_mesh)),
      frozen,
      jax.device_put(traj, mesh_lib.replicated(train_mesh)),
      cond,
      uncond,
  )
  sde = np.asarray(traj.sde_steps)
  ratio = np.exp(np.asarray(logp_new) - np.asarray(traj.log_probs))[sde]
  return float(np.abs(ratio - 1).max())


def test_ratio_is_one_with_lora(tmp_path):
  """LoRA: the rollout merges the published adapters into its own frozen base copy, the trainer
  into its FSDP-sharded one; the importance ratio before the first update is still 1."""
  c = qwenimage.get_config('tiny')
  c.model.lora.rank, c.model.lora.alpha = 4, 8.0
  c.model.lora.targets = r'attn\.(to_q|to_v|add_k_proj)$|img_mlp'
  c.sampler.guidance_scale = 4.0
  c.sampler.num_steps = 4
  assert _max_ratio_dev(c, tmp_path, perturb_adapters=True) <= 1e-5


@pytest.mark.parametrize('lora', [False, True])
@pytest.mark.slow
def test_bf16_ratio_is_one_with_trainer_behaviour_logprobs(tmp_path, lora):
  """Real-model numerics (bf16 compute, bf16 frozen copies, float32 masters): the rollout's and
  the trainer's programs round differently, so the rollout's stored log-probs put |ratio - 1|
  beyond the 1e-4 clip range (metrics: rollout_ratio_max_dev); rl.behaviour_logprobs='trainer'
  (the real configs' default) makes the update's ratio exactly 1 (ratio_max_dev), and
  'rollout' shows the problem it solves."""
  import json
  from digen_jax.runtime import cluster as cluster_lib
  from digen_jax.runtime import loop

  rows = {}
  for behaviour in ('rollout', 'trainer'):
    c = qwenimage.get_config('tiny')
    c.optim.compute_dtype = c.model.frozen_dtype = 'bfloat16'
    c.sampler.guidance_scale = 4.0
    c.total_steps = 1
    c.rl.behaviour_logprobs = behaviour
    if lora:
      c.model.lora.rank, c.model.lora.alpha = 4, 8.0
    wd = tmp_path / behaviour
    exp = experiment.build(c, str(wd), 2)
    loop.train(exp, str(wd), cluster_lib.colocated(jax.devices()[:2]))
    rows[behaviour] = [json.loads(l) for l in open(wd / 'metrics.jsonl')][0]
  assert rows['trainer']['ratio_max_dev'] == 0.0 and rows['trainer']['ratio_mean'] == 1.0
  assert rows['trainer']['clip_frac'] == 0.0
  assert rows['rollout']['ratio_max_dev'] > 1e-4, rows['rollout']
  # Same rollout (same seed) in both runs: the gap the trainer reports is the one it removes.
  assert rows['trainer']['rollout_ratio_max_dev'] == pytest.approx(
      rows['rollout']['ratio_max_dev'], rel=1e-3
  )
