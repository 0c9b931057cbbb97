"""Wan2.1 (text-to-video) through the same loop as the image families.

* configs/wan21.py at real size (14B, 1.3B, 720p) is a valid config of the released sizes, and
  the config errors of a video run name their field.
* The rollout program samples video latents (tokens of every frame) and decodes them into uint8
  videos [B, T, H, W, 3] inside the program (`:tiny`, pixel space).
* configs/wan21.py:tiny_pipeline end to end (slow): a random diffusers Wan2.1 folder (built here
  with diffusers' WanPipeline.save_pretrained) -> umT5 embedding cache -> Wan sampling with true
  CFG -> causal VAE decode of 5-frame videos -> JPEG + ShapesBench (per frame) +
  temporal-consistency rewards -> GRPO with LoRA; colocated 3 steps straight and 2 + 1 resumed
  (bit for bit), two processes with GAP (the update equals colocated's), and the run's adapters
  loaded by diffusers' own WanPipeline.load_lora_weights give our merged forward. Torch never
  loads in training.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import wan21
from digen_jax import programs
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.experiment import tiny_pipeline
from digen_jax.models import latents as latents_lib
from digen_jax.models.transformers import wan
from digen_jax.parallel import mesh as mesh_lib
from tests.helpers.paths import REPO
from tests.helpers.pipelines import metrics_rows, run_main, run_main_two_processes

CONFIG = os.path.join(REPO, 'configs', 'wan21.py')


def _real(variant=None):
  c = wan21.get_config(variant)
  c.model.checkpoint = '/path/Wan2.1-T2V-14B-Diffusers'  # validate() checks fields, not folders
  c.text.cache = '/path/cache'
  c.data.prompts = '/path/prompts.txt'
  return c


def test_real_configs_are_valid_and_sized_as_released():
  c = _real()
  configlib.validate(c, 8)
  mcfg = experiment.model_config_from(c)
  assert isinstance(mcfg, wan.WanConfig)
  assert 14.2e9 < wan.count_params(mcfg) < 14.4e9
  assert wan.count_params(experiment.model_config_from(_real('1.3b'))) < 1.45e9
  # 81 frames at 832x480: 21 latent frames of 30 x 52 tokens.
  lat = c.latent
  assert (lat.frames, lat.height // 2, lat.width // 2) == (21, 30, 52)
  assert lat.frames * (lat.height // 2) * (lat.width // 2) == 32760
  for variant in ('1.3b', '720p', 'full,disagg', '1.3b,full'):
    configlib.validate(_real(variant), 8)
  sig = experiment.build_schedule(c, 32760)
  assert len(sig) == c.sampler.num_steps + 1 and sig[0] == 1.0 and sig[-1] == 0.0


@pytest.mark.parametrize(
    'field,value,match',
    [
        ('text.encoder', 'qwen2.5-vl', "family='wan' conditions on umT5.*'umt5'"),
        ('sampler.norm_rescale', True, 'norm_rescale=False'),
        ('sampler.shift', 0.0, r"scheduler='wan'.*sampler.shift"),
        ('model.ffn_dim', 0, r'model.ffn_dim=0 must be an int >= 1'),
    ],
)
def test_video_config_errors_name_the_field(field, value, match):
  c = _real()
  configlib.apply_overrides(c, {field: value})
  with pytest.raises(ValueError, match=match):
    configlib.validate(c, 8)


def test_image_families_refuse_frames_and_video_rewards():
  from configs import qwenimage

  c = qwenimage.get_config('tiny')
  c.latent.frames = 3
  with pytest.raises(ValueError, match=r"latent.frames=3: videos are model.family='wan'"):
    configlib.validate(c, 1)
  c = qwenimage.get_config('tiny')
  c.text.encoder, c.text.cache = 'umt5', '/c'
  with pytest.raises(ValueError, match="text.encoder='umt5' is Wan's"):
    configlib.validate(c, 1)
  c = qwenimage.get_config('tiny')
  c.reward.weights = 'shapes:1,temporal_consistency:1'
  with pytest.raises(ValueError, match=r"\['temporal_consistency'\] score videos"):
    configlib.validate(c, 1)


def test_rollout_samples_and_decodes_videos(tmp_path):
  """`:tiny` (pixel space, 3 frames of 16x16): the trajectory holds every frame's tokens, the
  program returns uint8 videos, each the final latents' frames quantised."""
  c = wan21.get_config('tiny')
  c.sampler.num_steps = 3
  c.sampler.guidance_scale = 5.0
  c.sampler.norm_rescale = False
  exp = experiment.build(c, str(tmp_path), 1)
  assert exp.img_shape == (3, 8, 8) and exp.latent_shape == (192, 12)
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  prompts = [p for p in exp.prompts.next_batch() for _ in range(c.rl.group_size)]
  cond = jax.tree.map(jnp.asarray, exp.conditioning(prompts))
  uncond = jax.tree.map(jnp.asarray, exp.conditioning([''] * len(prompts)))
  traj, videos = programs.make_rollout(exp, mesh)(
      exp.params, cond, uncond, jax.random.key(0), jnp.int32(0)
  )
  assert traj.latents.shape == (4, 8, 192, 12)
  assert videos.shape == (8, 3, 16, 16, 3) and videos.dtype == jnp.uint8
  frames = latents_lib.unpack_frames(traj.final, 3, 16, 16, 2)
  want = np.clip((np.clip(np.asarray(frames), -1, 1) + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)
  np.testing.assert_array_equal(np.asarray(videos), want)
  assert np.all(np.asarray(traj.log_probs)[:-1] != 0)  # SDE steps, log-probs over every frame


# ---------------------------------------------------------------------------------------------
# The whole path at toy size (slow).


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """The toy diffusers Wan2.1 folder, built here (the worker has torch already)."""
  out = str(tmp_path_factory.mktemp('tiny_wan'))
  tiny_pipeline.build_wan(out)
  return out


@pytest.fixture(scope='module')
def straight(folder, tmp_path_factory):
  """3 colocated LoRA steps in one run (also encodes the prompts: a child process)."""
  wd = tmp_path_factory.mktemp('wan_straight')
  run_main(folder, wd, config=CONFIG)
  return wd


def _adapters(workdir):
  return load_file(str(workdir / 'lora' / 'pytorch_lora_weights.safetensors'))


@pytest.mark.slow
def test_colocated_lora_runs_and_resumes_bit_for_bit(folder, straight, tmp_path):
  rows = metrics_rows(straight)
  train = [r for r in rows if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert all(np.isfinite(r['loss']) and r['nonfinite'] == 0 for r in train)
  assert abs(train[0]['ratio_mean'] - 1.0) < 1e-5, train[0]  # on-policy: exact log-probs
  assert any('eval/reward_mean' in r for r in rows)
  assert os.path.isfile(straight / 'eval' / 'before_after.gif')
  adapters = _adapters(straight)
  assert any('attn2' in k for k in adapters) and any('attn1' in k for k in adapters)
  assert any('lora_B' in k and np.abs(v).max() > 0 for k, v in adapters.items())  # it trained

  resumed = tmp_path / 'resumed'
  run_main(folder, resumed, '--config.total_steps=2', config=CONFIG)
  assert 'resumed from' in run_main(folder, resumed, config=CONFIG).stderr
  assert [x['step'] for x in metrics_rows(resumed) if 'reward_mean' in x] == [1, 2, 3]
  again = _adapters(resumed)
  assert sorted(again) == sorted(adapters)
  for k in adapters:
    np.testing.assert_array_equal(again[k], adapters[k], err_msg=k)


@pytest.mark.slow
def test_two_processes_with_gap_equal_colocated(folder, straight, tmp_path):
  """Rollout and trainer in two processes, each batch cut into 2 GAP fragments of 4 samples:
  strictly on-policy, so the same 3 updates as a colocated run up to float rounding.

  Both runs score temporal consistency alone: the rollout program of 4 samples rounds floats
  unlike the colocated one of 8, which flips a few pixels' uint8 values, and a JPEG's size (or a
  ShapesBench verdict) jumps with such a flip (a step-1 JPEG reward differed by 5e-5 and the
  adapters by far more than rounding), while a mean over pixels moves by the flip alone."""
  smooth = '--config.reward.weights=temporal_consistency:1'
  ref_wd = tmp_path / 'colocated'
  run_main(folder, ref_wd, smooth, config=CONFIG)
  wd = tmp_path / 'gap'
  extra = ('--config.schedule.fragments=2', '--config.schedule.fragment_unit=sample', smooth)
  run_main_two_processes(folder, wd, *extra, config=CONFIG)
  train = [r for r in metrics_rows(wd) if 'reward_mean' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  assert train[0]['publish_mb'] < 0.1  # only adapters travel
  ref = [r for r in metrics_rows(ref_wd) if 'reward_mean' in r]
  for a, b in zip(train, ref):
    assert a['reward_mean'] == pytest.approx(b['reward_mean'], rel=1e-4, abs=1e-6)
  gap, colocated = _adapters(wd), _adapters(ref_wd)
  assert sorted(gap) == sorted(colocated)
  worst = max(float(np.abs(gap[k] - colocated[k]).max()) for k in gap)
  scale = max(float(np.abs(v).max()) for v in colocated.values())
  print(f'GAP (2 processes) vs colocated adapters after 3 steps: max |diff| {worst:.2e}')
  assert worst <= 1e-4 * scale


@pytest.mark.slow
def test_diffusers_loads_the_runs_adapters(folder, straight):
  """The adapters the run saved: diffusers' WanPipeline.from_pretrained(folder) then
  load_lora_weights(<workdir>/lora) computes our merged forward (base streamed from the same
  folder, adapters read back from the file)."""
  import diffusers
  from flax import nnx
  from digen_jax.models.lora import adapters as lora
  from digen_jax.models.io import wan_convert
  from tests.helpers.parity import rel_err
  from tests.helpers.wan_forward import FRAMES, H, W, ours_forward, torch_forward

  model = wan_convert.load_wan_folder(folder)
  table = wan_convert.wan_key_table(model.config)
  adapters, cfg = lora.load_diffusers_lora(straight / 'lora', table)
  assert (cfg.rank, cfg.alpha) == (4, 8.0)
  graphdef, state = nnx.split(model)
  merged = nnx.merge(graphdef, lora.merge(state, adapters, cfg))
  pipe = diffusers.WanPipeline.from_pretrained(folder)
  pipe.load_lora_weights(str(straight / 'lora'))
  rng = np.random.default_rng(3)
  latents = rng.standard_normal((2, FRAMES, H, W, 4), dtype=np.float32)
  text = rng.standard_normal((2, 9, 32), dtype=np.float32)
  sigma = np.array([0.9, 0.4], np.float32)
  ref = torch_forward(pipe.transformer, latents, sigma, text)
  err = rel_err(ours_forward(merged, latents, sigma, text), ref)
  print(f"the run's LoRA through diffusers load_lora_weights: max relative error {err:.2e}")
  assert err <= 1e-4
  base = ours_forward(model, latents, sigma, text)
  assert rel_err(base, ref) > 1e-4  # the trained adapters change the output
