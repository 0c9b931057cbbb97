"""Reward registry: name -> reward function, and weighted combinations of them.

A reward function maps a batch of images and their prompts to one float32 score per image:

    fn(images: np.ndarray [B, H, W, 3] float32 in [-1, 1], prompts: list[str]) -> np.ndarray [B] float32

Video runs (Wan) score uint8 videos [B, F, H, W, 3] (the rollout quantises them on the device:
a quarter of float32's bytes to the host). What each reward takes is registered with it
(`register(name, takes=...)`): 'images' (the default) are scored on every frame of a video, the
frames' scores averaged; 'videos' take the uint8 videos whole (e.g. 'temporal_consistency',
rewards/video.py) and refuse images; the user's callables (config.reward.callables) take 'any':
uint8 images or uint8 videos, whatever the run makes.

Rewards run on the host (numpy), outside jit: they are arbitrary code (parsers, JPEG
encoders, ...). Bad *values* (NaN, garbage) are the reward's business and must give a finite
score; bad *shapes* (wrong rank, batch/prompt mismatch) are caller bugs and raise ValueError.
"""

from __future__ import annotations

import importlib
import math
import threading
from typing import Callable, Mapping, Sequence

from absl import logging
import numpy as np

RewardFn = Callable[[np.ndarray, Sequence[str]], np.ndarray]

_REGISTRY: dict[str, RewardFn] = {}
_TAKES: dict[str, str] = {}  # name -> 'images' | 'videos' | 'any' (module docstring)
TAKES = ("images", "videos", "any")
# Modules whose import registers the core's own rewards (each defines its own with @register),
# loaded on the first lookup: 'jpeg_compressibility', 'jpeg_incompressibility',
# 'temporal_consistency'. A task's rewards ('shapes', 'shapes_dense', ...) register when
# digen_jax.tasks is imported; a reward worker imports the module that registered each reward
# it serves (`defined_in`).
BUILTIN_MODULES = (
    "digen_jax.rewards.jpeg",
    "digen_jax.rewards.video",
)
_builtins_loaded = False


def _load_builtins() -> None:
  global _builtins_loaded
  if not _builtins_loaded:
    _builtins_loaded = True
    for module in BUILTIN_MODULES:
      importlib.import_module(module)


class RewardShapeError(ValueError):
  """A reward returned the wrong shape: a bug in the reward, not a fault of one sample."""


class NonFiniteScores(ValueError):
  """A reward returned NaN or inf for some samples (their fault: the guard retries them alone)."""


