"""The jitted programs of every execution mode (common.py: what they share; rollout.py: the
sampling scan + decode; update.py: the GRPO update, full-batch and per fragment)."""

from digen_jax.programs.common import (
    Bound,
    behaviour_of,
    captured_arrays,
    clear_memo,
    cond_shardings,
    frozen_shardings,
    guidance_of,
    make_velocity_fn,
    ref_shardings,
    row_unit,
    step_loop_for,
    token_mesh_of,
    trajectory_shardings,
    velocity_fn_of,
)
from digen_jax.programs import tsp
from digen_jax.programs.rollout import abstract_trajectory, make_rollout
from digen_jax.programs.update import (
    ACC_SUM_KEYS,
    make_apply,
    make_fragment_grad,
    make_select,
    make_update,
    make_zero_acc,
    tsp_steps,
)

__all__ = [
    'ACC_SUM_KEYS',
    'Bound',
    'abstract_trajectory',
    'behaviour_of',
    'captured_arrays',
    'clear_memo',
    'cond_shardings',
    'frozen_shardings',
    'guidance_of',
    'make_apply',
    'make_fragment_grad',
    'make_rollout',
    'make_select',
    'make_update',
    'make_velocity_fn',
    'make_zero_acc',
    'ref_shardings',
    'row_unit',
    'step_loop_for',
    'token_mesh_of',
    'trajectory_shardings',
    'tsp',
    'tsp_steps',
    'velocity_fn_of',
]
