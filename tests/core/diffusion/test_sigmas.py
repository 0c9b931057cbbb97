"""digen_jax.diffusion.sigmas against diffusers' FlowMatchEulerDiscreteScheduler (torch, CPU)."""

import ast
import dataclasses
import pathlib

import numpy as np
import pytest

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

from digen_jax.diffusion import sigmas as sigmas_lib  # noqa: E402


def _pipeline_calculate_shift():
  """diffusers' own ``calculate_shift`` from the QwenImage pipeline source, without importing the
  pipeline module (it needs transformers, which the test env lacks)."""
  path = (
      pathlib.Path(diffusers.__file__).parent / "pipelines" / "qwenimage" / "pipeline_qwenimage.py"
  )
  tree = ast.parse(path.read_text())
  fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "calculate_shift")
  ns = {}
  exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
  return ns["calculate_shift"]


REF_CALCULATE_SHIFT = _pipeline_calculate_shift()


def _diffusers_sigmas(cfg: sigmas_lib.SchedulerConfig, num_steps, image_seq_len=None):
  """What the QwenImage/FLUX pipelines get from set_timesteps."""
  sched = FlowMatchEulerDiscreteScheduler(**dataclasses.asdict(cfg))
  mu = None
  if image_seq_len is not None:
    mu = REF_CALCULATE_SHIFT(
        image_seq_len,
        sched.config.get("base_image_seq_len", 256),
        sched.config.get("max_image_seq_len", 4096),
        sched.config.get("base_shift", 0.5),
        sched.config.get("max_shift", 1.15),
    )
  sched.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
  return sched.sigmas.numpy()


STEPS = [1, 2, 4, 10, 28, 50]
SEQ_LENS = [64, 256, 1024, 4096, 6032, 8192, 16384]


def test_real_configs_match_published_json():
  q = sigmas_lib.qwenimage_scheduler_config()
  assert (q.base_shift, q.max_shift, q.base_image_seq_len, q.max_image_seq_len) == (
      0.5,
      0.9,
      256,
      8192,
  )
  assert (q.shift_terminal, q.use_dynamic_shifting, q.time_shift_type, q.shift) == (
      0.02,
      True,
      "exponential",
      1.0,
  )
  f = sigmas_lib.flux_scheduler_config()
  assert (f.shift, f.use_dynamic_shifting, f.base_shift, f.max_shift) == (3.0, True, 0.5, 1.15)
  assert (f.base_image_seq_len, f.max_image_seq_len, f.shift_terminal) == (256, 4096, None)


@pytest.mark.parametrize(
    "make_cfg", [sigmas_lib.qwenimage_scheduler_config, sigmas_lib.flux_scheduler_config]
)
@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_dynamic_shift_matches_diffusers(make_cfg, num_steps, seq_len):
  cfg = make_cfg()
  if num_steps == 1 and cfg.shift_terminal:
    # One sigma (1.0): stretching to shift_terminal is 0/0 (NaN in diffusers); we refuse.
    with pytest.raises(ValueError, match="shift_terminal"):
      sigmas_lib.sigmas(cfg, num_steps, image_seq_len=seq_len)
    return
  ours = sigmas_lib.sigmas(cfg, num_steps, image_seq_len=seq_len)
  ref = _diffusers_sigmas(cfg, num_steps, image_seq_len=seq_len)
  assert ours.dtype == np.float32 and ours.shape == (num_steps + 1,)
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
  assert ours[-1] == 0.0
  assert np.all(np.diff(ours) < 0)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("shift_terminal", [None, 0.02, 0.1])
def test_static_shift_matches_diffusers(shift, num_steps, shift_terminal):
  cfg = sigmas_lib.SchedulerConfig(
      shift=shift, use_dynamic_shifting=False, shift_terminal=shift_terminal
  )
  if num_steps == 1 and shift_terminal:
    with pytest.raises(ValueError, match="shift_terminal"):
      sigmas_lib.sigmas(cfg, num_steps)
    return
  ours = sigmas_lib.sigmas(cfg, num_steps)
  np.testing.assert_allclose(ours, _diffusers_sigmas(cfg, num_steps), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "make_cfg", [sigmas_lib.qwenimage_scheduler_config, sigmas_lib.flux_scheduler_config]
)
@pytest.mark.parametrize("num_steps", [4, 10, 28])
def test_static_shift_override(make_cfg, num_steps):
  cfg = make_cfg()
  ours = sigmas_lib.sigmas(cfg, num_steps, image_seq_len=4096, shift=3.0)
  ref_cfg = dataclasses.replace(cfg, use_dynamic_shifting=False, shift=3.0)
  np.testing.assert_allclose(ours, _diffusers_sigmas(ref_cfg, num_steps), rtol=0, atol=1e-6)
  # and it is a different schedule from the dynamic one
  assert not np.allclose(ours, sigmas_lib.sigmas(cfg, num_steps, image_seq_len=4096))


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
@pytest.mark.parametrize("shift_terminal", [None, 0.05])
def test_linear_time_shift_matches_diffusers(seq_len, shift_terminal):
  cfg = dataclasses.replace(
      sigmas_lib.flux_scheduler_config(), time_shift_type="linear", shift_terminal=shift_terminal
  )
  for n in (4, 20):
    ours = sigmas_lib.sigmas(cfg, n, image_seq_len=seq_len)
    np.testing.assert_allclose(ours, _diffusers_sigmas(cfg, n, seq_len), rtol=0, atol=1e-6)


@pytest.mark.parametrize("conv", ["use_karras_sigmas", "use_exponential_sigmas"])
@pytest.mark.parametrize("num_steps", [2, 10, 30])
def test_karras_and_exponential_match_diffusers(conv, num_steps):
  cfg = dataclasses.replace(sigmas_lib.qwenimage_scheduler_config(), **{conv: True})
  ours = sigmas_lib.sigmas(cfg, num_steps, image_seq_len=1024)
  np.testing.assert_allclose(ours, _diffusers_sigmas(cfg, num_steps, 1024), rtol=0, atol=1e-6)


def test_calculate_shift_matches_pipeline():
  for cfg in (sigmas_lib.qwenimage_scheduler_config(), sigmas_lib.flux_scheduler_config()):
    for n in SEQ_LENS:
      ref = REF_CALCULATE_SHIFT(
          n, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
      )
      assert sigmas_lib.calculate_shift(n, cfg) == pytest.approx(ref, rel=1e-12)


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="image_seq_len"):
    sigmas_lib.sigmas(sigmas_lib.flux_scheduler_config(), 10)
  with pytest.raises(ValueError, match="num_steps"):
    sigmas_lib.sigmas(sigmas_lib.flux_scheduler_config(), 0, image_seq_len=256)
  with pytest.raises(ValueError, match="time_shift_type"):
    sigmas_lib.SchedulerConfig(time_shift_type="cosine")
  with pytest.raises(ValueError, match="use_beta_sigmas"):
    sigmas_lib.sigmas(sigmas_lib.SchedulerConfig(use_beta_sigmas=True), 10)
  with pytest.raises(ValueError, match="at most one"):
    sigmas_lib.SchedulerConfig(use_karras_sigmas=True, use_exponential_sigmas=True)
  with pytest.raises(ValueError, match="shift"):
    sigmas_lib.sigmas(sigmas_lib.SchedulerConfig(), 10, shift=-1.0)
