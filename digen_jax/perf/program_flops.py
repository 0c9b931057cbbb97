"""The programs' matmul FLOPs counted analytically (the family's flops_per_forward times the
forwards a program runs): what perf/program_costs.py compares XLA's counts with, and what
perf/analytic.py prices a run with when nothing is compiled."""

from __future__ import annotations

import numpy as np

from digen_jax import programs


def attention_flops(exp, batch: int) -> float:
  """The attention matmuls (QK^T and PV, all heads) of one forward on `batch` samples: the part
  of family.flops_per_forward whose backward is two matmuls even when the weights are frozen."""
  m = exp.model
  s = exp.latent_shape[0] + m.text_max_length
  blocks = m.num_layers + (m.num_single_layers if m.family == 'flux' else 0)
  return 2.0 * batch * blocks * 2 * s * s * exp.model_config.inner_dim


def forward_flops(exp, batch: int) -> float:
  return exp.family.flops_per_forward(
      exp.model_config, batch, exp.latent_shape[0], exp.model.text_max_length
  )


def lora_merge_flops(exp) -> float:
  """scale * A @ B for every adapted kernel (lora.merge), once per program."""
  if exp.weights.lora is None:
    return 0.0
  total = 0.0
  for entry in exp.params.values():
    a, b = entry['a'], entry['b']  # [..., in, r], [..., r, out]
    total += 2.0 * np.prod(a.shape) * b.shape[-1]
  return total


def lora_weight_grad_flops(exp, rows: int) -> float:
  """The full weight gradient x^T dy of every adapted kernel, one backward on `rows` samples:
  LoRA trains through the merged weight W + s A B (lora.merge), so the backward forms dW of
  each adapted kernel before projecting it onto A and B. A kernel sees its stream's tokens
  (text for add_* / to_add_out, all of them in FLUX's single-stream blocks, else image)."""
  if exp.weights.lora is None:
    return 0.0
  n_img, n_txt = exp.latent_shape[0], exp.model.text_max_length
  total = 0.0
  for path, entry in exp.params.items():
    a, b = entry['a'], entry['b']  # [..., in, r], [..., r, out]
    if path.startswith('single_blocks.'):
      tokens = n_img + n_txt
    elif '.add_' in path or 'to_add_out' in path:
      tokens = n_txt
    else:
      tokens = n_img
    total += 2.0 * rows * tokens * np.prod(a.shape[:-1]) * b.shape[-1]
  return total


def cfg_branches(exp) -> int:
  return 2 if programs.guidance_of(exp)[0] is not None else 1


def train_branches(exp) -> int:
  """Rows per sample of the training forward: the rollout's CFG branches for GRPO (it
  recomputes the guided velocity), 1 for the likelihood-free objectives (the conditional
  velocity only: programs/forward_process.py)."""
  return 1 if programs.likelihood_free(exp) else cfg_branches(exp)


def extra_forwards(exp) -> int:
  """Forwards per trained level besides the policy's of a likelihood-free objective: the old
  policy's (when the run keeps one) and the KL reference's (rl.kl_beta > 0); 0 for GRPO, whose
  reference forward is left out as before."""
  if not programs.likelihood_free(exp):
    return 0
  return int(exp.rl.keeps_old_policy) + int(exp.rl.kl_beta > 0)


def trained_steps(exp, mesh) -> int:
  """Steps a fragment's forward/backward runs: K, or K padded to the mesh under TSP."""
  k, k_pad = programs.tsp_steps(exp, mesh)
  return k_pad if exp.schedule.tsp else k


def analytic_flops(name: str, exp, mesh, batch: int) -> float:
  """Per-device matmul FLOPs of program `name`: forwards x steps x CFG branches, the backward
  (full: 2 forwards; LoRA: data gradients = the linear layers once + attention twice, plus the
  adapted kernels' full weight gradients), the remat recompute (one more forward: an upper
  bound, XLA drops the recomputed ops the backward does not read), the likelihood-free
  objectives' old-policy and reference forwards (extra_forwards; their training forward has
  no CFG branch: train_branches) and the LoRA merge."""
  n = mesh.devices.size
  if name == 'apply':
    return 0.0
  rows = batch * cfg_branches(exp)
  merge = lora_merge_flops(exp)
  if name == 'rollout':
    return ((len(exp.sigmas) - 1) * forward_flops(exp, rows) + merge) / n
  rows = batch * train_branches(exp)
  fwd = trained_steps(exp, mesh) * forward_flops(exp, rows)
  attn = trained_steps(exp, mesh) * attention_flops(exp, rows)
  if exp.weights.lora is None:
    backward = 2 * fwd
  else:
    backward = (
        (fwd - attn) + 2 * attn + trained_steps(exp, mesh) * lora_weight_grad_flops(exp, rows)
    )
  remat = fwd if exp.model_config.remat else 0.0
  extra = extra_forwards(exp) * fwd  # likelihood-free: the old policy's, the reference's
  # The merge's backward: dA = dW B^T and dB = A^T dW, each the merge's size.
  return (fwd + backward + remat + extra + 3 * merge) / n
