"""Calibrated efficiencies (perf/hardware.py) and the colocated baseline's calibration against
veRL-Omni's published runs."""

import pytest

from configs import qwenimage
from digen_jax.models import family
from digen_jax.perf import hardware
from digen_jax.perf import runmodel as rm


def test_the_calibration_flops_are_the_real_qwen_image_forward():
  c = qwenimage.get_config('full')
  fam = family.of(c)
  flops = fam.flops_per_forward(fam.config_from(c.model), 1, 1024, 128)
  assert hardware.QWEN_IMAGE_512PX_FORWARD == pytest.approx(flops, rel=1e-12)


def test_measured_fractions_and_who_borrows_them():
  ours = hardware.calibration('digen_jax', hardware.get('H200'))
  torch = hardware.calibration('torch', hardware.get('H200'))
  # The H200 probe's figures: forward MFU 0.52 (cuDNN) vs diffusers 0.41; forward + backward with
  # checkpointing 0.26 vs 0.11 counting 3 forwards, i.e. 4/3 of that counting the recompute.
  assert ours.sampling == pytest.approx(0.517, abs=1e-3)
  assert torch.sampling == pytest.approx(0.410, abs=1e-3)
  assert ours.training * 3 / 4 == pytest.approx(0.26, abs=5e-3)
  assert torch.training * 3 / 4 == pytest.approx(0.108, abs=2e-3)
  assert not ours.measured_on and ours.date and 'H200' in ours.source
  for kind in ('H100', 'H800', 'H20', 'A100'):
    c = hardware.calibration('digen_jax', hardware.get(kind))
    assert c.measured_on == 'H200' and c.sampling == ours.sampling
  with pytest.raises(ValueError, match='no calibration'):
    hardware.calibration('jax', hardware.get('H200'))


def test_knobs_use_sampling_and_training_fractions_apart():
  k = rm.Knobs()
  h100 = hardware.get('H100')
  assert k.efficiency(h100, 'sampling').mfu > k.efficiency(h100, 'training').mfu
  assert rm.Knobs(engine='uniform').efficiency(h100, 'sampling').mfu == 0.4
  with pytest.raises(ValueError, match='Knobs.engine'):
    rm.Knobs(engine='vllm')


# ---------------------------------------------------------------------------------------------
# The colocated baseline against veRL-Omni's published Qwen-Image OCR runs.

from configs import verl_omni_ocr  # noqa: E402
from digen_jax.perf import analytic  # noqa: E402
from digen_jax.perf import baseline  # noqa: E402
from digen_jax.perf import roles  # noqa: E402


def _predicted(variant, terms=frozenset(baseline.TERMS)):
  cluster, published, _ = verl_omni_ocr.PUBLISHED[variant]
  c = verl_omni_ocr.get_config(variant)
  run = analytic.run_model_of(c, variant)
  group = roles.Group(hardware.parse_cluster(cluster))
  sec = baseline.step_seconds(run, group, rm.Knobs(), baseline.recipe_of(c), terms)
  return run.batch / sec['total'] / group.n, published, sec


@pytest.mark.parametrize('variant', ['lora', 'full'])
def test_the_colocated_model_predicts_verl_omni_within_20_percent(variant):
  """4xH800 LoRA (0.305 images/GPU/s) and 4xH200 full (0.510), every term from a cited
  measurement (configs/verl_omni_ocr.py, perf/hardware.py); nothing fitted to these figures."""
  predicted, published, sec = _predicted(variant)
  print(f'{variant}: predicted {predicted:.3f} vs {published} images/GPU/s; {sec}')
  assert abs(predicted / published - 1) <= 0.20


def test_the_64_gpu_run_is_slower_than_every_modelled_term():
  """64xH100 full (0.079 images/GPU/s, 100 s/step): the terms model 26 s; what the other 74 s
  are is not published (RESULTS: the inter-node bandwidth that would explain them). The model
  must never price the baseline slower than it ran (our speedups would be inflated)."""
  predicted, published, _ = _predicted('full64')
  assert predicted >= published


def test_each_term_costs_time_and_switches_off():
  on = _predicted('lora')[2]
  for term in baseline.TERMS:
    off = _predicted('lora', frozenset(baseline.TERMS) - {term})[2]
    assert off['total'] < on['total'], term
  bare = _predicted('lora', frozenset())[2]
  assert bare['reward'] == bare['behaviour_pass'] == bare['offload'] == 0.0
  with pytest.raises(ValueError, match='unknown'):
    baseline.parse_terms('reward,offlaod')


def test_analytic_costs_agree_with_the_compiled_programs():
  """The analytic run model of configs/qwenimage.py:full against XLA's counts of its compiled
  programs (digen_jax/perf/costs_data/), at their matmul share: within 6 %."""
  from configs import qwenimage  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import planner as planning  # pylint: disable=g-import-not-at-top

  c = qwenimage.get_config('full')
  ana = analytic.run_model_of(c, 'qwen')
  xla = planning.run_model('configs/qwenimage.py:full', c, [], planning.Settings())
  assert ana.K == xla.K and ana.T == xla.T
  roll = xla.rollout.per_unit * xla.rollout.matmul_share
  assert ana.rollout.per_unit == pytest.approx(roll, rel=0.06)
  grad = xla.grads[True].per_unit * xla.grads[True].matmul_share
  assert ana.grads[True].per_unit == pytest.approx(grad, rel=0.01)
  for f in ('trainable_bytes', 'optimizer_state_bytes', 'published_bytes', 'gathered_bytes'):
    assert getattr(ana, f) == getattr(xla, f), f


def test_the_plan_prices_the_baseline_and_ranks_modes_against_it():
  from digen_jax.perf import plan_report  # pylint: disable=g-import-not-at-top
  from digen_jax.perf import planner as planning  # pylint: disable=g-import-not-at-top

  c = verl_omni_ocr.get_config('lora')
  settings = planning.Settings(costs='analytic')
  run = planning.run_model('configs/verl_omni_ocr.py:lora', c, [], settings)
  parts = hardware.parse_cluster('2xH100+2xH20')
  p = planning.plan(run, parts, settings, cluster='2xH100+2xH20', recipe=baseline.recipe_of(c))
  b = p['baseline']
  assert b['fast_part']['devices'] == '2xH100 SXM' and b['all']['devices'] == '2xH100 SXM+2xH20'
  assert b['samples_per_s'] == max(b['all']['samples_per_s'], b['fast_part']['samples_per_s'])
  col = p['modes']['colocated']
  assert col['x_baseline'] == pytest.approx(col['samples_per_s'] / b['samples_per_s'])
  assert 'calibrated fractions' in plan_report.format_plan(p)
  with pytest.raises(planning.PlanError, match='colocated_terms'):
    planning.validate('4xH100', None, planning.Settings(colocated_terms='sleep'))
