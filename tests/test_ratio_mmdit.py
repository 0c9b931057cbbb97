"""The importance ratio of the real QwenImage MMDiT is 1 before the first update.

Rollout through the rollout program (one jitted scan, data-parallel), then recompute every
step's log-prob from the stored trajectory with unchanged params through the training path:
|exp(logp_new - logp_old) - 1| <= 1e-5 for every step, every SDE variant, with and without CFG.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwenimage
from digen_jax import experiment
from digen_jax import programs
from digen_jax.rl import objective
from digen_jax.runtime import mesh as mesh_lib


@pytest.mark.parametrize('sde', ['flow_grpo', 'dance', 'cps'])
@pytest.mark.parametrize('guidance', [0.0, 4.0])
def test_ratio_is_one_for_every_step(tmp_path, sde, guidance):
  c = qwenimage.get_config('tiny')
  c.sampler.sde = sde
  c.sampler.guidance_scale = guidance
  c.sampler.num_steps = 4
  exp = experiment.build(c, str(tmp_path), 2)
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  rollout = programs.make_rollout(exp, mesh)
  prompts = [p for p in exp.prompts.next_batch() for _ in range(c.rl.group_size)]
  emb, mask = exp.text_encoder.encode(prompts)
  cond = {'text': jnp.asarray(emb), 'text_mask': jnp.asarray(mask)}
  u_emb, u_mask = exp.text_encoder.encode([''] * len(prompts))
  uncond = {'text': jnp.asarray(u_emb), 'text_mask': jnp.asarray(u_mask)}
  traj = rollout(exp.params, cond, uncond, jax.random.key(0), jnp.int32(0))

  velocity_fn = programs.make_velocity_fn(exp.graphdef, exp.img_shape, exp.compute_dtype)
  T = c.sampler.num_steps
  steps = jnp.arange(T)
  logp_new, _, _ = jax.jit(lambda p, t, cd, u: objective.step_log_probs(
      velocity_fn, p, t, cd, steps, sde_cfg=exp.sde_cfg,
      guidance_scale=guidance if guidance > 1 else None, uncond=u if guidance > 1 else None,
      norm_rescale=c.sampler.norm_rescale and guidance > 1))(exp.params, traj, cond, uncond)
  logp_old = traj.log_probs
  stochastic = np.asarray(traj.sde_steps)
  assert stochastic[:-1].all() and not stochastic[-1]          # all but the last step are SDE
  assert np.all(np.asarray(logp_old)[:-1] != 0)                 # real log-probs, not placeholders
  ratio = np.exp(np.asarray(logp_new) - np.asarray(logp_old))
  assert np.abs(ratio - 1).max() <= 1e-5, np.abs(ratio - 1).max(axis=1)