def register(name: str, *, takes: str = "images") -> Callable[[RewardFn], RewardFn]:
  """Decorator: `@register("my_reward") def fn(images, prompts): ...`; takes='videos' for a
  reward of whole uint8 videos (module docstring).

  Re-registering a name raises ValueError unless it is the same function (same module and
  qualified name, e.g. a module reload).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"reward name must be a non-empty str; got {name!r}")
  if takes not in TAKES:
    raise ValueError(f"reward {name!r}: takes={takes!r} is not one of {TAKES}")

  def deco(fn: RewardFn) -> RewardFn:
    old = _REGISTRY.get(name)
    if old is not None and _ident(old) != _ident(fn):
      raise ValueError(f"reward {name!r} is already registered to {_ident(old)}; pick another name")
    _REGISTRY[name] = fn
    _TAKES[name] = takes
    return fn

  return deco


def _ident(fn) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def defined_in(names: Sequence[str]) -> list[str]:
  """The modules whose import registers the rewards `names` (those registered with @register;
  the user's callables and unknown names have none): what another process imports to find
  them."""
  _load_builtins()
  out = []
  for name in names:
    module = getattr(_REGISTRY.get(name), "__module__", None)
    if name in _REGISTRY and name not in _USER_TARGETS and module and module not in out:
      out.append(module)
  return out


def registered_names() -> list[str]:
  _load_builtins()
  return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
  _load_builtins()
  if name not in _REGISTRY:
    raise ValueError(f"unknown reward {name!r}; registered rewards: {registered_names()}")
  return _REGISTRY[name]


def check_batch(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """Validates the reward-call contract; returns images as a numpy array (no copy if possible)."""
  images = np.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f"images must have shape [B, H, W, 3]; got {images.shape}")
  if isinstance(prompts, str) or len(prompts) != images.shape[0]:
    raise ValueError(
        f"prompts must be a list with one prompt per image ({images.shape[0]}); got "
        f"{'a str' if isinstance(prompts, str) else len(prompts)}"
    )
  return images


def check_videos(videos: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """check_batch for videos [B, F, H, W, 3] (uint8, or float in [-1, 1])."""
  videos = np.asarray(videos)
  if videos.ndim != 5 or videos.shape[-1] != 3:
    raise ValueError(f"videos must have shape [B, F, H, W, 3]; got {videos.shape}")
  check_batch(videos[:, 0], prompts)
  return videos


def takes(name: str) -> str:
  """What reward `name` scores: 'images', 'videos' or 'any' (module docstring)."""
  get_reward(name)
  return _TAKES.get(name, "images")


def video_frames(videos: np.ndarray) -> np.ndarray:
  """Videos [B, F, H, W, 3] (uint8, or float in [-1, 1]) -> their frames as images
  [B * F, H, W, 3] float32 in [-1, 1] (uint8 values map to floats that quantise back to them)."""
  videos = np.asarray(videos)
  frames = videos.reshape(-1, *videos.shape[2:])
  if videos.dtype == np.uint8:
    return frames.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
  return np.asarray(frames, np.float32)


def _score(name: str, batch: np.ndarray, prompts: list[str]) -> np.ndarray:
  """Reward `name` of images [B, H, W, 3] or videos [B, F, H, W, 3], as it takes them."""
  fn, kind = get_reward(name), takes(name)
  if batch.ndim == 4:
    if kind == "videos":
      raise ValueError(
          f"reward {name!r} scores videos [B, F, H, W, 3]; this run makes images {batch.shape}"
      )
    return np.asarray(fn(batch, prompts), np.float32)
  if kind != "images":  # whole videos, uint8
    return np.asarray(fn(_uint8(batch), prompts), np.float32)
  b, f = batch.shape[:2]
  frames = video_frames(batch)
  per_frame = np.asarray(fn(frames, [p for p in prompts for _ in range(f)]), np.float32)
  if per_frame.shape != (b * f,):
    raise RewardShapeError(f"reward {name!r} returned shape {per_frame.shape}; expected ({b * f},)")
  return per_frame.reshape(b, f).mean(axis=1)


def call_reward(name: str, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
  """Runs one registered reward on images or videos and checks that it returned [B] finite
  float32."""
  images = np.asarray(images)
  images = check_videos(images, prompts) if images.ndim == 5 else check_batch(images, prompts)
  out = _score(name, images, list(prompts))
  if out.shape != (images.shape[0],):
    raise RewardShapeError(
        f"reward {name!r} returned shape {out.shape}; expected ({images.shape[0]},)"
    )
  if not np.all(np.isfinite(out)):
    raise NonFiniteScores(f"reward {name!r} returned non-finite values: {out}")
  return out


def parse_weights(spec: str) -> dict[str, float]:
  """'name[:weight],...' -> {name: weight} (weight 1 when omitted), as config.reward.weights
  holds it: 'shapes', 'shapes:1,shapes_strict:0.5'. ValueError names the bad part; unknown
  names and non-finite weights are build_reward's to reject."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(
        f"reward weights {spec!r} are empty: name at least one reward, e.g. "
        "'shapes' or 'shapes:1,shapes_strict:0.5'"
    )
  out: dict[str, float] = {}
  for part in spec.split(","):
    name, sep, w = (x.strip() for x in part.partition(":"))
    try:
      weight = float(w) if sep else 1.0
    except ValueError:
      weight = None
    if not name or weight is None:
      raise ValueError(f"reward weights {spec!r}: {part.strip()!r} is not NAME or NAME:WEIGHT")
    if name in out:
      raise ValueError(f"reward weights {spec!r} name {name!r} twice")
    out[name] = weight
  return out


