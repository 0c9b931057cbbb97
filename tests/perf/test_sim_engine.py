"""perf/engine.py: the real schedule on a virtual clock gives the closed-form answers where there
are some, and the schedule's own behaviour (BTS insertions, TCSS staleness) where there are not."""

from __future__ import annotations

import pytest

from digen_jax.experiment import fragments as frag_lib
from digen_jax.runtime import trace as trace_lib
from digen_jax.perf import engine
from digen_jax.perf import predict

G, P = 4, 8  # group size, prompts per step: B = 32


def run(costs, schedule, layout=engine.Layout(), steps=6):
  return engine.simulate(costs, layout, schedule, groups=P, group_size=G, steps=steps)


def test_one_fragment_step_is_the_sum_of_its_parts():
  c = engine.StepCosts(rollout=2.0, grad=1.5, publish=0.1, pull=0.2, deliver=0.3, trainer_host=0.7)
  r = run(c, engine.Modes(fragments=1))
  # The previous step's host work runs after the publish, hidden behind the pull and rollout.
  wall = 0.1 + 0.2 + 2.0 + 0.3 + 1.5
  for row in r.rows:
    assert row['wall_s'] == pytest.approx(wall)
    # busy: the publish (trainer), the rollout, the update, over 2 devices
    assert row['utilization'] == pytest.approx((0.1 + 2.0 + 1.5) / (2 * wall))
  assert r.summary()['samples_per_s'] == pytest.approx(P * G / wall)


def test_colocated_uses_every_device_for_each_phase():
  c = engine.StepCosts(rollout=2.0, grad=1.5, publish=0.1)
  r = run(c, engine.Modes(fragments=1), engine.Layout(2, 2, colocated=True))
  assert r.summary()['wall_s'] == pytest.approx(3.6)
  assert r.summary()['utilization'] == pytest.approx(1.0)
  assert all(s.devices == (0, 1) for s in r.spans)


@pytest.mark.parametrize('m', [2, 4, 8])
def test_balanced_gap_step_is_fill_plus_m_fragments(m):
  c = engine.StepCosts(rollout=1.0, grad=1.0, apply=0.25, publish=0.5)
  r = run(c, engine.Modes(fragments=m))
  # publish, the first fragment alone (fill), M gradients back to back, the apply
  for row in r.rows:
    assert row['wall_s'] == pytest.approx(0.5 + (m + 1) * 1.0 + 0.25)
  assert len([s for s in r.spans if s.program == 'grad']) == m * 6
  assert len([s for s in r.spans if s.program == 'rollout']) == m * 6


def test_devices_of_separate_roles_never_overlap_and_every_fragment_trains_once():
  c = engine.StepCosts(
      rollout=0.7, grad=1.1, apply=0.2, publish=0.1, deliver=0.05, gap=0.02, tag_rollout=0.9
  )
  r = run(c, engine.Modes(fragments=8, tag=True, tsp=True), steps=5)
  for dev in (0, 1):
    spans = sorted((s for s in r.spans if dev in s.devices), key=lambda s: s.t0)
    assert all(a.t1 <= b.t0 + 1e-12 for a, b in zip(spans, spans[1:]))
  trained = [(s.step, s.fragment) for s in r.spans if s.program == 'grad']
  assert sorted(trained) == [(s, f) for s in range(5) for f in range(8)]
  sampled = [(s.step, s.fragment) for s in r.spans if s.program in ('rollout', 'tag_rollout')]
  assert sorted(sampled) == [(s, f) for s in range(5) for f in range(8)]


def test_shared_compute_slows_concurrent_programs():
  c = engine.StepCosts(rollout=1.0, grad=1.0, apply=0.1, publish=0.1)
  alone = run(c, engine.Modes(fragments=4)).summary()
  shared = run(c, engine.Modes(fragments=4), engine.Layout(shared=True)).summary()
  sync = run(c, engine.Modes(fragments=1), engine.Layout(shared=True)).summary()
  assert shared['wall_s'] > alone['wall_s']
  # Sharing one pool, overlap cannot beat doing the same work one program at a time.
  assert shared['wall_s'] >= 4 * 1.0 + 4 * 1.0 + 0.1 + 0.1 - 1e-9
  assert sync['wall_s'] == pytest.approx(0.1 + 1.0 + 1.0 + 0.1)


