"""A pipeline folder's scheduler/scheduler_config.json drives the run's sigmas: for folders with
settings unlike the releases' (dynamic shifting with other base/max shifts and sequence lengths,
a static shift, shift_terminal, the linear time shift, Karras sigmas), the sigmas the run builds
(experiment.build_schedule, what main calls) equal those diffusers' own scheduler, loaded from the
same folder, gives the FLUX / Qwen-Image pipelines (set_timesteps with their sigmas and mu)."""

import json
import os

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
import numpy as np
import pytest

from configs import flux
from configs import qwenimage
from digen_jax.experiment import build as experiment
from tests.helpers import model_folders

SETTINGS = {
    'qwen_dynamic': model_folders.QWEN_SCHEDULER,
    'flux_static_terminal': model_folders.FLUX_SCHEDULER,
    'linear_time_shift': dict(
        use_dynamic_shifting=True,
        time_shift_type='linear',
        base_shift=0.7,
        max_shift=2.0,
        base_image_seq_len=16,
        max_image_seq_len=512,
        shift_terminal=0.2,
    ),
    'karras': dict(shift=4.0, use_karras_sigmas=True),
}


def _folder(path, settings, pipeline='QwenImagePipeline'):
  """A pipeline folder holding only what the schedule reads: model_index.json and scheduler/."""
  FlowMatchEulerDiscreteScheduler(**settings).save_pretrained(os.path.join(path, 'scheduler'))
  with open(os.path.join(path, 'model_index.json'), 'w') as f:
    json.dump({'_class_name': pipeline}, f)
  return str(path)


def _diffusers_sigmas(folder, num_steps, image_seq_len):
  """What FluxPipeline / QwenImagePipeline.__call__ get from the folder's scheduler."""
  sched = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder='scheduler')
  mu = calculate_shift(
      image_seq_len,
      sched.config.get('base_image_seq_len', 256),
      sched.config.get('max_image_seq_len', 4096),
      sched.config.get('base_shift', 0.5),
      sched.config.get('max_shift', 1.15),
  )
  sched.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
  return sched.sigmas.numpy()


@pytest.mark.parametrize('name', list(SETTINGS))
@pytest.mark.parametrize('family', ['qwenimage', 'flux'])
def test_the_folders_scheduler_gives_diffusers_sigmas(tmp_path, name, family):
  folder = _folder(tmp_path, SETTINGS[name])
  c = (qwenimage if family == 'qwenimage' else flux).get_config()
  c.model.checkpoint = folder
  for num_steps, tokens in ((10, 1024), (4, 96), (16, 4096)):
    c.sampler.num_steps = num_steps
    ours = experiment.build_schedule(c, tokens)
    ref = _diffusers_sigmas(folder, num_steps, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-7, err_msg=f'{name} {num_steps}')
  # The release's built-in settings differ from these folders': the folder is what was read.
  c.model.init, c.model.checkpoint = 'random', ''
  assert not np.allclose(experiment.build_schedule(c, 96), _diffusers_sigmas(folder, 16, 96))


def test_a_static_shift_override_still_applies_on_top_of_the_folder(tmp_path):
  """config.sampler.shift > 0 replaces the folder's shifting (as a diffusers scheduler with
  use_dynamic_shifting=False and that shift would); its shift_terminal still applies."""
  folder = _folder(tmp_path / 'a', model_folders.QWEN_SCHEDULER)
  static = _folder(
      tmp_path / 'b', dict(model_folders.QWEN_SCHEDULER, use_dynamic_shifting=False, shift=3.0)
  )
  c = qwenimage.get_config()
  c.model.checkpoint, c.sampler.shift, c.sampler.num_steps = folder, 3.0, 8
  np.testing.assert_allclose(
      experiment.build_schedule(c, 256), _diffusers_sigmas(static, 8, 256), atol=2e-7
  )


@pytest.mark.parametrize(
    'edit, message',
    [
        (None, 'has no scheduler/scheduler_config.json'),
        ({'stochastic_sampling': True}, 'stochastic_sampling=true'),
        ({'use_flow_sigmas': True}, "unknown scheduler config keys ['use_flow_sigmas']"),
        ({'_class_name': 'UniPCMultistepScheduler'}, "expected 'FlowMatchEulerDiscreteScheduler'"),
        ({'shift_terminal': 1.5}, 'shift_terminal=1.5: must be in [0, 1)'),
    ],
)
def test_a_bad_scheduler_config_is_one_error_naming_the_file(tmp_path, edit, message):
  folder = _folder(tmp_path, model_folders.QWEN_SCHEDULER)
  file = os.path.join(folder, 'scheduler', 'scheduler_config.json')
  if edit is None:
    os.remove(file)
  else:
    raw = json.load(open(file))
    raw.update(edit)
    json.dump(raw, open(file, 'w'))
  c = qwenimage.get_config()
  c.model.checkpoint = folder
  with pytest.raises(ValueError) as e:
    experiment.build_schedule(c, 256)
  assert message in str(e.value) and folder in str(e.value)
  assert '\n' not in str(e.value)
