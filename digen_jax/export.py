"""python -m digen_jax.export --workdir=RUN --out=DIR

Writes the transformer a run trained as a diffusers pipeline folder: DIR holds the run's pipeline
folder (config.model.checkpoint) with its transformer/ replaced by the trained weights (sharded
safetensors + index, the same config.json, each tensor in the source's dtype) and every other
component (vae/, text encoders, tokenizers, scheduler/, model_index.json) copied unchanged, so
`QwenImagePipeline.from_pretrained(DIR)` / `FluxPipeline.from_pretrained(DIR)` load it. A full
fine-tune exports its trained weights; a LoRA run its adapters merged into the base
(W + alpha/rank * A @ B; the adapters alone are <workdir>/lora/, written by the run itself).
The weights are the newest readable checkpoint's; the run's config is <workdir>/config.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from absl import app
from absl import flags
from absl import logging

_FLAGS = {}


def _define_flags() -> None:
  """The command line's flags, defined only when this module runs as the command: `export()`
  is also imported beside digen_jax.main's flags (one absl registry per process)."""
  _FLAGS['workdir'] = flags.DEFINE_string(
      'workdir', None, 'The run directory (config.json, checkpoints/).'
  )
  _FLAGS['out'] = flags.DEFINE_string('out', None, 'The diffusers folder to write (new or empty).')
  _FLAGS['max_shard_mb'] = flags.DEFINE_float(
      'max_shard_mb',
      5000.0,
      'Largest safetensors shard of transformer/, in MB (diffusers: 5-10 GB).',
  )
  flags.mark_flags_as_required(['workdir', 'out'])


def fail(message: str):
  sys.exit(f'digen_jax: {message}')


def run_config(workdir: str):
  """The ConfigDict a run recorded in <workdir>/config.json (its sizes read from the folder)."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  path = os.path.join(workdir, 'config.json')
  try:
    with open(path) as f:
      return ml_collections.ConfigDict(json.load(f))
  except (OSError, ValueError) as e:
    raise ValueError(
        f'cannot read {path} ({e}): --workdir must be a run directory that digen_jax.main wrote'
    ) from None


def trained_transformer(workdir: str):
  """(config, model config, step, the trained transformer's params in our layout, host float32):
  the newest readable checkpoint's params, a LoRA run's merged into its base."""
  import jax  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import build as experiment  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import weights as weights_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.models.io import loading  # pylint: disable=g-import-not-at-top
  from digen_jax.models.lora import adapters as lora_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.outputs import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)

  config = run_config(workdir)
  path = weights_lib.repo_path(config.model.checkpoint or '')
  if config.model.init != 'checkpoint' or not weights_lib.is_pipeline_folder(path):
    raise ValueError(
        f'{workdir} trained from config.model.checkpoint={config.model.checkpoint!r} '
        f'(model.init={config.model.init!r}), not a diffusers pipeline folder: there is no '
        'pipeline to export into'
    )
  mcfg, weights = experiment.build_weights(config)
  params = weights_lib.host_params(weights)
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f'no checkpoints/ in {workdir}: nothing trained to export')
  # Read onto host arrays: the checkpoint was saved sharded over the run's devices, which this
  # process need not have.
  checkpointer = ckpt_lib.ProcessCheckpointer(ckpt_dir)
  template = {
      'params': params,
      'opt_state': jax.eval_shape(experiment.build_optimizer(config).init, params),
      'rng': ckpt_lib.key_to_data(jax.random.key(0)),
  }
  try:
    restored = checkpointer.restore_latest(template, move_aside=False)  # read only
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f'no readable checkpoint in {ckpt_dir}: nothing trained to export')
  step, state, _ = restored
  params = state['params']
  if weights.lora is not None:
    base = weights.load_transformer(loading.first_device_shardings(weights.base_abstract), None)
    params = jax.jit(lambda b, a: lora_lib.merge(b, a, weights.lora))(base, params)
  params = jax.tree.map(lambda x: jax.device_get(x).astype('float32'), params)
  return config, mcfg, step, params


def export(workdir: str, out: str, max_shard_bytes: int) -> dict:
  """Writes the diffusers folder `out` (module docstring); returns what was written."""
  from digen_jax.experiment import weights as weights_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.models.io import diffusers_export  # pylint: disable=g-import-not-at-top
  from digen_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.models.io import streaming  # pylint: disable=g-import-not-at-top

  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(f'--out={out} exists and is not an empty folder; give a new one')
  config, mcfg, step, params = trained_transformer(workdir)
  family = family_lib.of(config)
  source = weights_lib.repo_path(config.model.checkpoint)
  src_transformer = streaming.component_folder(source, 'transformer', f'{family.name} transformer')
  tensors = diffusers_export.to_diffusers(
      params, family.key_table(mcfg), streaming.open_checkpoint(src_transformer)
  )
  tmp = out.rstrip('/') + '.partial'
  shutil.rmtree(tmp, ignore_errors=True)
  # Every component but the transformer's weights as it is (hard links where the filesystem
  # allows: the text encoders and VAE of a release are tens of GB).
  shutil.copytree(
      source,
      tmp,
      ignore=lambda d, names: [
          n for n in names if os.path.samefile(d, src_transformer) and n != 'config.json'
      ],
      copy_function=_link_or_copy,
  )
  index = diffusers_export.write_sharded(
      os.path.join(tmp, os.path.relpath(src_transformer, source)),
      tensors,
      max_shard_bytes=max_shard_bytes,
  )
  shards = len(set(json.loads(index.read_text())['weight_map'].values()))
  if os.path.isdir(out):
    os.rmdir(out)
  os.replace(tmp, out)
  kind = 'LoRA merged into the base' if config.model.lora.rank > 0 else 'full fine-tune'
  return {'step': step, 'kind': kind, 'tensors': len(tensors), 'shards': shards, 'out': out}


def _link_or_copy(src: str, dst: str) -> str:
  try:
    os.link(src, dst)
    return dst
  except OSError:
    return shutil.copy2(src, dst)


def main(argv):
  del argv
  from digen_jax.outputs import faults  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every restore phase at INFO

  from digen_jax.process import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  try:
    # Not beside a run training in this workdir (its checkpoints change under the read).
    workdir, out = _FLAGS['workdir'].value, _FLAGS['out'].value
    lock = workdir_lib.acquire(workdir)
    try:
      done = export(workdir, out, int(_FLAGS['max_shard_mb'].value * 2**20))
    finally:
      lock.release()
  except (ValueError, FileNotFoundError, faults.RunError) as e:
    fail(str(e))
  print(
      f"digen_jax export: step {done['step']} ({done['kind']}) -> {done['out']}: "
      f"transformer/ {done['tensors']} tensors in {done['shards']} shard(s), the other "
      'components copied',
      flush=True,
  )


if __name__ == '__main__':
  _define_flags()
  from digen_jax.process import usage  # pylint: disable=g-import-not-at-top

  usage.exit_on_help(sys.argv, __doc__)
  app.run(main)
