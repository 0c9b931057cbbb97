"""What the diffusion transformers (mmdit.MMDiT, flux.Flux, video to come) share above their layers.

`TransformerDims` gives a config dataclass its derived widths, `check_transformer_config` checks
the fields every family has, and `check_token_inputs` / `is_static_shape` check a forward's
inputs, so each family's config and forward only add what is its own.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np

from digen_jax.models import config_checks


class TransformerDims:
  """Mixin of the transformer config dataclasses (fields num_attention_heads,
  attention_head_dim, patch_size, out_channels)."""

  @property
  def inner_dim(self) -> int:
    return self.num_attention_heads * self.attention_head_dim

  @property
  def out_dim(self) -> int:
    """Channels per output token: patch_size**2 * out_channels."""
    return self.patch_size * self.patch_size * self.out_channels


def check_transformer_config(
    owner: str,
    config: Any,
    int_fields: Iterable[str],
    bool_fields: Iterable[str],
    rope_axes: str,
) -> None:
  """The fields every transformer config has: `int_fields` positive ints, axes_dims_rope (3 axes,
  described by `rope_axes`) summing to attention_head_dim, rope_theta and eps > 0, `bool_fields`
  bools, attention a known implementation. ValueError naming `owner`.field otherwise."""
  config_checks.require_positive_ints(owner, config, int_fields)
  config_checks.check_rope_axes(owner, config.axes_dims_rope, config.attention_head_dim, rope_axes)
  config_checks.require_positive(owner, config, ('rope_theta', 'eps'))
  config_checks.require_bools(owner, config, bool_fields)
  config_checks.check_attention_choice(owner, config.attention)


def is_static_shape(value: Any, rank: int) -> bool:
  """Whether `value` is a tuple or list of `rank` positive Python/numpy ints (a static shape)."""
  return (
      isinstance(value, (tuple, list))
      and len(value) == rank
      and all(isinstance(s, (int, np.integer)) and s > 0 for s in value)
  )


def check_token_inputs(
    config: Any, latents: jax.Array, sigma: jax.Array, text: jax.Array
) -> tuple[int, int, int]:
  """A forward's latents [B, N_img, in_channels], sigma [B] and text [B, L, joint_attention_dim];
  returns (B, N_img, L). ValueError naming the array otherwise."""
  if latents.ndim != 3 or latents.shape[-1] != config.in_channels:
    raise ValueError(
        f'latents must be [B, N_img, in_channels={config.in_channels}], got {latents.shape}'
    )
  b, n_img = latents.shape[:2]
  if sigma.shape != (b,):
    raise ValueError(f'sigma must be [B={b}], got {sigma.shape}')
  if text.ndim != 3 or text.shape[0] != b or text.shape[-1] != config.joint_attention_dim:
    raise ValueError(
        f'text must be [B={b}, L, joint_attention_dim={config.joint_attention_dim}], '
        f'got {text.shape}'
    )
  return b, n_img, text.shape[1]
