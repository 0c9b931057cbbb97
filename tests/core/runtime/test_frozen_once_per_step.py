"""config.schedule.frozen_once_per_step (runtime/trainer.py): with LoRA, the fragment gradients of
an optimizer step read the frozen base gathered once at the step's start instead of
all-gathering its FSDP shards in every fragment. Same update; fewer collectives per fragment."""

import os
import re

import jax
import numpy as np
import pytest

from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.runtime import bookkeeping
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.runtime import loop
from digen_jax.runtime import rollout as rollout_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import trainer as trainer_lib

# Float32 rounding (measured: accumulated gradients 2e-7 of the largest entry apart; parameters
# up to 3e-7 after an Adam step that moves them by 1e-4: Adam divides each entry by its own
# magnitude, so the tiniest gradient entries carry their rounding into the step).
GRAD_RTOL = 1e-5
PARAM_ATOL = 5e-6


def _tiny(**overrides):
  over = {'model.lora.rank': 4, 'schedule.fragments': 2, 'eval.every': 0, **overrides}
  return configlib.apply_overrides(qwenimage.get_config('tiny'), over)


def test_full_fine_tuning_has_no_frozen_base_to_gather():
  c = _tiny(**{'model.lora.rank': 0, 'schedule.frozen_once_per_step': True})
  with pytest.raises(ValueError, match='config.schedule.frozen_once_per_step .* leave it False'):
    configlib.validate(c, 2)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


_ITEMSIZE = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1}


def _all_gathers(trainer, state, frag, cond, adv):
  """(all-gather ops, bytes they gather) in the trainer's compiled fragment gradient (XLA's
  optimised HLO text: a loop body's once)."""
  frozen = state.get('frozen', trainer.frozen)
  args = (frag.traj, cond, cond, *adv, state['indices'], trainer.ref_params, trainer._old_params())
  args += (frozen,)
  hlo = trainer._grad.program.lower(trainer.params, state['acc'], *args).compile().as_text()
  shapes = re.findall(r'= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(', hlo)
  size = lambda dims: int(np.prod([int(d) for d in dims.split(',') if d]))
  return len(shapes), sum(size(dims) * _ITEMSIZE.get(dt, 4) for dt, dims in shapes)


@pytest.mark.slow
def test_one_gather_per_step_gives_the_same_update_with_fewer_collectives(tmp_path):
  """Two fragments of a LoRA step on 2 trainer devices, the base gathered per fragment and per
  step: the same accumulated update, and the per-step program gathers none of
  the base (fewer all-gathers, less than half the bytes)."""
  mesh = mesh_lib.make_mesh(jax.devices()[:2])
  out = {}
  frags = None
  for per_step in (False, True):
    wd = str(tmp_path / str(per_step))
    exp = experiment.build(_tiny(**{'schedule.frozen_once_per_step': per_step}), wd, 2)
    ckpt = bookkeeping.checkpointer(exp.output, os.path.join(wd, 'ckpt'), False)
    trainer = trainer_lib.Trainer(exp, mesh, ckpt, exp.plan, tag=True)
    plan = exp.plan
    prompts = [p for p in exp.prompts.next_batch() for _ in range(plan.group_size)]
    if frags is None:  # the same fragments for both trainers (TAG's sampler, trainer mesh)
      sampler = rollout_lib.Sampler(
          exp, mesh, trainer.param_shardings, plan, 'trainer', trace_lib.Tracer(False), 'allow'
      )
      frags = [sampler.sample(trainer.params, 0, prompts, 0, f) for f in range(plan.num)]
    rewards = np.concatenate([f.rewards for f in frags])
    state = trainer.begin(0)
    assert ('frozen' in state) == per_step
    gathers = None
    for f, frag in enumerate(frags):
      cond = trainer.encode(plan.prompts(f, prompts))
      adv = trainer.advantages(f, rewards)
      gathers = gathers or _all_gathers(trainer, state, frag, cond, adv)
      state = trainer.train(state, frag.traj, cond, *adv)
    grads = _leaves(state['acc']['grads'])
    metrics = jax.device_get(trainer.apply(state))
    assert 'frozen' not in state  # the gathered base is dropped with the step
    out[per_step] = (grads, _leaves(trainer.params), metrics, gathers)
    trainer.close()
  (d0, p0, m0, g0), (d1, p1, m1, g1) = out[False], out[True]
  assert float(m0['weight_sum']) == float(m1['weight_sum']) > 0
  assert float(m0['grad_norm']) == pytest.approx(float(m1['grad_norm']), rel=1e-5)
  # XLA sums the merged weights in another order with a replicated base: float32 rounding.
  scale = max(float(np.abs(y).max()) for y in d0)
  for x, y in zip(d1, d0):
    np.testing.assert_allclose(x, y, rtol=0, atol=GRAD_RTOL * scale)
  for x, y in zip(p1, p0):
    np.testing.assert_allclose(x, y, rtol=0, atol=PARAM_ATOL)
  # Measured on 2 devices: 52 all-gathers of 1.13 MB -> 24 of 0.28 MB (the adapters, the batch's layout).
  assert g1[0] < g0[0] and g1[1] < g0[1] / 2, (g0, g1)


@pytest.mark.slow
def test_a_lora_run_gathering_once_per_step_equals_one_gathering_per_fragment(tmp_path):
  """Whole colocated runs on 2 devices, GAP M = 2, LoRA: the same parameters after 3 steps."""
  params, init = [], _leaves(experiment.build_model(_tiny())[2])
  for per_step in (False, True):
    wd = str(tmp_path / str(per_step))
    c = _tiny(**{'schedule.frozen_once_per_step': per_step})
    out = loop.train(experiment.build(c, wd, 2), wd, cluster_lib.colocated(jax.devices()[:2]))
    params.append(_leaves(out['params']))
  moved = max(float(np.abs(x - y).max()) for x, y in zip(params[0], init))
  assert moved > 20 * PARAM_ATOL
  for x, y in zip(*params):
    np.testing.assert_allclose(x, y, rtol=0, atol=PARAM_ATOL)
