"""Megatron-LM adapter: express an OctoPipe plan's stages in Megatron's own layout arguments."""

from .layout import (
    hybrid_pattern_to_boundaries,
    layout_to_boundaries,
    megatron_launch_args,
    plan_to_hybrid_pattern,
    plan_to_layout,
)

__all__ = ["hybrid_pattern_to_boundaries", "layout_to_boundaries", "megatron_launch_args",
           "plan_to_hybrid_pattern", "plan_to_layout"]