def test_tag_inserts_when_the_rollout_is_the_bottleneck():
  slow_rollout = engine.StepCosts(rollout=3.0, grad=1.0, apply=0.1, publish=0.1, tag_rollout=1.0)
  gap = run(slow_rollout, engine.Modes(fragments=8, tsp=True)).summary()
  tag = run(slow_rollout, engine.Modes(fragments=8, tsp=True, tag=True)).summary()
  assert tag['bts_inserts'] > 0
  assert tag['samples_per_s'] > 1.2 * gap['samples_per_s']


def test_tag_learns_that_helping_does_not_pay():
  # The trainer's sampling is 5x the rollout's: BTS may try once before it has measured it and
  # once more (a first measurement may be a cold start), then waits; the run is not slower than
  # GAP by more than those two insertions.
  c = engine.StepCosts(rollout=1.0, grad=0.5, apply=0.1, publish=0.1, tag_rollout=5.0)
  gap = run(c, engine.Modes(fragments=8, tsp=True), steps=8)
  tag = run(c, engine.Modes(fragments=8, tsp=True, tag=True), steps=8)
  assert tag.summary()['bts_inserts'] <= 2
  assert tag.makespan <= gap.makespan + 2 * 5.0 + 1e-9


def test_tcss_starts_stale_fragments_within_its_bound():
  c = engine.StepCosts(rollout=1.0, grad=1.0, apply=0.5, publish=0.5, tag_rollout=1.0)
  m, phi = 8, 0.5
  r = run(c, engine.Modes(fragments=m, tsp=True, tag=True, tcss_fraction=phi), steps=6)
  stale = [s for s in r.spans if s.program == 'rollout' and s.version == s.step - 1]
  assert stale, 'TCSS never started a fragment with the previous policy'
  per_step = {}
  for s in stale:
    per_step[s.step] = per_step.get(s.step, 0) + 1
  assert max(per_step.values()) <= frag_lib.stale_count(m, phi)
  on_policy = run(c, engine.Modes(fragments=m, tsp=True, tag=True), steps=6)
  assert r.summary()['samples_per_s'] > on_policy.summary()['samples_per_s']


def test_utilization_is_the_traces_own_measure():
  c = engine.StepCosts(rollout=0.5, grad=0.4, apply=0.1, publish=0.05, deliver=0.01)
  r = run(c, engine.Modes(fragments=4))
  row = r.rows[2]
  t1 = sum(x['wall_s'] for x in r.rows[:3])
  t0 = t1 - row['wall_s']
  assert row['utilization'] == pytest.approx(trace_lib.utilization(r.spans, t0, t1, 2))


@pytest.mark.parametrize(
    'bad, field',
    [
        (dict(rollout=-1.0, grad=1.0), 'rollout'),
        (dict(rollout=1.0, grad=float('nan')), 'grad'),
        (dict(rollout=1.0, grad=1.0, publish=float('inf')), 'publish'),
    ],
)
def test_bad_costs_name_the_field(bad, field):
  with pytest.raises(ValueError, match=f'StepCosts.{field}'):
    engine.StepCosts(**bad)


def test_tag_without_a_trainer_sampling_cost_is_refused():
  with pytest.raises(ValueError, match='tag_rollout'):
    run(engine.StepCosts(rollout=1.0, grad=1.0), engine.Modes(fragments=4, tag=True))


def test_rungs_turn_on_one_technique_each():
  s = [predict.rung_schedule(r, 16, 'group', 0.5) for r in predict.RUNGS]
  assert [x.fused for x in s] == [True, True, False, False, False, False]
  assert [(x.fragments, x.tsp, x.tag, x.tcss_fraction) for x in s[2:]] == [
      (16, False, False, 0.0),
      (16, True, False, 0.0),
      (16, True, True, 0.0),
      (16, True, True, 0.5),
  ]


def test_programs_that_use_one_core_of_a_shared_host_overlap_for_free():
  c = dict(rollout=1.0, grad=1.0, apply=0.1, publish=0.1)
  separate = run(engine.StepCosts(**c), engine.Modes(fragments=4)).summary()
  one_core = run(
      engine.StepCosts(**c, cores={'rollout': 1.0, 'grad': 1.0}),
      engine.Modes(fragments=4),
      engine.Layout(shared=True, cores=2),
  ).summary()
  fills = run(
      engine.StepCosts(**c, cores={'rollout': 2.0, 'grad': 2.0}),
      engine.Modes(fragments=4),
      engine.Layout(shared=True, cores=2),
  ).summary()
  old = run(engine.StepCosts(**c), engine.Modes(fragments=4), engine.Layout(shared=True)).summary()
  assert one_core['wall_s'] == pytest.approx(separate['wall_s'])
  assert fills['wall_s'] == pytest.approx(old['wall_s'])
  # 1.5 + 1.5 cores on 2: each runs at 2/3 of its speed while both are in flight.
  mid = run(
      engine.StepCosts(**c, cores={'rollout': 1.5, 'grad': 1.5}),
      engine.Modes(fragments=4),
      engine.Layout(shared=True, cores=2),
  ).summary()
  assert separate['wall_s'] < mid['wall_s'] < fills['wall_s']


