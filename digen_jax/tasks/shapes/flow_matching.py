"""The programs of ShapesBench pretraining (pretrain.py): the σ sampling, the flow-matching loss
and its jitted AdamW step, the latent codec between images and generator tokens, and the jitted
ODE / SDE sampler its evals use.

    x_σ = (1 − σ)·x0 + σ·ε,   loss = mean ‖v_θ(x_σ, σ, text) − (ε − x0)‖²
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from digen_jax.diffusion import sde as sde_lib
from digen_jax.experiment import build as experiment
from digen_jax.models import latents as latents_lib
from digen_jax.models.transformers import mmdit
from digen_jax.models.io import params_io
from digen_jax.models.vae import qwen_vae as vae_lib

SIGMA_SAMPLING = ('logit_normal', 'uniform')


def sample_train_sigmas(
    key: jax.Array, batch: int, kind: str, mean: float = 0.0, std: float = 1.0, shift: float = 1.0
) -> jax.Array:
  """[batch] float32 σ in (0, 1): u ~ logit-normal (sigmoid(mean + std·z)) or uniform, then the
  static shift σ = s·u / (1 + (s − 1)·u) — the sampler's, so training covers the high-noise steps
  where a shifted schedule spends most of its steps (and where the layout is decided)."""
  if kind == 'logit_normal':
    u = jax.nn.sigmoid(mean + std * jax.random.normal(key, (batch,), jnp.float32))
  elif kind == 'uniform':
    u = jax.random.uniform(key, (batch,), jnp.float32, 1e-4, 1.0)
  else:
    raise ValueError(f'sigma sampling kind={kind!r} must be one of {SIGMA_SAMPLING}')
  return shift * u / (1.0 + (shift - 1.0) * u)


# The output layer of the pooled-text projection (MMDiTConfig.pooled_text): zero at init and when
# warm-starting a checkpoint without it, so the pooled offset to the timestep embedding starts at 0.
POOLED_TEXT_OUTPUT = ('text_pool', 'linear_2')


def zero_init_modulation(params: nnx.State) -> nnx.State:
  """adaLN-Zero (DiT): zero the block modulations, the output modulation and the output projection.

  Every block then starts as the identity (gates 0) and the model outputs v = 0; in our runs this
  learns spatially coherent images much sooner than the default (random-gate) init. Returns a new
  State; the others' params are untouched.
  """
  zero = {
      ('blocks', 'img_mod'),
      ('blocks', 'txt_mod'),
      ('norm_out',),
      ('proj_out',),
      POOLED_TEXT_OUTPUT,
  }
  flat = []
  for path, var in nnx.to_flat_state(params):
    if path[:-1] in zero:
      var = var.replace(jnp.zeros_like(var[...]))
    flat.append((path, var))
  return nnx.from_flat_state(flat)


def flow_matching_loss(
    model: mmdit.MMDiT,
    x0: jax.Array,
    noise: jax.Array,
    sigma: jax.Array,
    text: jax.Array,
    mask: jax.Array,
    img_shape: tuple[int, int, int],
) -> jax.Array:
  """Scalar mean squared error of v_θ(x_σ) against ε − x0.

  x0, noise: [B, N, C] packed tokens; sigma [B]; text [B, L, D]; mask [B, L].
  """
  s = sigma[:, None, None]
  x_t = (1.0 - s) * x0 + s * noise
  v = model(x_t, sigma, text, mask, img_shape=img_shape)
  return jnp.mean(jnp.square(v - (noise - x0)))


def make_train_step(
    graphdef, optimizer: optax.GradientTransformation, pcfg, img_shape: tuple[int, int, int]
) -> Callable:
  """jitted (params, opt_state, ema, step, x0 [B,N,C], text, mask, uncond (text [1,L,D], mask [1,L]),
  key) -> (params, opt_state, ema, loss). `ema` is None when pcfg.ema == 0."""
  kind, mean, std = pcfg.sigma_sampling, float(pcfg.logit_mean), float(pcfg.logit_std)
  shift = float(pcfg.sigma_shift)
  drop, ema_decay = float(pcfg.text_dropout), float(pcfg.ema)

  def step_fn(params, opt_state, ema, step, x0, text, mask, uncond, key):
    k_sigma, k_noise, k_drop = jax.random.split(key, 3)
    b = x0.shape[0]
    sigma = sample_train_sigmas(k_sigma, b, kind, mean, std, shift)
    noise = jax.random.normal(k_noise, x0.shape, jnp.float32)
    if drop > 0:
      # Replace a random subset of prompts with the empty prompt, so v(x, σ, "") is learnt for CFG.
      keep = jax.random.uniform(k_drop, (b,)) >= drop
      text = jnp.where(keep[:, None, None], text, uncond[0])
      mask = jnp.where(keep[:, None], mask, uncond[1])

    def loss_fn(p):
      return flow_matching_loss(nnx.merge(graphdef, p), x0, noise, sigma, text, mask, img_shape)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if ema is not None:
      # Warm-started EMA: early on the average should follow the weights, not the random init.
      d = jnp.minimum(ema_decay, (1.0 + step) / (10.0 + step))
      ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, ema, params)
    return params, opt_state, ema, loss

  return jax.jit(step_fn, donate_argnums=(0, 1, 2))


@dataclasses.dataclass(frozen=True)
class LatentCodec:
  """images [B, S, S, 3] <-> generator tokens [B, N, C] of config.latent, as pure functions of
  `params` (the autoencoder's weights, None in pixel space). Programs take `params` as an
  argument: a device array closed over would be a captured constant, which a GPU's transfer
  guard refuses to lower."""

  params: Any
  to_tokens: Callable  # (params, images) -> tokens
  to_images: Callable  # (params, tokens) -> images


def latent_codec(config: ml_collections.ConfigDict) -> LatentCodec:
  """The LatentCodec of config.latent: 'pixel', the identity (patch packing); 'ae', the
  autoencoder at config.latent.ae (normalised latents, packed as the pipelines pack theirs)."""
  lat, patch = config.latent, int(config.model.patch_size)
  if lat.space == 'pixel':
    size = int(lat.height)
    return LatentCodec(
        None,
        lambda _, im: latents_lib.pack(im, patch),
        lambda _, tok: latents_lib.decode_pixels(tok, size, size, patch),
    )
  ae_graph, ae_params = nnx.split(
      params_io.load_model(experiment.checkpoint_folder(lat.ae, 'config.latent.ae'))
  )
  hw = (int(lat.height), int(lat.width))
  return LatentCodec(
      ae_params,
      lambda p, im: vae_lib.encode_packed(nnx.merge(ae_graph, p), im, patch),
      lambda p, tok: vae_lib.decode_packed(nnx.merge(ae_graph, p), tok, hw, patch),
  )


def make_sampler(
    graphdef,
    sigmas: np.ndarray,
    img_shape: tuple[int, int, int],
    to_images: Callable,
    sde_cfg: sde_lib.SDEConfig | None = None,
    guidance: tuple[float, bool, tuple[jax.Array, jax.Array]] | None = None,
) -> Callable:
  """jitted (params, codec_params, x1 [B,N,C] initial noise, text, mask, key) -> images
  [B, S, S, 3] (to_images(codec_params, tokens): LatentCodec's decoder).

  guidance None: the conditional velocity. Otherwise (scale, norm_rescale, (text [1,L,D], mask
  [1,L]) of the negative prompt): classifier-free guidance as RL's rollouts apply it
  (sde.cfg_velocity).

  sde_cfg None: deterministic Euler ODE over `sigmas` (key unused). Otherwise steps 0 … T−2 are SDE
  steps of that kind and the last one (σ → 0) is Euler, as in GRPO rollouts (rl.timesteps never
  makes the last step stochastic: noise added there would stay in the image); step noise from
  fold_in(key, t).
  """
  # numpy (staged as literals), never device arrays closed over (LatentCodec says why).
  sig_host = np.asarray(sigmas, np.float32)
  t_steps = int(sig_host.shape[0]) - 1
  if guidance:
    guidance = (guidance[0], guidance[1], tuple(np.asarray(u) for u in guidance[2]))

  def run(params, codec_params, x1, text, mask, key):
    model = nnx.merge(graphdef, params)
    b = x1.shape[0]
    sig = jnp.asarray(sig_host)  # inside the trace: a literal of this program

    def velocity(_, x, s, cond):
      return model(x, s, cond[0], cond[1], img_shape=img_shape)

    scale, rescale, uncond = guidance if guidance else (None, False, None)
    if uncond is not None:
      uncond = tuple(jnp.broadcast_to(u, c.shape) for u, c in zip(uncond, (text, mask)))

    def body(x, t):
      s = jnp.broadcast_to(sig[t], (b,))
      sn = jnp.broadcast_to(sig[t + 1], (b,))
      v = sde_lib.cfg_velocity(velocity, None, x, s, (text, mask), uncond, scale, rescale)
      if sde_cfg is None:
        return sde_lib.euler_step(x, v, s, sn), None
      eps = jax.random.normal(jax.random.fold_in(key, t), x.shape, jnp.float32)
      x_sde = sde_lib.sde_step(x, v, s, sn, eps, sde_cfg)[0]
      return jnp.where(t < t_steps - 1, x_sde, sde_lib.euler_step(x, v, s, sn)), None

    x0, _ = jax.lax.scan(body, x1.astype(jnp.float32), jnp.arange(t_steps))
    return to_images(codec_params, x0)

  return jax.jit(run)
