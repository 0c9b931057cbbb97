"""ShapesBench: an offline GenEval stand-in (prompt grammar, renderer; the checker lives in
digen_jax.rewards.shapes_checker)."""

from digen_jax.data.shapes.grammar import (
    BACKGROUNDS,
    COLORS,
    HELD_OUT_PAIRS,
    RELATIONS,
    SHAPES,
    ShapeObject,
    ShapesPrompt,
    all_prompts,
    grammar_words,
    is_held_out,
    iter_all_prompts,
    parse,
    sample_prompts,
    split_prompts,
)

# The `render` function is not re-exported: it would shadow the `render` submodule.
from digen_jax.data.shapes.render import Placed, layout, rasterize, render_batch

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "HELD_OUT_PAIRS",
    "RELATIONS",
    "SHAPES",
    "ShapeObject",
    "ShapesPrompt",
    "all_prompts",
    "grammar_words",
    "is_held_out",
    "iter_all_prompts",
    "parse",
    "sample_prompts",
    "split_prompts",
    "Placed",
    "layout",
    "rasterize",
    "render_batch",
]