def test_bad_core_counts_name_the_field():
  with pytest.raises(ValueError, match=r"StepCosts.cores\['grad'\]"):
    engine.StepCosts(rollout=1.0, grad=1.0, cores={'grad': 0.0})
  with pytest.raises(ValueError, match='Layout.cores'):
    engine.Layout(shared=True, cores=-1)


def test_an_asynchronous_checkpoint_costs_only_where_the_trainer_is_busy():
  """The save's asynchronous rest shares the trainer's devices with its next programs: hidden
  behind the rollout of one fragment (it starts after the publish; the trainer then waits for
  the batch), paid for by the gradients of a trainer-bound pipeline (two jobs on one core:
  each at half speed)."""
  one = dict(rollout=2.0, grad=1.5, publish=0.1, pull=0.2, deliver=0.3)
  base = run(engine.StepCosts(**one), engine.Modes(fragments=1)).rows[1:]
  saved = run(engine.StepCosts(**one, checkpoint=1.0), engine.Modes(fragments=1)).rows[1:]
  for a, b in zip(base, saved):
    assert b['wall_s'] == pytest.approx(a['wall_s'])

  bound = dict(rollout=0.2, grad=1.0, apply=0.1, publish=0.1)  # the trainer is the bottleneck
  gap = engine.Modes(fragments=4)
  base = run(engine.StepCosts(**bound), gap, steps=8).rows[2:]
  saved = run(engine.StepCosts(**bound, checkpoint=0.5), gap, steps=8).rows[2:]
  for a, b in zip(base, saved):
    # Its CPU time, less the first fragment's rollout, during which the trainer only waits.
    assert b['wall_s'] == pytest.approx(a['wall_s'] + 0.5 - 0.2)
  names = {s.program for s in run(engine.StepCosts(**bound, checkpoint=0.5), gap).spans}
  assert 'checkpoint' not in names  # host work: no device span, no utilization


def _mp2_profile(checkpoint: float) -> dict:
  B, n = 16, 4
  seconds = {
      f'rollout/{B}': 1.0,
      f'reward/{B}': 0.2,
      f'handover/{B}': 0.01,
      f'encode/{B}': 0.001,
      f'adv/{B}': 0.001,
      f'update/{B}': 0.8,
      'publish': 0.02,
      'pull': 0.01,
      'checkpoint_block': 0.01,
      'checkpoint': checkpoint,
      f'rollout/{n}': 0.3,
      f'reward/{n}': 0.05,
      f'handover/{n}': 0.01,
      f'grad_tsp/{n}': 0.2,
      f'adv/{n}': 0.001,
      'apply': 0.02,
      f'encode/{n}': 0.001,
      f'tag_rollout/{n}': 0.3,
      f'tag_reward/{n}': 0.05,
      'begin': 0.001,
  }
  layout = dict(trainer_devices=1, rollout_devices=1, shared=False, colocated=False)
  prof = dict(layout, batch=B, fragment=n, fragments=4, group_size=4, checkpoint_every=1)
  return {'layouts': {'mp2': dict(prof, seconds=seconds)}}


def _span(name, step, seconds, start=0.0):
  return {'ph': 'X', 'name': name, 'ts': start * 1e6, 'dur': seconds * 1e6, 'args': {'step': step}}


def test_span_seconds_average_each_program_after_the_first_step():
  events = [_span('grad', 0, 9.0), _span('grad', 1, 0.2), _span('grad', 2, 0.4)]
  events += [_span('rollout', 1, 0.3), {'ph': 'M', 'name': 'process_name', 'args': {}}]
  assert predict.span_seconds(events) == pytest.approx({'grad': 0.3, 'rollout': 0.3})


