"""A run's weights as the programs see them: trainable params, frozen weights, decode.

Trainable params are what the optimizer holds and the trainer publishes: the whole MMDiT (full
fine-tuning) or only LoRA adapters (config.model.lora.rank > 0). Frozen weights never change and
never travel between roles: each mesh loads its own copy straight from the checkpoint files
(models/io/streaming.py: tensor by tensor, each device's slice), once, and every program of that
mesh takes them as an argument:

  frozen = {'base': MMDiT state (LoRA's base) or None, 'vae': VAE state or None}

Inside a program, `effective(params, frozen)` gives the MMDiT weights the forward uses (the LoRA
merge W + alpha/rank * A @ B, else the params themselves) and `decode(frozen, tokens)` turns the
final packed latents into images in [-1, 1] (identity for pixel-space configs, the VAE for
'vae' space), so latents never leave the device before the reward sees pixels. A video run
(`video`: Wan) decodes uint8 videos [B, T, H, W, 3] instead, quantised on the device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp

from digen_jax.models import latents as latents_lib
from digen_jax.models.lora import adapters as lora_lib
from digen_jax.models.io import params_io
from digen_jax.models.io import streaming
from digen_jax.models.vae import qwen_vae as vae_lib
from digen_jax.parallel import mesh as mesh_lib

PIPELINE_INDEX = 'model_index.json'
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def abstract_of(tree):
  """ShapeDtypeStructs of a tree of arrays (or of ShapeDtypeStructs)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def is_pipeline_folder(path: str) -> bool:
  return os.path.isfile(os.path.join(path, PIPELINE_INDEX))


@dataclasses.dataclass
class VAESource:
  config: Any  # vae.VAEConfig / flux_vae.FluxVAEConfig
  lib: Any  # the module reading it (family.vae)
  graphdef: Any
  abstract: Any  # nnx.State of ShapeDtypeStructs
  folder: str  # the vae/ folder (safetensors)


