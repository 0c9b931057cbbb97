"""The plan's three baselines, its prices and its answer to "should I disaggregate?"
(perf/comparisons.py, perf/prices.py), on the analytic costs of configs/qwenimage.py."""

import functools

import pytest

from configs import qwenimage
from digen_jax.perf import hardware
from digen_jax.perf import plan_report
from digen_jax.perf import planner as planning
from digen_jax.perf import run_models
from digen_jax.perf import prices


@functools.cache
def _plan(cluster: str, price_spec: str = '') -> dict:
  settings = planning.Settings(costs='analytic', prices=price_spec, steps=3, simulate_top=2)
  run = run_models.run_model('configs/qwenimage.py', qwenimage.get_config(), [], settings)
  parts = hardware.parse_cluster(cluster)
  return planning.plan(run, parts, settings, cluster=cluster)


def test_prices_cite_their_page_and_take_overrides():
  listed = prices.parse('')
  assert listed['H100 SXM'].usd_per_hour == 4.916 and 'aws.amazon.com' in listed['H100 SXM'].source
  assert 'H20' not in listed  # no cited list price: none is made up
  given = prices.parse('H20=1.5, h100=2.5')
  assert given['H20'].usd_per_hour == 1.5 and given['H100 SXM'].usd_per_hour == 2.5
  assert given['H20'].source.startswith('--prices')
  parts = hardware.parse_cluster('8xH100+8xH20')
  assert prices.usd_per_hour(parts, listed) == (None, ['H20'])
  assert prices.usd_per_hour(parts, given) == (8 * 2.5 + 8 * 1.5, [])
  for bad, why in (('H20', 'KIND=USD'), ('H20=cheap', 'not a number'), ('H20=0', '> 0')):
    with pytest.raises(ValueError, match=why):
      prices.parse(bad)
  with pytest.raises(ValueError):
    prices.parse('B300=3')  # an unknown kind names the known ones (hardware.get)
  with pytest.raises(planning.PlanError, match='--prices=H20'):
    planning.validate('4xH100', None, planning.Settings(prices='H20'))


def test_a_mixed_cluster_compares_against_our_colocated_mode_at_its_best_placement():
  """8 H100 + 8 H20: our colocated mode on the H100s alone beats it on all 16 (the H20s slow
  every step), so that is the baseline a disaggregated mode must beat, per second and per USD."""
  p = _plan('8xH100+8xH20', 'H20=1.5')
  ours = p['baselines']['ours_colocated']
  assert ours['devices'] == '8xH100 SXM'
  assert ours['samples_per_s'] > p['modes']['colocated']['samples_per_s']
  assert ours['usd_per_hour'] == pytest.approx(8 * 4.916)
  assert p['cost']['usd_per_hour'] == pytest.approx(8 * 4.916 + 8 * 1.5)
  v = p['verdict']
  best = p['modes'][v['best_on_policy']]
  x = v['against']['ours_colocated']
  assert x['x_samples_per_s'] == pytest.approx(best['samples_per_s'] / ours['samples_per_s'])
  # Per USD: the same ratio scaled by what each placement costs an hour.
  assert x['x_per_usd'] == pytest.approx(
      x['x_samples_per_s'] * ours['usd_per_hour'] / p['cost']['usd_per_hour']
  )
  assert v['disaggregate'] == (v['best_on_policy'] != 'colocated' and x['x_samples_per_s'] > 1)
  assert best['x_colocated'] == pytest.approx(x['x_samples_per_s'])
  text = plan_report.format_plan(p)
  assert 'Should I disaggregate?' in text and 'per USD' in text


def test_an_unpriced_kind_gets_no_per_dollar_figures_and_is_named():
  p = _plan('8xH100+8xH20')
  assert p['cost'] == {**p['cost'], 'usd_per_hour': None, 'unpriced': ['H20']}
  assert all(row.get('samples_per_usd') is None for row in p['modes'].values())
  assert 'no cited price for H20 (--prices)' in plan_report.format_plan(p)


def test_one_node_of_h100s_prices_all_three_baselines():
  p = _plan('8xH100')
  for name, b in p['baselines'].items():
    assert b['samples_per_usd'] == pytest.approx(b['samples_per_s'] * 3600 / (8 * 4.916)), name
  assert set(p['verdict']['against']) == {'verl_omni', 'ours_colocated', 'naive_disagg'}


def test_the_mode_table_keeps_its_columns_apart_and_writes_no_exponents():
  """'11.14e+03' was M = 1 and a 1140 s step run together."""
  assert [plan_report._seconds(x) for x in (0.5, 19.3, 123.4, 1140.0)] == [
      '0.5',
      '19.3',
      '123',
      '1140',
  ]
  p = _plan('8xH100')
  rows = [l for l in plan_report.format_plan(p).splitlines() if l.split()[:1] == ['colocated']]
  m = p['modes']['colocated']
  tokens = rows[0].split()
  assert tokens[7] == str(m['fragments']) and tokens[8] == plan_report._seconds(m['wall_s'])
  assert 'e+' not in rows[0]