def build_reward(weights: Mapping[str, float]) -> RewardFn:
  """sum_k weights[k] * reward_k(images, prompts): one [B] float32 reward from several.

  The returned function carries `.weights` (a copy) and `.components(images, prompts)`, which
  returns {name: [B] float32} for logging each term.
  """
  if not isinstance(weights, Mapping) or not weights:
    raise ValueError(f"weights must be a non-empty dict name -> float; got {weights!r}")
  _load_builtins()
  unknown = [k for k in weights if k not in _REGISTRY]
  if unknown:
    raise ValueError(f"unknown reward(s) {unknown}; registered rewards: {registered_names()}")
  w = {}
  for k, v in weights.items():
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float, np.floating, np.integer))
        or not math.isfinite(float(v))
    ):
      raise ValueError(f"weight for reward {k!r} must be a finite number; got {v!r}")
    w[k] = float(v)

  def components(images: np.ndarray, prompts: Sequence[str]) -> dict[str, np.ndarray]:
    return {k: call_reward(k, images, prompts) for k in w}

  def combined(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    parts = components(images, prompts)
    total = np.zeros(np.asarray(images).shape[0], np.float32)
    for k, r in parts.items():
      total += np.float32(w[k]) * r
    return total

  combined.weights = dict(w)
  combined.components = components
  return combined


def _uint8(images: np.ndarray) -> np.ndarray:
  """[B, (F,) H, W, 3] float in [-1, 1] (NaN-safe) -> uint8, as visualize.to_uint8 writes PNGs;
  uint8 as it is."""
  if np.asarray(images).dtype == np.uint8:
    return np.asarray(images)
  x = np.nan_to_num(np.asarray(images, np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
  return np.clip((x + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)


def _import_callable(target: str, field: str):
  """'module.path:function' or '/path/to/file.py:function' -> the function."""
  import importlib
  import importlib.util
  import os

  module_name, sep, fn_name = target.rpartition(":")
  if not sep or not module_name or not fn_name.isidentifier():
    raise ValueError(f"{field}: {target!r} is not 'module.path:function' or 'file.py:function'")
  try:
    if module_name.endswith(".py"):
      if not os.path.isfile(module_name):
        raise ValueError(f"{field}: file {module_name!r} does not exist")
      spec = importlib.util.spec_from_file_location(
          "digen_user_reward_" + os.path.splitext(os.path.basename(module_name))[0], module_name
      )
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
    else:
      module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(
        f"{field}: cannot import {module_name!r} ({e}); put it on PYTHONPATH or give " "a file path"
    ) from e
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise ValueError(f"{field}: {module_name!r} has no function {fn_name!r}")
  return fn


_USER_TARGETS: dict[str, str] = {}


def register_callables(spec: str, field: str = "config.reward.callables") -> list[str]:
  """Registers a user's rewards from 'name=module:function,...' (see configlib: reward.callables).

  Each function takes (uint8 images [B, H, W, 3], prompts: list[str]) and returns [B] scores;
  it is wrapped into the float [-1, 1] contract above. In a video run it takes the uint8 videos
  [B, F, H, W, 3] instead (takes 'any'). Returns the registered names. The same
  spec may be registered again (idempotent); a name taken by another reward raises."""
  names = []
  for part in (p.strip() for p in (spec or "").split(",")):
    if not part:
      continue
    name, sep, target = (x.strip() for x in part.partition("="))
    if not sep or not name or not target:
      raise ValueError(f"{field}: {part!r} is not NAME=module.path:function")
    if _USER_TARGETS.get(name) == target:
      names.append(name)
      continue
    _load_builtins()
    if name in _REGISTRY:
      raise ValueError(
          f"{field}: reward name {name!r} is already registered "
          f"({_ident(_REGISTRY[name])}); pick another name"
      )
    fn = _import_callable(target, field)

    def wrapped(images, prompts, _fn=fn):
      return np.asarray(_fn(_uint8(images), list(prompts)), np.float32)

    wrapped.__qualname__ = f"user:{target}"
    _REGISTRY[name] = wrapped
    _TAKES[name] = "any"
    _USER_TARGETS[name] = target
    names.append(name)
  return names


# ------------------------------------------------------------------------------------------------
# Faults of a reward at run time: a reward that raises, hangs or returns NaN must not
# end a days-long run on the first bad batch, nor slip garbage into the update.


class RewardTimeout(RuntimeError):
  """A reward call did not return within its time limit."""


def _short(prompt: str, limit: int = 120) -> str:
  return prompt if len(prompt) <= limit else prompt[: limit - 3] + "..."


def _prompt_list(prompts: Sequence[str], limit: int = 4) -> str:
  uniq = list(dict.fromkeys(prompts))
  shown = ", ".join(repr(_short(p)) for p in uniq[:limit])
  return shown + (f" and {len(uniq) - limit} more" if len(uniq) > limit else "")


class _TimedCaller:
  """fn(*args) in a daemon thread, abandoned after timeout_s (Python cannot stop a thread: a
  hung call keeps its thread, and calls made while it still runs fail at once instead of
  piling up more threads)."""

  def __init__(self, timeout_s: float):
    self.timeout_s = float(timeout_s)
    self._hung: threading.Thread | None = None

  def __call__(self, fn, *args):
    if self.timeout_s <= 0:
      return fn(*args)
    if self._hung is not None and self._hung.is_alive():
      raise RewardTimeout("an earlier call that timed out is still running")
    box = {}

    def target():
      try:
        box["out"] = fn(*args)
      except BaseException as e:  # pylint: disable=broad-except  (re-raised below)
        box["err"] = e

    t = threading.Thread(target=target, name="reward", daemon=True)
    t.start()
    t.join(self.timeout_s)
    if t.is_alive():
      self._hung = t
      raise RewardTimeout(f"no result within {self.timeout_s:g} s")
    if "err" in box:
      raise box["err"]
    return box["out"]


def call_within(timeout_s: float, fn, *args):
  """fn(*args), abandoned after timeout_s (> 0; 0 = no limit) with RewardTimeout."""
  return _TimedCaller(timeout_s)(fn, *args)


def fault_summary(faults: list[str], n: int) -> str:
  """One line for a batch's faults: the fault itself, or how many and the first (a reward that
  fails on every sample would otherwise log a line per sample)."""
  if len(faults) <= 1:
    return faults[0] if faults else ""
  return f"{len(faults)} faults in a batch of {n} samples; the first: {faults[0]}"


_ON_FAILURE = {
    "mask": "these samples score NaN and are masked out of their groups (config.reward.failed)",
    "skip": "these samples score NaN and the update is skipped (config.reward.failed='skip')",
}


def guarded(
    fn: RewardFn,
    timeout_s: float = 0.0,
    field: str = "config.reward.timeout_s",
    on_failure: str = "mask",
) -> RewardFn:
  """`fn` whose faults become NaN scores, logged as errors with the prompts that caused them.

  A NaN score makes its group's advantages NaN, and the update programs skip a batch with a
  non-finite advantage and count it (metrics.jsonl: nonfinite, skipped_updates); too many
  consecutive skips stop the run (config.runtime.max_consecutive_skips). So:
    - a call that raises is retried one sample at a time to find the prompt(s) that raise
      (a non-finite score counts as raising); those samples score NaN, the others keep the
      scores they get alone (a reward scores each image on its own);
    - a call that returns nothing within timeout_s (> 0; `field` names the setting) scores
      the whole batch NaN.
  The returned function keeps fn's attributes (.weights, .components) and adds .faults, the
  messages of its last call; the log holds one line a call (fault_summary), whatever the count.
  on_failure: config.reward.failed, for what the line says happens next."""
  call = _TimedCaller(timeout_s)

  def scored(images, prompts) -> np.ndarray:
    prompts = list(prompts)
    n = len(prompts)
    faults: list[str] = []
    try:
      out = np.asarray(call(fn, images, prompts), np.float32)
      if out.shape != (n,):
        raise ValueError(f"returned shape {out.shape}; expected ({n},)")
      if not np.all(np.isfinite(out)):
        raise ValueError(f"returned non-finite values {out[~np.isfinite(out)][:4]}")
    except RewardTimeout as e:
      out = np.full((n,), np.nan, np.float32)
      faults.append(
          f"reward timed out ({e}; {field}) on a batch of {n} samples with "
          f"prompts {_prompt_list(prompts)}"
      )
    except Exception as batch_error:  # pylint: disable=broad-except  (user code)
      out = np.full((n,), np.nan, np.float32)
      for i in range(n):
        try:
          one = np.asarray(call(fn, images[i : i + 1], prompts[i : i + 1]), np.float32)
          if one.shape != (1,) or not np.isfinite(one[0]):
            raise ValueError(f"returned {one!r} for one sample")
          out[i] = one[0]
        except RewardTimeout as e:
          faults.append(f"reward timed out ({e}; {field}) on prompt " f"{_short(prompts[i])!r}")
          break
        except Exception as e:  # pylint: disable=broad-except
          faults.append(
              f"reward raised {type(e).__name__}: {_short(str(e), 200)} "
              f"on prompt {_short(prompts[i])!r} (sample {i} of {n})"
          )
      if not faults:  # every sample scores alone: keep those scores (one per image)
        logging.warning(
            "reward raised %s: %s on a batch of %d samples, but scored each "
            "alone; using those scores",
            type(batch_error).__name__,
            _short(str(batch_error), 200),
            n,
        )
    if faults:
      logging.error("%s; %s", fault_summary(faults, n), _ON_FAILURE[on_failure])
    scored.faults = faults
    return out

  scored.faults = []
  for attr in ("weights", "components"):
    if hasattr(fn, attr):
      setattr(scored, attr, getattr(fn, attr))
  return scored
