"""A pipeline folder is the model's config (experiment/folder_config.py): the transformer's sizes
and the VAE's latent channels come from its config.json files, whatever configs/qwenimage.py and
configs/flux.py say (the releases' sizes); a size set on the command line must agree; the image
size is in pixels, checked against the VAE's compression x the patch size. On tiny folders whose
sizes are unlike every config's (tests/helpers/model_folders.py); main's whole path on such a folder is
tests/core/models/test_bad_checkpoints.py's intact run."""

import pytest

from configs import flux
from configs import qwenimage
from digen_jax.experiment import build as experiment
from digen_jax.experiment import folder_config
from digen_jax.models import family as family_lib
from tests.helpers import model_folders

FAMILIES = {
    'qwenimage': (qwenimage, model_folders.qwenimage, model_folders.QWEN_COMPRESSION * 2),
    'flux': (flux, model_folders.flux, model_folders.FLUX_COMPRESSION * 2),
}


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  return {name: make(str(tmp_path_factory.mktemp(name))) for name, (_, make, _) in FAMILIES.items()}


def _config(family, folder):
  c = FAMILIES[family][0].get_config()
  c.model.checkpoint = folder
  c.text.encoder, c.text.cache, c.text.max_length = 'word', '', 16  # no text cache needed
  c.model.frozen_dtype, c.optim.compute_dtype = 'float32', 'float32'
  c.data.prompts, c.rl.group_size, c.rl.prompts_per_step = 'shapes', 2, 1
  c.sampler.num_steps, c.model.lora.rank, c.latent.vae_batch_chunk = 2, 4, 0
  c.reward.weights = 'jpeg_compressibility'
  return c


@pytest.mark.parametrize('family', list(FAMILIES))
def test_the_run_reads_the_architecture_from_the_folder(folders, family, tmp_path):
  c = _config(family, folders[family])
  step = FAMILIES[family][2]
  c.latent.image_height, c.latent.image_width = 3 * step, 2 * step
  exp = experiment.build(c, str(tmp_path), 1)
  folder_arch = family_lib.of(c).read_config(folders[family])
  assert experiment.same_architecture(exp.model_config, folder_arch)

  assert c.model.joint_attention_dim == folder_arch.joint_attention_dim != 3584
  z = model_folders.QWEN_Z if family == 'qwenimage' else model_folders.FLUX_Z
  assert c.latent.channels == z and c.model.in_channels == z * 4
  compression = step // 2
  assert (c.latent.height, c.latent.width) == (3 * step // compression, 2 * step // compression)
  assert exp.img_shape == (1, 3, 2)  # image tokens: pixels / compression / patch
  exp.reward_fn.close()


@pytest.mark.parametrize('family', list(FAMILIES))
def test_a_size_set_on_the_command_line_must_agree(folders, family):
  c = _config(family, folders[family])
  folder_dim = family_lib.of(c).read_config(folders[family]).joint_attention_dim
  with pytest.raises(ValueError) as e:
    folder_config.resolve(c, {'model.joint_attention_dim', 'model.num_layers'})
  line = str(e.value)
  assert '\n' not in line
  assert f'config.model.num_layers={c.model.num_layers} but the model folder has 1' in line
  assert 'transformer/config.json' in line and 'drop --config.model.num_layers' in line
  c = _config(family, folders[family])
  c.model.joint_attention_dim = folder_dim  # set, and agreeing: fine
  folder_config.resolve(c, {'model.joint_attention_dim'})
  assert c.model.num_layers == 1


def test_the_image_size_must_fit_the_vae_and_patch(folders):
  c = _config('qwenimage', folders['qwenimage'])
  c.latent.image_height = 40
  with pytest.raises(ValueError) as e:
    folder_config.resolve(c)
  assert str(e.value).startswith('config.latent.image_height=40 must be a positive multiple of 16')
  assert 'compresses 8x' in str(e.value) and '--config.latent.image_height=48' in str(e.value)


def test_explicit_fields_of_a_command_line():
  argv = [
      '--config=configs/flux.py',
      '--config.model.num_layers=2',
      '--config.latent.channels',
      '4',
  ]
  assert folder_config.explicit_fields(argv) == {'model.num_layers', 'latent.channels'}


def test_a_bad_patch_size_is_left_to_validation(folders):
  from digen_jax.experiment import config as configlib  # pylint: disable=g-import-not-at-top

  c = _config('flux', folders['flux'])
  c.model.patch_size = 0
  folder_config.resolve(c)  # reads the folder without dividing by it
  with pytest.raises(ValueError, match='config.model.patch_size=0 must be an int >= 1'):
    configlib.validate(c, 1)
