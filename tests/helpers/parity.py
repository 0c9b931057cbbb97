"""Comparing our models with diffusers': relative error, and the matmul FLOPs of a jaxpr (to
check the analytic counts against what the traced program really multiplies)."""

import jax
import numpy as np


def rel_err(a, b):
  """max |a - b| / max |b|, in float64."""
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def subjaxprs(eqn):
  """The jaxprs nested in one equation's parameters (scan, cond, pjit, remat bodies)."""
  for v in eqn.params.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def dot_flops(jaxpr, mult=1):
  """2 x M x N x K of every dot_general in `jaxpr`, a scan's body counted once per iteration."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
      rc, rb = eqn.params["dimension_numbers"][0][1], eqn.params["dimension_numbers"][1][1]
      rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
      total += mult * 2 * int(np.prod(lhs)) * int(np.prod(rhs_free))
    inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    for sub in subjaxprs(eqn):
      total += dot_flops(sub, inner)
  return total


def flux_pipeline_image_ids(h, w):
  """FluxPipeline's [h * w, 3] latent image ids (torch and diffusers imported here only: the
  jaxpr helpers above need neither)."""
  import diffusers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  return diffusers.FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32).numpy()
