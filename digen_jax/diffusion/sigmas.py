"""Sigma schedules for flow-matching samplers, equal to diffusers' FlowMatchEulerDiscreteScheduler.

``flow_sigmas`` is Wan2.1's grid instead (WanPipeline's UniPCMultistepScheduler with
``use_flow_sigmas``): our sampler steps those sigmas with its Euler / SDE steps, not UniPC's
multistep predictor-corrector.

The QwenImage and FLUX pipelines call ``scheduler.set_timesteps(sigmas=np.linspace(1, 1/T, T), mu=mu)``
with ``mu = calculate_shift(image_seq_len, ...)`` from the scheduler config. ``sigmas`` below returns
the scheduler's resulting ``scheduler.sigmas`` (T values plus the terminal 0), computed with the same
float32 numpy operations in the same order so that the values agree to float32 rounding.

Host-side numpy on purpose: the schedule is a static input of the jitted sampler, computed once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

__all__ = [
    "SchedulerConfig",
    "qwenimage_scheduler_config",
    "flux_scheduler_config",
    "scheduler_config_from_diffusers",
    "calculate_shift",
    "sigmas",
    "flow_sigmas",
]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """The FlowMatchEulerDiscreteScheduler config fields that change the sigmas of ``set_timesteps``.

  Field names and defaults are diffusers' (so ``SchedulerConfig(**scheduler_config_json)`` works for
  the fields listed; unknown keys must be dropped by the caller).
  ``use_beta_sigmas`` and ``invert_sigmas`` exist for completeness of the mirror but are rejected by
  ``sigmas``: no supported model family uses them (beta needs scipy's beta ppf; inverted sigmas run
  the chain the other way, Mochi only).
  """

  num_train_timesteps: int = 1000
  shift: float = 1.0
  use_dynamic_shifting: bool = False
  base_shift: float = 0.5
  max_shift: float = 1.15
  base_image_seq_len: int = 256
  max_image_seq_len: int = 4096
  shift_terminal: Optional[float] = None
  time_shift_type: str = "exponential"
  use_karras_sigmas: bool = False
  use_exponential_sigmas: bool = False
  use_beta_sigmas: bool = False
  invert_sigmas: bool = False

  def __post_init__(self):
    if self.time_shift_type not in ("exponential", "linear"):
      raise ValueError(
          f"SchedulerConfig.time_shift_type={self.time_shift_type!r}: use 'exponential' or 'linear'."
      )
    if sum([self.use_karras_sigmas, self.use_exponential_sigmas, self.use_beta_sigmas]) > 1:
      raise ValueError(
          "SchedulerConfig: at most one of use_karras_sigmas, use_exponential_sigmas, "
          "use_beta_sigmas may be True."
      )
    if self.shift <= 0:
      raise ValueError(f"SchedulerConfig.shift={self.shift}: must be > 0.")
    if self.shift_terminal is not None and not (0.0 <= self.shift_terminal < 1.0):
      raise ValueError(
          f"SchedulerConfig.shift_terminal={self.shift_terminal}: must be in [0, 1) or None."
      )
    if self.max_image_seq_len == self.base_image_seq_len:
      raise ValueError(
          "SchedulerConfig: max_image_seq_len must differ from base_image_seq_len "
          "(calculate_shift divides by their difference)."
      )


def qwenimage_scheduler_config() -> SchedulerConfig:
  """Qwen/Qwen-Image ``scheduler/scheduler_config.json``."""
  return SchedulerConfig(
      num_train_timesteps=1000,
      shift=1.0,
      use_dynamic_shifting=True,
      base_shift=0.5,
      max_shift=0.9,
      base_image_seq_len=256,
      max_image_seq_len=8192,
      shift_terminal=0.02,
      time_shift_type="exponential",
  )


def flux_scheduler_config() -> SchedulerConfig:
  """black-forest-labs/FLUX.1-dev ``scheduler/scheduler_config.json`` (no shift_terminal)."""
  return SchedulerConfig(
      num_train_timesteps=1000,
      shift=3.0,
      use_dynamic_shifting=True,
      base_shift=0.5,
      max_shift=1.15,
      base_image_seq_len=256,
      max_image_seq_len=4096,
      shift_terminal=None,
      time_shift_type="exponential",
  )


SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def scheduler_config_from_diffusers(raw: dict) -> SchedulerConfig:
  """SchedulerConfig of a pipeline folder's ``scheduler/scheduler_config.json`` dict. ValueError
  for another scheduler class, ``stochastic_sampling=True`` (diffusers' own stochastic Euler
  step, which our samplers do not take) or a key this mirror does not know (it may change the
  sigmas)."""
  cls = raw.get("_class_name", SCHEDULER_CLASS)
  if cls != SCHEDULER_CLASS:
    raise ValueError(f"_class_name is {cls!r}; expected {SCHEDULER_CLASS!r}")
  if raw.get("stochastic_sampling"):
    raise ValueError(
        "stochastic_sampling=true is diffusers' stochastic Euler step; our sampler's steps are "
        "config.sampler.sde's: set it false"
    )
  fields = [f.name for f in dataclasses.fields(SchedulerConfig)]
  unknown = sorted(
      k for k in raw if not k.startswith("_") and k not in fields and k != "stochastic_sampling"
  )
  if unknown:
    raise ValueError(f"unknown scheduler config keys {unknown}; the sigmas understand {fields}")
  return SchedulerConfig(**{k: raw[k] for k in fields if k in raw})


def calculate_shift(image_seq_len: int, cfg: SchedulerConfig) -> float:
  """mu of the resolution-dependent shift: linear in the image token count (diffusers pipelines)."""
  m = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
  b = cfg.base_shift - m * cfg.base_image_seq_len
  return image_seq_len * m + b


def _time_shift(cfg: SchedulerConfig, mu: float, t: np.ndarray) -> np.ndarray:
  # Python-float scalars with a float32 array keep float32 (NEP 50), exactly as in diffusers.
  if cfg.time_shift_type == "exponential":
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
  return mu / (mu + (1 / t - 1) ** 1.0)


def _stretch_to_terminal(cfg: SchedulerConfig, t: np.ndarray) -> np.ndarray:
  one_minus_z = 1 - t
  if not one_minus_z[-1] > 0:
    # diffusers divides 0 by 0 here and returns NaN sigmas.
    raise ValueError(
        f"sigmas: shift_terminal={cfg.shift_terminal} needs a last shifted sigma < 1, got {t[-1]} "
        f"(num_steps={t.shape[0]}); use num_steps >= 2 or shift_terminal=None."
    )
  scale_factor = one_minus_z[-1] / (1 - cfg.shift_terminal)
  return 1 - (one_minus_z / scale_factor)


def sigmas(
    cfg: SchedulerConfig,
    num_steps: int,
    image_seq_len: Optional[int] = None,
    shift: Optional[float] = None,
) -> np.ndarray:
  """Sampling sigmas, float32 [num_steps + 1], from ~1 down to the appended terminal 0.

  Args:
    cfg: scheduler config of the model family.
    num_steps: T, number of sampler steps.
    image_seq_len: image token count (latent patches); required when ``cfg.use_dynamic_shifting``
      and no static ``shift`` is given.
    shift: if given, a static shift s (σ' = sσ/(1+(s−1)σ)) replaces the config's shifting (dynamic
      or static); ``shift_terminal`` and the karras/exponential conversions still apply, as they do
      for a diffusers scheduler with ``use_dynamic_shifting=False, shift=s``.
  """
  if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1:
    raise ValueError(f"sigmas: num_steps={num_steps!r} must be a positive int.")
  if cfg.use_beta_sigmas:
    raise ValueError("SchedulerConfig.use_beta_sigmas=True is not supported; set it False.")
  if cfg.invert_sigmas:
    raise ValueError("SchedulerConfig.invert_sigmas=True is not supported; set it False.")
  if shift is not None and shift <= 0:
    raise ValueError(f"sigmas: shift={shift} must be > 0.")
  num_steps = int(num_steps)

  # What the QwenImage/FLUX pipelines pass; set_timesteps casts to float32 first.
  s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
  if shift is not None:
    s = shift * s / (1 + (shift - 1) * s)
  elif cfg.use_dynamic_shifting:
    if image_seq_len is None or image_seq_len <= 0:
      raise ValueError(
          "sigmas: image_seq_len (number of image tokens) is required and must be > 0 when "
          "cfg.use_dynamic_shifting is True; or pass a static shift=..."
      )
    s = _time_shift(cfg, calculate_shift(image_seq_len, cfg), s)
  else:
    s = cfg.shift * s / (1 + (cfg.shift - 1) * s)

  if cfg.shift_terminal:
    s = _stretch_to_terminal(cfg, s)

  if cfg.use_karras_sigmas:
    rho = 7.0
    ramp = np.linspace(0, 1, num_steps)
    min_inv_rho = s[-1].item() ** (1 / rho)
    max_inv_rho = s[0].item() ** (1 / rho)
    s = (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho
  elif cfg.use_exponential_sigmas:
    s = np.exp(np.linspace(math.log(s[0].item()), math.log(s[-1].item()), num_steps))

  s = np.asarray(s, dtype=np.float32)
  return np.concatenate([s, np.zeros(1, np.float32)])


def flow_sigmas(num_steps: int, flow_shift: float, num_train_timesteps: int = 1000) -> np.ndarray:
  """Wan2.1's sampling sigmas, float32 [num_steps + 1]: diffusers' UniPCMultistepScheduler with
  ``use_flow_sigmas=True``, a static ``flow_shift`` (WanPipeline: 3.0 at 480p, 5.0 at 720p) and
  ``final_sigmas_type='zero'``: the T values of linspace(1, 1/num_train_timesteps, T + 1) before
  its last, shifted σ' = sσ/(1+(s−1)σ), then 0. Computed as diffusers does (float64, then
  float32), except that diffusers lowers a first sigma of 1 by 1e-6 to keep its multistep solver's
  log(alpha) finite; we keep 1 (the Flow-GRPO SDE treats σ = 1 exactly, and 1 − 1e-6 would make
  its first-step noise ~1000x too large)."""
  if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1:
    raise ValueError(f"flow_sigmas: num_steps={num_steps!r} must be a positive int.")
  if not flow_shift > 0:
    raise ValueError(f"flow_sigmas: flow_shift={flow_shift} must be > 0.")
  s = np.linspace(1, 1 / num_train_timesteps, int(num_steps) + 1)[:-1]
  s = flow_shift * s / (1 + (flow_shift - 1) * s)
  return np.concatenate([s, [0.0]]).astype(np.float32)
