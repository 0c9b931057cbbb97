"""A reward's cost per sample in the planner: config.reward.device_s_per_sample (a
run measures its own: metrics.jsonl's reward_s_per_sample) on cost_accelerator. A colocated run
pays it on its own devices; a disaggregated one on the rollout's devices after each fragment,
or, with the reward in worker processes on accelerators of their own, on those workers while
the rollout samples the next fragment (the rollout's cycle the slower of the two, the fragment
its scoring later at the trainer), and TAG's fragments cost the trainer no scoring."""

import dataclasses

import pytest

from configs import qwenimage
from digen_jax.perf import analytic
from digen_jax.perf import hardware
from digen_jax.perf import planner as planning
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search

COST = 0.2  # device-seconds per sample on an H100: a large learned reward model


def _config(**reward):
  c = qwenimage.get_config('')
  for k, v in reward.items():
    c.reward[k] = v
  return c


@pytest.mark.parametrize(
    'fields, workers',
    [
        ({}, 0),  # host rewards: free
        ({'weights': 'ocr', 'device_s_per_sample': COST, 'cost_accelerator': 'H100'}, 0),  # CPU
        (
            {
                'weights': 'ocr',
                'workers': 4,
                'worker_devices': 'cuda:0,cuda:1',
                'device_s_per_sample': COST,
                'cost_accelerator': 'H100',
            },
            4,
        ),
        (
            {
                'weights': 'mine',
                'remote': 'mine=http://scorer:8008/',
                'workers': 3,
                'device_s_per_sample': COST,
                'cost_accelerator': 'H100',
            },
            3,
        ),
        (  # a host reward with a stated cost: paid where sampled
            {
                'weights': 'jpeg_compressibility',
                'worker_devices': 'cuda:0',
                'device_s_per_sample': COST,
                'cost_accelerator': 'H100',
            },
            0,
        ),
    ],
)
def test_reward_terms_say_where_the_reward_is_paid(fields, workers):
  terms = rm.reward_terms(_config(**fields))
  assert terms['reward_workers'] == workers
  assert terms['reward_device_s'] == fields.get('device_s_per_sample', 0.0)


@pytest.fixture(scope='module')
def runs():
  """HunyuanVideo full fine-tuning (analytic costs: nothing compiled) without a reward cost,
  with one paid where the samples are made, and with one paid on 4 reward worker GPUs."""
  free = analytic.run_model(analytic.HUNYUAN_VIDEO)
  on_role = dataclasses.replace(free, reward_device_s=COST, reward_accelerator='H100')
  return free, on_role, dataclasses.replace(on_role, reward_workers=4)


def test_colocated_pays_the_reward_on_its_own_devices(runs):
  free, on_role, workers = runs
  parts = hardware.parse_cluster('16xH100')
  got = {name: search.Planner(r, parts, steps=2).colocated() for name, r in zip('fow', runs)}
  extra = COST * free.batch / 16  # spread over its 16 devices, on the kind it was stated on
  assert got['o'].costs.rollout == pytest.approx(got['f'].costs.rollout + extra)
  assert got['w'].costs.rollout == got['o'].costs.rollout  # workers or not: its own devices
  assert got['o'].bound_s > got['f'].bound_s  # seconds per step


def test_disaggregated_pays_it_on_the_rollout_or_beside_it_on_reward_workers(runs):
  free, on_role, workers = runs
  parts = hardware.parse_cluster('16xH100')
  split = search.Split(
      roles.Group(hardware.parse_cluster('8xH100')), roles.Group(hardware.parse_cluster('8xH100'))
  )
  m = 4
  b = free.batch // m
  cand = {
      name: search.Planner(r, parts, steps=2).disagg('gap_tag', split, m)
      for name, r in zip('fow', runs)
  }
  f, o, w = (cand[k].costs for k in 'fow')
  # On the rollout's devices: after sampling, spread over them.
  assert o.rollout == pytest.approx(f.rollout + COST * -(-b // 8))
  assert o.deliver == f.deliver and o.tag_rollout == pytest.approx(
      f.tag_rollout + COST * -(-b // 8)
  )
  # On 4 reward workers: the rollout samples on while they score (its cycle the slower of the
  # two), the fragment reaches the trainer its scoring later, and TAG pays nothing for it.
  score = COST * -(-b // 4)
  assert w.rollout == pytest.approx(max(f.rollout, score))
  assert w.deliver == pytest.approx(f.deliver + score)
  assert w.tag_rollout == f.tag_rollout
  # Scoring beside the rollout is never slower than after it, here strictly faster.
  p_o, p_w = (search.Planner(r, parts, steps=4) for r in (on_role, workers))
  sim_o = p_o.simulate(cand['o'])
  sim_w = p_w.simulate(cand['w'])
  assert sim_w.samples_per_s > sim_o.samples_per_s


def test_the_plan_says_the_reward_workers_are_beside_the_cluster(runs):
  """The reward workers' devices are not among --cluster's: the report says so, and not when
  the reward is paid where the samples are made."""
  _, on_role, workers = runs
  settings = planning.Settings(steps=2, simulate_top=2)
  parts = hardware.parse_cluster('16xH100')
  notes = ' '.join(planning.plan(workers, parts, settings, cluster='16xH100')['notes'])
  assert 'config.reward.workers=4 devices of their own (H100' in notes
  assert "beside the cluster's 16, not among them" in notes
  notes = ' '.join(planning.plan(on_role, parts, settings, cluster='16xH100')['notes'])
  assert 'config.reward.workers' not in notes
