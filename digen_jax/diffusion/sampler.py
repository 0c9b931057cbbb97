"""The rollout: T sampler steps as one ``jax.lax.scan``, recording what GRPO training needs, or
(``keep='final'``) only the final samples, which is all a likelihood-free objective trains on.

``sample`` is jit-able with ``velocity_fn``, ``latent_shape``, ``sde_cfg`` and ``norm_rescale`` static
(``sample_jit`` is that jit). Every other input may live on device, so a jitted call moves nothing
between host and device.

Noise. ``noise_key`` is either one PRNG key (the whole batch's noise is drawn together) or one key per
sample (shape [B] typed keys or [B, 2] raw keys). With per-sample keys each sample's initial latent
and step noises depend only on its own key, so a batch cut into fragments and sampled piecewise gives
the same trajectories as the whole batch (what the GAP/TAG schedules need to equal colocated runs).
Step t's noise is drawn from ``fold_in(step_key, t)``, so nothing of size T×latent is materialised.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from digen_jax.diffusion.sde import SDEConfig, cfg_velocity, euler_step, sde_step

__all__ = [
    "CleanSamples",
    "KEEP",
    "Trajectory",
    "sample",
    "sample_jit",
    "SAMPLE_STATIC_ARGNAMES",
]

KEEP = ("trajectory", "final")

_F32 = jnp.float32


@flax.struct.dataclass
class Trajectory:
  """A batch of sampled trajectories (a pytree; every field is an array).

  latents:   float32 [T+1, B, N, C]; latents[t] is x before step t, latents[T] the final sample.
  log_probs: float32 [T, B]; log p(latents[t+1] | latents[t]) under the behaviour policy, 0 on
             deterministic (Euler or zero-std) steps.
  sigmas:    float32 [T+1]; the schedule, terminal sigma included.
  sde_steps: bool [T]; which steps were stochastic.
  stds:      float32 [T, B]; transition std of each step (0 on deterministic steps).
  """

  latents: jax.Array
  log_probs: jax.Array
  sigmas: jax.Array
  sde_steps: jax.Array
  stds: jax.Array

  # The per-sample fields and their batch axis (take_rows, padding, shardings); the rest
  # (sigmas, sde_steps) is the schedule, shared by every sample.
  BATCH_AXES = {"latents": 1, "log_probs": 1, "stds": 1}

  @property
  def num_steps(self) -> int:
    return self.log_probs.shape[0]

  @property
  def final(self) -> jax.Array:
    """The sampled latents x_0 [B, N, C]."""
    return self.latents[-1]


@flax.struct.dataclass
class CleanSamples:
  """What a rollout for a likelihood-free objective (DiffusionNFT, AWM) hands to the trainer:
  the final samples and, per sample, the key of its training noise (a pytree of arrays).

  latents: float32 [B, N, C]; the sampled x_0.
  keys:    uint32 [B, 2]; raw key data (jax.random.key_data) each sample's forward-process
           noise levels and noise are drawn from at training time: derived from the sample's own
           rollout key, so a batch cut into fragments trains on the same noise as the whole.
  """

  latents: jax.Array
  keys: jax.Array

  BATCH_AXES = {"latents": 0, "keys": 0}

  @property
  def final(self) -> jax.Array:
    """The sampled latents x_0 [B, N, C]."""
    return self.latents


def _key_layout(noise_key) -> tuple[jax.Array, bool]:
  """(key, per_sample): one key, or a leading batch axis of keys."""
  key = jnp.asarray(noise_key) if not isinstance(noise_key, jax.Array) else noise_key
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    batch_ndim = key.ndim
  elif key.dtype == jnp.uint32:
    batch_ndim = key.ndim - 1
  else:
    raise ValueError(
        f"sample: noise_key has dtype {key.dtype}; pass a jax.random.key / PRNGKey (or a batch of them)."
    )
  if batch_ndim not in (0, 1):
    raise ValueError(
        f"sample: noise_key has shape {key.shape}; expected one key or a [B] batch of keys."
    )
  return key, batch_ndim == 1


def _noise(
    noise_key, latent_shape: tuple[int, ...], initial_latents: Optional[jax.Array]
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """(x at σ_0 [B, N, C], step t -> step t's noise [B, N, C]) from one key or per-sample keys
  (module docstring); x at σ_0 is `initial_latents` when given."""
  b = latent_shape[0]
  key, per_sample = _key_layout(noise_key)
  if per_sample and key.shape[0] != b:
    raise ValueError(f"sample: {key.shape[0]} per-sample noise keys for batch size B={b}.")

  if per_sample:
    keys = jax.vmap(jax.random.split)(key)  # [B, 2]
    init_key, step_key = keys[:, 0], keys[:, 1]
  else:
    init_key, step_key = jax.random.split(key)

  if initial_latents is None:
    if per_sample:
      x0 = jax.vmap(lambda k: jax.random.normal(k, latent_shape[1:], _F32))(init_key)
    else:
      x0 = jax.random.normal(init_key, latent_shape, _F32)
  else:
    x0 = jnp.asarray(initial_latents, _F32)
    if x0.shape != latent_shape:
      raise ValueError(
          f"sample: initial_latents has shape {x0.shape}; expected latent_shape={latent_shape}."
      )

  def step_noise(t):
    if per_sample:
      return jax.vmap(
          lambda k: jax.random.normal(jax.random.fold_in(k, t), latent_shape[1:], _F32)
      )(step_key)
    return jax.random.normal(jax.random.fold_in(step_key, t), latent_shape, _F32)

  return x0, step_noise


def sample(
    velocity_fn: Callable[..., jax.Array],
    params: Any,
    cond: Any,
    sigmas,
    noise_key,
    *,
    latent_shape: Sequence[int],
    sde_cfg: SDEConfig,
    sde_steps,
    guidance_scale=None,
    uncond: Any = None,
    norm_rescale: bool = False,
    initial_latents: Optional[jax.Array] = None,
    keep: str = "trajectory",
) -> Trajectory | jax.Array:
  """Sample B trajectories of T steps.

  Args:
    velocity_fn: (params, latents [B, N, C], sigma [B], cond) -> v [B, N, C].
    params: model params (any pytree).
    cond: conditioning pytree with leading dim B.
    sigmas: float32 [T+1], from ``schedule.sigmas``.
    noise_key: one PRNG key or [B] keys (see module docstring).
    latent_shape: (B, N, C), static.
    sde_cfg: the SDE variant, static.
    sde_steps: bool [T]; True = SDE step with log-prob, False = deterministic Euler, log-prob 0;
      None: every step Euler (the ODE), and no step noise is drawn at all.
    guidance_scale: None (no CFG) or the CFG scale (may be traced); needs ``uncond``.
    uncond: negative/empty-prompt cond, same structure and shapes as ``cond``.
    norm_rescale: QwenImage's true-CFG norm rescale, static.
    initial_latents: optional x at σ_0 [B, N, C]; by default standard normal from the key.
    keep: 'trajectory' (every latent, log-prob and std: GRPO's training data) or 'final' (the
      scan carries x only and stores nothing per step), static.
  Returns:
    Trajectory, or with keep='final' the final latents float32 [B, N, C].
  """
  if keep not in KEEP:
    raise ValueError(f"sample: keep={keep!r}: use one of {KEEP}.")
  latent_shape = tuple(int(d) for d in latent_shape)
  if len(latent_shape) < 2:
    raise ValueError(f"sample: latent_shape={latent_shape} must be (B, ...) with a batch dim.")
  b = latent_shape[0]
  sigmas = jnp.asarray(sigmas, _F32)
  if sigmas.ndim != 1 or sigmas.shape[0] < 2:
    raise ValueError(f"sample: sigmas has shape {sigmas.shape}; expected [T+1] with T >= 1.")
  t_steps = sigmas.shape[0] - 1
  ode = sde_steps is None
  sde_steps = jnp.zeros((t_steps,), jnp.bool_) if ode else jnp.asarray(sde_steps, jnp.bool_)
  if sde_steps.shape != (t_steps,):
    raise ValueError(f"sample: sde_steps has shape {sde_steps.shape}; expected [T]=({t_steps},).")
  x0, step_noise = _noise(noise_key, latent_shape, initial_latents)

  def body(x, t):
    s = jnp.broadcast_to(sigmas[t], (b,))
    sn = jnp.broadcast_to(sigmas[t + 1], (b,))
    v = cfg_velocity(velocity_fn, params, x, s, cond, uncond, guidance_scale, norm_rescale)
    x_ode = euler_step(x, v, s, sn)
    if ode:
      x_next, logp, std = x_ode, jnp.zeros((b,), _F32), jnp.zeros((b,), _F32)
    else:
      x_sde, logp, _, std = sde_step(x, v, s, sn, step_noise(t), sde_cfg)
      stochastic = sde_steps[t]
      x_next = jnp.where(stochastic, x_sde, x_ode)
      logp = jnp.where(stochastic, logp, 0.0)
      std = jnp.where(stochastic, std, 0.0)
    return x_next, (None if keep == "final" else (x_next, logp, std))

  if keep == "final":
    final, _ = jax.lax.scan(body, x0, jnp.arange(t_steps))
    return final
  _, (xs, log_probs, stds) = jax.lax.scan(body, x0, jnp.arange(t_steps))
  latents = jnp.concatenate([x0[None], xs], axis=0)
  return Trajectory(
      latents=latents, log_probs=log_probs, sigmas=sigmas, sde_steps=sde_steps, stds=stds
  )


SAMPLE_STATIC_ARGNAMES = ("velocity_fn", "latent_shape", "sde_cfg", "norm_rescale", "keep")
sample_jit = jax.jit(sample, static_argnames=SAMPLE_STATIC_ARGNAMES)
