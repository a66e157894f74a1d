"""Megatron-LM adapter: layout strings, plan -> chunks for any placement, the OctoPipe schedule.

Submodules import megatron lazily (inside functions), so the layout conversions work where
Megatron is not installed:
- `layout`: a plan's stages as Megatron's own layout arguments (round-robin plans only);
- `mapping`: the pure plan -> Megatron mapping (no framework import): `chunk_specs`, `loss_rank`,
  `is_looped`, `plan_of_args`, `copy_ranks`, `embedding_ranks_fn`, `stage_layout_args`, `plan_segment`
  (a hybrid chunk's segment of the '|' pattern under any placement), `head_split`, `split_problem`;
- `placement`: which layers each (rank, virtual stage) builds under any plan (`chunk_specs`,
  `mapped_layout`, `plan_model_provider`, `plan_pipeline_view`), and a split LM head's shards
  (`attach_head_shard`);
- `split_head`: the owner of a split LM head: its final-norm hidden states, labels and Megatron's loss rule;
- `embeddings`: tied word embeddings and MTP copies under any placement;
- `schedule`: `make_forward_backward_func(plan)` / `get_forward_backward_func_for(plan)`;
- `stages`: the executor's StageRunner over Megatron chunks; `wgrad`: real I/W split of Megatron's linears.
"""

from .layout import (
    hybrid_pattern_to_boundaries,
    layout_to_boundaries,
    megatron_launch_args,
    plan_to_hybrid_pattern,
    plan_to_layout,
)
from .mapping import ChunkSpec, chunk_specs
from .placement import mapped_layout, plan_model_provider, plan_pipeline_view

__all__ = ["ChunkSpec", "chunk_specs", "hybrid_pattern_to_boundaries", "layout_to_boundaries", "mapped_layout",
           "megatron_launch_args", "plan_model_provider", "plan_pipeline_view", "plan_to_hybrid_pattern",
           "plan_to_layout"]