def test_span_seconds_measure_the_rollouts_host_time_between_fragments_of_a_step():
  # Step 1: fragments at 10.0-10.3, 10.35-10.65, 10.75-11.05 (gaps 0.05 and 0.1, listed out of
  # order); step 2's one fragment starts after the policy pull: no gap across steps. Step 0
  # warms up.
  events = [_span('rollout', 0, 0.3, 0.0), _span('rollout', 0, 0.3, 5.0)]
  events += [_span('rollout', 1, 0.3, 10.75), _span('rollout', 1, 0.3, 10.0)]
  events += [_span('rollout', 1, 0.3, 10.35), _span('rollout', 2, 0.3, 12.0)]
  spans = predict.span_seconds(events)
  assert spans['rollout_gap'] == pytest.approx(0.075)
  # A span on two devices is two events (runtime/trace.py): the gaps are per device.
  twice = events + [dict(e, tid=1) for e in events]
  assert predict.span_seconds(twice)['rollout_gap'] == pytest.approx(0.075)
  assert 'rollout_gap' not in predict.span_seconds(events[:2] + events[-1:])


def test_a_rung_simulated_at_its_measured_spans():
  """Spans equal to the profile give the profile's prediction; slower gradients in the run give
  fewer samples/s, and the ratio per program says which program ran slower."""
  kw = dict(rungs=('disagg', 'tsp'), variants=('mp2',), steps=4, fragments=4)
  prof = _mp2_profile(checkpoint=0.0)
  # The spans as the profile timed the programs: the whole batch as one fragment, its sampling
  # and advantages + fused update; a fragment's sampling, advantages + TSP gradient, and the
  # optimizer step.
  same = {
      'mp2-disagg': {'rollout': 1.0, 'update': 0.801},
      'mp2-tsp': {'rollout': 0.3, 'grad': 0.201, 'apply': 0.02},
  }
  rows = predict.predict_ladder(prof, measured_spans=same, **kw)['rows']
  for r in rows:
    assert r['samples_per_s_at_spans'] == pytest.approx(r['samples_per_s'], rel=1e-6), r['name']
    assert all(v == pytest.approx(1.0) for v in r['spans_vs_profile'].values())
  slow = {'mp2-tsp': {'grad': 2 * 0.201}}  # this rung is trainer-bound
  tsp = predict.predict_ladder(prof, measured_spans=slow, **kw)['modes']['gap_tsp']
  assert tsp['samples_per_s_at_spans'] < 0.9 * tsp['samples_per_s']
  assert tsp['spans_vs_profile']['grad'] == pytest.approx(2.0)
  assert tsp['spans_vs_profile']['rollout'] == pytest.approx(1.0)  # not measured: profiled
  # A rollout that spent longer between its fragments than the profile's scoring, hand-over
  # and encode (0.05 + 0.01 + 0.001) makes a rollout-bound rung slower at its spans.
  gap = {'mp2-tsp': dict(same['mp2-tsp'], rollout_gap=0.2)}
  bound = predict.predict_ladder(prof, measured_spans=gap, **kw)['modes']['gap_tsp']
  assert bound['spans_vs_profile']['gap'] == pytest.approx(0.2 / 0.061)
  assert bound['samples_per_s_at_spans'] < 0.9 * bound['samples_per_s']
  # The checkpoint's background work is in the measured spans already: not added again.
  busy = _mp2_profile(checkpoint=0.5)
  costs = predict.at_measured_spans(
      busy['layouts']['mp2'], 'mp2', predict.rung_schedule('tsp', 4, 'group', 0.5), same['mp2-tsp']
  )
  assert costs.checkpoint == 0.0 and costs.grad == 0.201
  shared = dict(busy['layouts']['mp2'], shared=True)
  with pytest.raises(ValueError, match='shares cores'):
    predict.at_measured_spans(
        shared, 'sp', predict.rung_schedule('tsp', 4, 'group', 0.5), same['mp2-tsp']
    )


def test_fragments_sampled_as_the_runtime_samples_them_give_the_rollouts_costs():
  prof = _mp2_profile(checkpoint=0.0)['layouts']['mp2']
  tsp = predict.rung_schedule('tsp', 4, 'group', 0.5)
  before = predict.step_costs(prof, 'mp2', tsp)
  assert before.rollout == 0.3 and before.gap == pytest.approx(0.05 + 0.01 + 0.001)
  # Each fragment scored beside the next one's span (perf/profile.py's piped rollout).
  piped = dict(prof, seconds={**prof['seconds'], 'rollout_piped/4': 0.34, 'rollout_host/4': 0.02})
  costs = predict.step_costs(piped, 'mp2', tsp)
  assert costs.rollout == 0.34 and costs.gap == pytest.approx(0.02 + 0.01)
  assert costs.deliver == before.deliver  # the scores still come after the span
  # One fragment of the whole batch is never sampled beside another.
  disagg = predict.rung_schedule('disagg', 4, 'group', 0.5)
  assert predict.step_costs(piped, 'mp2', disagg) == predict.step_costs(prof, 'mp2', disagg)
