"""Tracing (spans -> trace.json, timeline.png, utilization), the GAP fragment plan and the BTS
cost model: pure bookkeeping, no compilation."""

import json
import os
import threading

import jax
import pytest

from digen_jax.runtime import bts
from digen_jax.experiment import fragments
from digen_jax.runtime import trace


def _span(devs, t0, t1, program='rollout', role='rollout', **kw):
  return trace.Span(tuple(devs), role, program, t0, t1, **kw)


def test_utilization_counts_overlaps_once_and_clips_to_the_window():
  spans = [
      _span([0], 0.0, 2.0),
      _span([0], 1.0, 3.0),  # device 0 busy [0, 3]
      _span([1, 2], 2.0, 6.0, 'grad', 'trainer'),  # devices 1, 2 busy [2, 6]
      _span([3], 9.0, 12.0),
  ]  # device 3 outside the window
  busy = trace.busy_seconds(spans, 0.0, 4.0)
  assert busy == {0: 3.0, 1: 2.0, 2: 2.0}
  assert trace.utilization(spans, 0.0, 4.0, 4) == pytest.approx(7.0 / 16.0)
  assert trace.utilization(spans, 0.0, 0.0, 4) == 0.0
  assert trace.utilization([_span([0], 0, 10)], 2, 4, 1) == 1.0


def test_tracer_utilization_per_step_windows_skips_the_past_not_late_spans():
  tracer = trace.Tracer()
  for i in range(100):  # 100 finished steps of 1 s, device 0 busy half
    tracer.add(_span([0], i, i + 0.5))
  assert tracer.utilization(99.0, 100.0, 1) == pytest.approx(0.5)
  assert tracer._scan_from == 99  # pylint: disable=protected-access
  tracer.add(_span([0], 100.0, 100.25))
  tracer.add(_span([1], 99.5, 101.0))  # arrives late (the rollout's), still counted
  assert tracer.utilization(100.0, 101.0, 2) == pytest.approx((0.25 + 1.0) / 2)
  assert tracer.spans[0].t0 == 0.0  # nothing is dropped from the trace itself


