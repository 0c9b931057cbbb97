"""Time-step parallelism (TSP, docs/design.md#execution-modes) in the programs: a fragment
gradient's K trained steps x B samples as one batched forward/backward on the (t, b) grid of the
trainer mesh (parallel/tsp_grid.py: how t, K_pad and b are chosen). The grid is a second Mesh over
the same devices in the same order (row-major), so the jit's device assignment is unchanged and its
arguments keep the trainer mesh's shardings; only the gathered per-step arrays are constrained
onto it. Every FSDP weight is gathered once per fragment for all K_pad / t steps of a device.

`layout` is the one place a run's (K, K_pad, t, b) is computed: the fragment gradient, the
trainer's log and programs.tsp_steps read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from digen_jax.parallel import tsp_grid
from digen_jax.programs import common

STEPS, SAMPLES = 'tsp_steps', 'tsp_samples'  # the grid's axis names
Layout = tsp_grid.Layout


def layout(exp, mesh, samples: int | None = None) -> Layout:
  """The TSP layout of `exp`'s trained steps (or noise levels: common.trained_levels) on the trainer `mesh` for fragments of `samples`
  samples (default: the run's fragment size, exp.plan.size)."""
  K = common.trained_levels(exp)
  n = mesh.devices.size
  samples = exp.plan.size if samples is None else samples
  return tsp_grid.choose(K, n, samples, int(exp.schedule.tsp_steps_axis))


def grid(mesh, lay: Layout) -> Mesh:
  """The (t, b) view of `mesh`'s devices, in their order."""
  return Mesh(mesh.devices.reshape(lay.t, lay.b), (STEPS, SAMPLES), axis_types=(AxisType.Auto,) * 2)


def prepare(mesh, lay: Layout, indices, batch):
  """(indices padded to K_pad, batch cut to lay.rows rows and laid over b, grpo_objective
  options): the K steps as one vmap whose gathered [K_pad, rows, ...] arrays lie on the (t, b)
  grid. Pad steps repeat the first selected step with weight 0; the rows past `samples` are the
  fragment's own weight-0 padding (valid False), so they add nothing to loss, gradient or sums.
  batch: (traj, cond, uncond, adv, valid) with at least lay.rows rows."""
  g = grid(mesh, lay)
  have = batch[3].shape[0]
  if have < lay.rows:
    raise ValueError(f'TSP: a fragment of {have} rows, layout {lay} needs {lay.rows}')
  on_samples = lambda tree: jax.tree.map(
      lambda a: jax.lax.with_sharding_constraint(
          a, NamedSharding(g, P(SAMPLES, *([None] * (a.ndim - 1))))
      ),
      tree,
  )
  # The trajectory is left where it is: its gathered steps are laid out below.
  traj, cond, uncond, adv, valid = common.take_rows(batch, lay.rows)
  cond, uncond, adv, valid = on_samples((cond, uncond, adv, valid))

  def on_steps(tree):
    spec = lambda a: P(STEPS, *([SAMPLES] if a.ndim > 1 else []), *([None] * (a.ndim - 2)))
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(g, spec(a))), tree
    )

  step_weights = None
  if lay.K_pad > lay.K:
    indices = jnp.concatenate([indices, jnp.broadcast_to(indices[:1], (lay.K_pad - lay.K,))])
    step_weights = (jnp.arange(lay.K_pad) < lay.K).astype(jnp.float32)
  options = dict(step_weights=step_weights, step_constraint=on_steps, step_loop='vmap')
  return indices, (traj, cond, uncond, adv, valid), options
