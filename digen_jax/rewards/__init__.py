"""Rewards: a name -> function registry and the built-in pure-code rewards.

Importing this package registers 'shapes', 'shapes_dense', 'shapes_strict',
'jpeg_compressibility' and 'jpeg_incompressibility'. A config names its reward as
'name[:weight],...' (`parse_weights`).
"""

from digen_jax.rewards.registry import (
    build_reward,
    parse_weights,
    call_reward,
    get_reward,
    register,
    registered_names,
)
from digen_jax.rewards import jpeg, shapes_checker  # noqa: F401  (registers the built-ins)
from digen_jax.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from digen_jax.rewards.shapes_checker import check, shapes_reward, shapes_strict

__all__ = [
    "build_reward",
    "parse_weights",
    "call_reward",
    "get_reward",
    "register",
    "registered_names",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "check",
    "shapes_reward",
    "shapes_strict",
]