def test_tracer_records_device_synchronised_spans_and_writes_files(tmp_path, plots, monkeypatch):
  tracer = trace.Tracer()
  devs = jax.devices()[:2]
  x = jax.numpy.ones((256, 256))
  with tracer.span(devs, 'trainer', 'grad', step=3, fragment=1, version=3):
    jax.block_until_ready(x @ x)
  threads = [
      threading.Thread(target=lambda i=i: tracer.add(_span([5 + i], 0.0, 1.0))) for i in range(4)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  spans = tracer.spans
  assert len(spans) == 5
  s = spans[0]
  assert s.devices == tuple(sorted(d.id for d in devs)) and s.t1 >= s.t0
  assert (s.role, s.program, s.step, s.fragment, s.version) == ('trainer', 'grad', 3, 1, 3)
  assert trace.Span.from_json(json.loads(json.dumps(s.to_json()))) == s
  assert len(tracer.take_new()) == 5 and tracer.take_new() == []
  tracer.decision({'action': 'insert', 't': s.t0, 'reason': 'x'})
  tracer.write(str(tmp_path), title='test')
  d = json.load(open(tmp_path / 'trace.json'))
  xs = [e for e in d['traceEvents'] if e['ph'] == 'X']
  # One complete event per (span, device), microseconds, with the span's labels.
  assert len(xs) == 2 + 4
  grad = [e for e in xs if e['name'] == 'grad']
  assert {e['tid'] for e in grad} == {dv.id for dv in devs}
  assert grad[0]['args']['fragment'] == 1 and grad[0]['dur'] >= 0
  assert d['decisions'][0]['action'] == 'insert'
  assert any(e['ph'] == 'i' for e in d['traceEvents'])
  assert os.path.getsize(tmp_path / 'timeline.png') > 1000
  # DIGEN_PLOTS=0 (digen_jax/outputs/figures.py): the trace without its figure.
  monkeypatch.setenv('DIGEN_PLOTS', '0')
  quiet = tmp_path / 'quiet'
  quiet.mkdir()
  tracer.write(str(quiet), title='test')
  assert os.path.isfile(quiet / 'trace.json') and not os.path.exists(quiet / 'timeline.png')


def test_disabled_tracer_writes_nothing(tmp_path):
  tracer = trace.Tracer(enabled=False)
  tracer.add(_span([0], 0, 1))
  tracer.write(str(tmp_path))
  assert not os.listdir(tmp_path)


def test_fragment_plan_group_and_sample_units():
  g = fragments.FragmentPlan(groups=4, group_size=4, num=2, unit='group')
  assert g.size == 8 and list(g.groups_of(1)) == [2, 3]
  assert g.needs(0) == {0} and g.trainable({1}, set()) == [1]
  s = fragments.FragmentPlan(groups=2, group_size=4, num=4, unit='sample')  # 2 samples each
  assert s.size == 2 and list(s.samples(3)) == [6, 7]
  assert s.needs(0) == {0, 1} and s.needs(3) == {2, 3}
  assert s.trainable({0}, set()) == []  # group 0 is incomplete
  assert s.trainable({0, 1, 3}, set()) == [0, 1]
  assert s.trainable({0, 1, 2, 3}, {0}) == [1, 2, 3]
  # A fragment straddling two groups (size 3, groups of 2) needs both groups' fragments.
  odd = fragments.FragmentPlan(groups=3, group_size=2, num=2, unit='sample')
  assert list(odd.groups_of(0)) == [0, 1] and odd.needs(0) == odd.needs(1) == {0, 1}
  assert odd.prompts(1, list('aabbcc')) == list('bcc')
  with pytest.raises(ValueError, match='fragment_unit'):
    fragments.FragmentPlan(2, 4, 2, 'prompt')
  with pytest.raises(ValueError, match="fragment_unit='group'"):
    fragments.FragmentPlan(3, 4, 2, 'group')
  assert fragments.stale_count(4, 0.5) == 2 and fragments.stale_count(3, 0.34) == 1


def test_predict_makespan_and_bts_decisions():
  kw = dict(
      now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=2, backlog=0, c_roll=1.0, c_train=0.5
  )
  # No insertion: fragments arrive at 1, 2, 3 and the last trains until 3.5.
  assert bts.predict_makespan(**kw) == pytest.approx(3.5)
  # The trainer samples one (done at 1.2), then trains the three fragments (1.7, 2.2, 2.7).
  assert bts.predict_makespan(**kw, c_tag=1.2, insert=True) == pytest.approx(2.7)
  # A large switch cost makes the insertion lose.
  assert bts.predict_makespan(**kw, c_tag=1.2, c_switch=3.0, insert=True) > 3.5

  costs = bts.Costs()
  dec = bts.decide(costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=2, backlog=0)
  assert dec['action'] == 'wait' and 'profiled' in dec['reason']
  for name, v in (('roll', 9.0), ('roll', 1.0), ('train', 0.5), ('train', 0.5)):
    costs.observe(name, v)
  assert costs.roll == 1.0  # the first (compile) measurement was replaced
  dec = bts.decide(costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=2, backlog=0)
  assert dec['action'] == 'insert' and dec['makespan_insert'] < dec['makespan_wait']
  assert not dec['c_tag_measured']
  # TAG's first span is cold (its first execution on the trainer): it cannot rule TAG out alone,
  # a second one can.
  costs.observe('tag', 9.0)
  dec = bts.decide(costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=2, backlog=0)
  assert dec['action'] == 'insert' and dec['c_tag'] == 1.0 and not dec['c_tag_measured']
  costs.observe('tag', 9.0)
  dec = bts.decide(costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=2, backlog=0)
  assert dec['action'] == 'wait' and dec['c_tag'] == 9.0 and dec['c_tag_measured']
  costs.tag, costs.counts['tag'] = None, 0  # back to unmeasured for the speed-label cases
  # A slow trainer (speed label 0.25) would take 4x the rollout's time: not worth it.
  dec = bts.decide(
      costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=1, backlog=0, trainer_speed=0.25
  )
  assert dec['action'] == 'wait'
  assert (
      bts.decide(costs, now=0.0, rollout_free_at=1.0, in_flight=1, unclaimed=0, backlog=0)['action']
      == 'wait'
  )


def test_bts_counts_the_hand_over_latency_a_trainer_fragment_does_not_pay():
  """Trainer-bound step start (figures of a measured M = 16 run): the rollout is still fetching
  the policy and its fragments reach the trainer after scoring and a pull; the trainer can
  sample one at once. Without those latencies BTS would wait; with them inserting wins."""
  kw = dict(
      now=0.0,
      in_flight=0,
      unclaimed=16,
      backlog=0,
      c_roll=0.068,
      c_train=0.08,
      c_tag=0.07,
      c_switch=0.003,
  )
  blind = dict(kw, rollout_free_at=0.0)
  assert bts.predict_makespan(**blind, insert=True) > bts.predict_makespan(**blind)
  seen = dict(kw, rollout_free_at=0.011, c_deliver=0.005, c_gap=0.006)
  wait, insert = bts.predict_makespan(**seen), bts.predict_makespan(**seen, insert=True)
  assert wait == pytest.approx(0.011 + 0.068 + 0.005 + 16 * 0.08)
  assert insert == pytest.approx(0.003 + 0.07 + 16 * 0.08) and insert < wait
  costs = bts.Costs()
  for name, v in (
      ('roll', 0.068),
      ('roll', 0.068),
      ('train', 0.08),
      ('train', 0.08),
      ('tag', 0.07),
      ('tag', 0.07),
      ('switch', 0.003),
      ('switch', 0.003),
  ):
    costs.observe(name, v)
  assert (
      bts.decide(costs, now=0.0, rollout_free_at=0.0, in_flight=0, unclaimed=16, backlog=0)[
          'action'
      ]
      == 'wait'
  )
  for name, v in (('deliver', 0.005), ('deliver', 0.005), ('gap', 0.006), ('gap', 0.006)):
    costs.observe(name, v)
  dec = bts.decide(costs, now=0.0, rollout_free_at=0.011, in_flight=0, unclaimed=16, backlog=0)
  assert dec['action'] == 'insert' and dec['c_deliver'] == pytest.approx(0.005)