@dataclasses.dataclass
class Weights:
  """See the module docstring. `params` holds the initial trainable values (concrete) or their
  ShapeDtypeStructs when they stream from `checkpoint` (a large full fine-tuning model)."""

  graphdef: Any  # MMDiT graphdef (the forward's structure)
  params: Any  # trainable: MMDiT state or LoRA adapters
  frozen_dtype: Any
  lora: lora_lib.LoraConfig | None = None
  load_transformer: Callable | None = (
      None  # (shardings, dtype) -> transformer state on those shardings
  )
  base_abstract: Any = None  # LoRA: the frozen base's ShapeDtypeStructs
  vae: VAESource | None = None
  latent_hw: tuple[int, int] = (0, 0)
  frames: int = 1  # latent frames (config.latent.frames)
  video: bool = False  # decode returns uint8 videos [B, T, H, W, 3] (the Wan family)
  patch: int = 2
  vae_batch_chunk: int = 0
  vae_tile: int = 0
  _frozen_cache: dict = dataclasses.field(default_factory=dict)

  # ----------------------------------------------------------------- placement (host side)

  def init_params(self, shardings):
    """The initial trainable params on `shardings` (float32 masters): a copy, never the
    buffers of self.params, which the trainer's update donates."""
    if self.lora is None and self.load_transformer is not None:
      return self.load_transformer(shardings, jnp.float32)
    return jax.device_put(self.params, shardings, may_alias=False)

  def frozen_abstract(self, decode: bool = True) -> dict:
    return {
        'base': self.base_abstract if self.lora is not None else None,
        'vae': self.vae.abstract if (decode and self.vae is not None) else None,
    }

  def frozen(self, mesh, *, fsdp: bool, decode: bool) -> dict:
    """The frozen weights on `mesh`, each loaded once per mesh and layout (roles sharing a mesh
    and layout share them). fsdp: shard the LoRA base over the mesh (else replicate it);
    decode: include the VAE (replicated)."""
    devices = tuple(d.id for d in mesh.devices.flat)
    cache = self._frozen_cache
    base = None
    if self.lora is not None:
      if (devices, fsdp) not in cache:
        sh = (
            mesh_lib.fsdp_shardings(self.base_abstract, mesh)
            if fsdp
            else jax.tree.map(lambda _: mesh_lib.replicated(mesh), self.base_abstract)
        )
        cache[(devices, fsdp)] = self.load_transformer(sh, self.frozen_dtype)
      base = cache[(devices, fsdp)]
    vae = None
    if decode and self.vae is not None:
      if (devices, 'vae') not in cache:
        rep = mesh_lib.replicated(mesh)
        cache[(devices, 'vae')] = streaming.load(
            streaming.open_checkpoint(self.vae.folder),
            self.vae.lib.vae_key_table(self.vae.config),
            self.vae.abstract,
            jax.tree.map(lambda _: rep, self.vae.abstract),
            self.frozen_dtype,
        )
      vae = cache[(devices, 'vae')]
    return {'base': base, 'vae': vae}

  # ----------------------------------------------------------------- inside the programs

  def effective(self, params, frozen):
    """The MMDiT weights the forward uses: base + LoRA delta, or the params themselves."""
    if self.lora is None:
      return params
    return lora_lib.merge(frozen['base'], params, self.lora)

  def reference(self, ref_params, frozen):
    """The KL reference's MMDiT weights: the base with adapters off (no second copy), or the
    full fine-tuning run's frozen initial params."""
    return frozen['base'] if self.lora is not None else ref_params

  @property
  def decoded_ndim(self) -> int:
    """The rank of what `decode` returns: 4 (images) or 5 (videos)."""
    return 5 if self.video else 4

  def decode(self, frozen, tokens):
    """Packed final latents [B, N, C*p*p] -> images [B, H, W, 3] in [-1, 1], or in a video run
    uint8 videos [B, T, H, W, 3] (T = 1 + 4(F - 1) through the Wan VAE; F in pixel space)."""
    if self.video:
      return to_uint8(self._decode_video(frozen, tokens))
    h, w = self.latent_hw
    if self.vae is None:
      return latents_lib.decode_pixels(tokens, h, w, self.patch)
    model = nnx.merge(self.vae.graphdef, frozen['vae'])
    return vae_lib.decode_packed(
        model,
        tokens,
        latent_hw=(h, w),
        patch=self.patch,
        batch_chunk=self.vae_batch_chunk,
        tile=self._tile(),
    )

  def _tile(self):
    """The decode's spatial tiles (config.latent.vae_tile), or None."""
    if not self.vae_tile:
      return None
    step = self.vae.config.spatial_compression  # diffusers' proportions: overlap a quarter
    stride = max(step, (self.vae_tile * 3 // 4) // step * step)
    return vae_lib.TileConfig(self.vae_tile, self.vae_tile, stride, stride)

  def _decode_video(self, frozen, tokens):
    """Packed latent video tokens -> float32 videos [B, T, H, W, 3] in [-1, 1]."""
    shape = (self.frames, *self.latent_hw)
    if self.vae is None:
      return jnp.clip(latents_lib.unpack_frames(tokens, *shape, self.patch), -1.0, 1.0)
    return self.vae.lib.decode_packed(
        nnx.merge(self.vae.graphdef, frozen['vae']),
        tokens,
        latent_shape=shape,
        patch=self.patch,
        batch_chunk=self.vae_batch_chunk,
        tile=self._tile(),
    )


def to_uint8(x):
  """float in [-1, 1] -> uint8 on the device, as outputs/visualize.to_uint8 does it on the host
  (NaN -> 0 -> 128 grey, +-inf clamped)."""
  x = jnp.nan_to_num(x.astype(jnp.float32), nan=0.0, posinf=1.0, neginf=-1.0)
  return jnp.clip((x + 1.0) * 127.5 + 0.5, 0.0, 255.0).astype(jnp.uint8)


# --------------------------------------------------------------------------- building


def _transformer_source(config, family, mcfg, same_architecture, checkpoint: str):
  """(graphdef, initial params or their abstract, loader or None) of the model in folder
  `checkpoint` (config.model.checkpoint resolved)."""
  m = config.model
  if m.init == 'random':
    graphdef, params = nnx.split(family.new(mcfg, config.seed))
    return graphdef, params, None
  path = checkpoint
  if os.path.exists(os.path.join(path, params_io.WEIGHTS_FILE)):
    if family.name != 'qwenimage':
      raise ValueError(
          f'config.model.checkpoint={path!r} is a digen_jax params folder (an MMDiT); '
          f'config.model.family={family.name!r} loads a diffusers folder'
      )
    # Our own params folder (pretrain output): small, read whole as before.
    model = params_io.load_model(path)
    if not same_architecture(model.config, mcfg):
      raise ValueError(
          f'config.model does not match the checkpoint at {path}: checkpoint has '
          f'{model.config}, config asks for {mcfg}'
      )
    model.config = mcfg  # the run's execution options (remat, scan_layers)
    graphdef, params = nnx.split(model)
    return graphdef, params, None
  ckpt_cfg = family.read_config(path)
  loader = lambda sh, dtype: family.load_sharded(path, lambda _: sh, dtype)[2]
  if not same_architecture(ckpt_cfg, mcfg):
    raise ValueError(
        f'config.model does not match the checkpoint at {path}: checkpoint has '
        f'{ckpt_cfg}, config asks for {mcfg}'
    )
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: family.new(mcfg, 0)))
  abstract = abstract_of(abstract)
  # Keys, shapes and dtypes now (headers only), so a bad checkpoint is one line at config load
  # rather than an error inside the first mesh's load.
  folder = streaming.component_folder(path, 'transformer', f'{family.name} transformer')
  streaming.check(
      streaming.open_checkpoint(folder), family.key_table(mcfg), abstract, label='diffusers'
  )
  return graphdef, abstract, loader


# The checkout's root (digen_jax/experiment/weights.py is three levels down).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_path(path: str) -> str:
  """A repo-relative path (e.g. the shipped assets/...) resolved from any working directory:
  `path` itself unless it is relative, missing here and present under the checkout's root."""
  here = os.path.join(REPO, path)
  return (
      here if not os.path.isabs(path) and not os.path.isdir(path) and os.path.isdir(here) else path
  )


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x, tree)


