"""What the diffusion transformers (mmdit.MMDiT, flux.Flux, wan.Wan) share above their layers.

`TransformerConfig` is the base of every family's config dataclass: the fields every family has
(rotary axes, norm eps, execution options), the derived widths and the checks of the common
fields. `TransformerModel` is the base of every family's top-level module: it holds the config,
runs block stacks with the config's execution options and ends in the AdaLN output head.
`check_token_inputs` and `is_static_shape` check a forward's inputs. A family's config and model
thus only add what is their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from flax import nnx
import jax
import numpy as np

from digen_jax.models import config_checks
from digen_jax.models.transformers import layers
from digen_jax.models.transformers import stacking


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Base of the transformer configs (frozen dataclasses). A family's config adds its sizes
  (num_attention_heads, attention_head_dim, patch_size, in_channels, out_channels, ...) and
  flags, names its positive-int fields in SIZE_FIELDS (they are also diffusers' config keys),
  any further bool fields in BOOL_FIELDS, and says in ROPE_AXES what its three rotary axes are."""

  SIZE_FIELDS: ClassVar[tuple[str, ...]] = ()
  BOOL_FIELDS: ClassVar[tuple[str, ...]] = ()
  ROPE_AXES: ClassVar[str] = ''

  # Head dims per rotary axis (each even; they sum to attention_head_dim).
  axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
  # Hard-coded in diffusers (theta=10000 in QwenEmbedRope and FluxPosEmbed, eps=1e-6 for every
  # norm); kept as fields so that a variant that changes them is one config line away.
  rope_theta: float = 10000.0
  eps: float = 1e-6
  # Execution options; none changes the math or the params.
  # remat: rematerialise each block in the backward pass (jax.checkpoint).
  remat: bool = False
  # scan_layers: run each block stack under lax.scan (one compiled block: compile time
  # independent of num_layers). False unrolls them into a Python loop: compile time grows with
  # num_layers, but under autodiff nothing is stacked across layers (stacking.py), which is much
  # of a CPU update's time without remat.
  scan_layers: bool = True
  # attention: models/attention/kernels.py's implementation ("auto": cuDNN's fused kernel on a GPU in
  # bf16, the portable XLA path elsewhere; "portable"; "fused"). Same math either way.
  attention: str = 'auto'

  def __post_init__(self):
    object.__setattr__(self, 'axes_dims_rope', tuple(int(a) for a in self.axes_dims_rope))
    owner = type(self).__name__
    config_checks.require_positive_ints(owner, self, self.SIZE_FIELDS)
    config_checks.check_rope_axes(
        owner, self.axes_dims_rope, self.attention_head_dim, self.ROPE_AXES
    )
    config_checks.require_positive(owner, self, ('rope_theta', 'eps'))
    config_checks.require_bools(owner, self, ('remat', 'scan_layers') + self.BOOL_FIELDS)
    config_checks.check_attention_choice(owner, self.attention)

  @property
  def inner_dim(self) -> int:
    return self.num_attention_heads * self.attention_head_dim

  @property
  def token_channels(self) -> int:
    """Channels per input token: in_channels, which the families' configs already give packed
    (QwenImage, FLUX); a family whose diffusers in_channels is the unpacked latent's (Wan)
    overrides it."""
    return self.in_channels

  @property
  def out_dim(self) -> int:
    """Channels per output token: patch_size**2 * out_channels."""
    return self.patch_size * self.patch_size * self.out_channels


class TransformerModel(nnx.Module):
  """Base of the families' top-level modules. Holds `config` (an instance of the subclass's
  CONFIG), runs block stacks with its execution options (`run_blocks`) and maps the final tokens
  through the AdaLN output head (`output`; the subclass makes norm_out and proj_out with
  layers.output_layers)."""

  CONFIG: ClassVar[type] = TransformerConfig

  def __init__(self, config: TransformerConfig):
    if not isinstance(config, self.CONFIG):
      raise ValueError(
          f'{type(self).__name__} needs a {self.CONFIG.__name__}, got {type(config).__name__}'
      )
    self.config = config

  def run_blocks(
      self, blocks: nnx.Module, carry: Any, call: Callable[[nnx.Module, Any], Any], num_layers: int
  ) -> Any:
    """carry = call(block_i, carry) over a block stack (stacking.run_stacked), with the config's
    remat and scan_layers."""
    return stacking.run_stacked(
        blocks,
        carry,
        call,
        num_layers=num_layers,
        remat=self.config.remat,
        scan_layers=self.config.scan_layers,
    )

  def output(self, tokens: jax.Array, temb: jax.Array) -> jax.Array:
    """Final image tokens [B, N, D], temb [B, D] -> [B, N, out_dim] float32 (layers.output_head)."""
    return layers.output_head(tokens, temb, self.norm_out, self.proj_out, self.config.eps)


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
  """A forward's latents [B, N_img, token_channels], sigma [B] and text [B, L,
  joint_attention_dim]; returns (B, N_img, L). ValueError naming the array otherwise."""
  if latents.ndim != 3 or latents.shape[-1] != config.token_channels:
    raise ValueError(
        f'latents must be [B, N_img, {config.token_channels}] (packed latent tokens), '
        f'got {latents.shape}'
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