# Latent spaces that tasks provide (config.latent.space -> source(config) -> VAESource, e.g.
# 'ae': a ShapesBench autoencoder, tasks/shapes/autoencoder.py), beside the pipelines' own 'vae'.
_LATENT_SPACES: dict[str, Callable[[Any], VAESource]] = {}


def register_latent_space(name: str, source: Callable[[Any], VAESource]) -> None:
  """Makes config.latent.space=`name` decode with source(config) (a VAESource); registering a
  name again replaces it (a module reload)."""
  if name in ('pixel', 'vae'):
    raise ValueError(f'latent space {name!r} is built in; register another name')
  _LATENT_SPACES[name] = source


def _vae_source(config, family, checkpoint: str) -> VAESource | None:
  if config.latent.space not in ('pixel', 'vae'):
    if config.latent.space not in _LATENT_SPACES:
      raise ValueError(
          f'config.latent.space={config.latent.space!r} names no registered latent space; '
          f"registered: {sorted(_LATENT_SPACES)} besides 'pixel' and 'vae' (a task registers "
          'its own when digen_jax.tasks is imported)'
      )
    return _LATENT_SPACES[config.latent.space](config)
  if config.latent.space != 'vae':
    return None
  path = checkpoint
  folder = os.path.join(path, 'vae') if path else ''
  if not (
      path and is_pipeline_folder(path) and os.path.isfile(os.path.join(folder, 'config.json'))
  ):
    raise ValueError(
        f"config.latent.space='vae' decodes with the VAE of a diffusers pipeline "
        f'folder: config.model.checkpoint={path!r} has no {PIPELINE_INDEX} and vae/; '
        'point it at a pipeline folder (e.g. Qwen/Qwen-Image) or use a pixel-space '
        'config such as configs/qwenimage.py:tiny'
    )
  vcfg = family.vae.read_vae_config(folder)
  if vcfg.latent_channels != config.latent.channels:
    raise ValueError(
        f'config.latent.channels={config.latent.channels} but the VAE in {folder} has '
        f'{vcfg.latent_channels} latent channels; set '
        f'--config.latent.channels={vcfg.latent_channels}'
    )
  tile, step = config.latent.vae_tile, vcfg.spatial_compression
  if tile and (tile % step or tile < 2 * step):
    raise ValueError(
        f'config.latent.vae_tile={tile} must be a multiple of the VAE compression '
        f'{step} and at least {2 * step} pixels (0 = no tiling)'
    )
  graphdef, abstract = family.vae.abstract_vae(vcfg, jnp.float32)
  abstract = abstract_of(abstract)
  streaming.check(
      streaming.open_checkpoint(folder), family.vae.vae_key_table(vcfg), abstract, label='VAE'
  )
  return VAESource(vcfg, family.vae, graphdef, abstract, folder)


def build(config, family, mcfg, same_architecture, *, checkpoint: str) -> Weights:
  """The run's Weights from config.model / config.latent (files are opened, not read whole);
  `family` is models/family.py's entry for config.model.family, `mcfg` its architecture config,
  `checkpoint` the model folder (config.model.checkpoint resolved)."""
  graphdef, params, loader = _transformer_source(
      config, family, mcfg, same_architecture, checkpoint
  )
  lo = config.model.lora
  lora_cfg, base_abstract = None, None
  if lo.rank > 0:
    lora_cfg = lora_lib.LoraConfig(
        rank=int(lo.rank), alpha=float(lo.alpha or lo.rank), targets=lo.targets
    )
    base_abstract = abstract_of(params)
    if loader is None:  # a random base (tiny configs): frozen, held like a checkpoint
      base = params
      loader = lambda sh, dtype: jax.device_put(_cast(base, dtype), sh)
    paths = lora_lib.target_paths(base_abstract, family.key_table(mcfg), lora_cfg)
    params = lora_lib.init_adapters(base_abstract, paths, lora_cfg, jax.random.key(config.seed + 1))
  lat = config.latent
  return Weights(
      graphdef=graphdef,
      params=params,
      frozen_dtype=_DTYPES[config.model.frozen_dtype],
      lora=lora_cfg,
      load_transformer=loader,
      base_abstract=base_abstract,
      vae=_vae_source(config, family, checkpoint),
      latent_hw=(lat.height, lat.width),
      frames=int(lat.frames),
      video=family.name == 'wan',
      patch=config.model.patch_size,
      vae_batch_chunk=int(lat.vae_batch_chunk),
      vae_tile=int(lat.vae_tile),
  )


def host_params(weights: Weights):
  """Concrete trainable params on the default device (eval of the initial model)."""
  if isinstance(jax.tree.leaves(weights.params)[0], jax.ShapeDtypeStruct):
    dev = mesh_lib.replicated(mesh_lib.make_mesh(jax.local_devices()[:1]))
    return weights.init_params(jax.tree.map(lambda _: dev, weights.params))
  return weights.params
