"""Every Megatron name the plugin replaces, installed through one registry (`adapters/patching.Patches`).

Nothing else in the package assigns a Megatron attribute: the modules that define a replacement
(`launch` the argument parser and schedule factory, `pretrain_hooks` the model construction,
`placement` the Float16Module casts) hand it to a function here, which installs it once and
records why. `installed()` lists what is patched; a `--pipeline-schedule default` run through the
launcher installs nothing (the launcher calls `install_entry_points` only for octopipe runs).

Every installation first checks the megatron-core version (compat.SUPPORTED_MEGATRON_CORE): another
version is refused in one line before any name is replaced.

This module sits below the runtime (it imports only the registry and the pure mapping), so the
runtime may enter `pipeline_view` without an import running back up.

The replaced names (megatron-core 0.19.x):
- `megatron.training.arguments.parse_args` and `megatron.training.training.get_forward_backward_func`
  (`install_entry_points`, the launcher's octopipe runs);
- `megatron.core.parallel_state.initialize_model_parallel`, `megatron.training.training.get_model`,
  `GPTModelBuilder.build_model`, `GPTModelBuilder.build_distributed_models`, and the same two of
  `HybridModelBuilder`,
  `megatron.training.training.build_train_valid_test_data_iterators` (`install_model_hooks`,
  plans whose stage->rank map is not looped);
- `megatron.core.parallel_state.is_pipeline_first_stage` / `is_pipeline_last_stage` (`pipeline_view`:
  answer for the plan inside the view, Megatron's own answer outside it);
- `megatron.core.models.hybrid.hybrid_layer_allocation.select_pipeline_segment` (`pipeline_view`: a
  HybridModel chunk built inside the view takes the plan's stage of its '|' pattern and that stage's
  global layer offset; outside, Megatron's round-robin segment);
- `forward` of a run's Float16Module instances (`replace_forward`, fp16/bf16 runs under a plan).
- `sharded_state_dict` of the word-embedding chunk under a split head tied to it
  (`replace_sharded_state_dict`: its entry saved on the uneven grid of the shards' rows).
- `_forward_impl` of the Column/RowParallelLinear instances of a chunk run with split I/W
  (`replace_linear_impl`, handed `wgrad`'s split-capable implementation).
- `forward` of the decoder layers a plan recomputes or offloads, and the selective-recompute flags
  Megatron's constructors set from `--recompute-modules` (`recompute_mlp`, `checkpoint_core_attention`, ...)
  on the layers a plan recomputes selectively (`set_flags`, from `adapters/megatron/memory.py`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

from ..patching import Patches
from .compat import allow_megatron_training_import, require_supported_megatron
from .mapping import is_first_stage, is_last_stage, plan_segment

PATCHES = Patches("megatron")
log = logging.getLogger("octopipe.megatron")

# [(plan, pipeline rank)] whose answers the patched is_pipeline_first/last_stage give; [None]: Megatron's own.
# Process-wide, not a ContextVar: autograd's device threads would not see a context-local view.
_VIEW: list = [None]

Make = Callable[[object], object]


def installed() -> list[str]:
    """The Megatron names replaced in this process, one `name: why` line each (empty: Megatron untouched)."""
    return PATCHES.installed()


def uninstall() -> None:
    """Restore every Megatron original (tests; a process that turns back to Megatron's own schedule)."""
    PATCHES.uninstall()


def install_entry_points(*, parse_args: Make, get_forward_backward_func: Callable) -> None:
    """megatron.training's argument parser (OctoPipe's arguments, the plan) and schedule factory."""
    require_supported_megatron()  # another version: one line, and nothing patched
    allow_megatron_training_import()
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    PATCHES.replace(arguments, "parse_args", parse_args,
                    "takes OctoPipe's arguments and resolves the plan before validate_args")
    PATCHES.replace(training, "get_forward_backward_func", lambda _megatron: get_forward_backward_func,
                    "OctoPipe's schedule under --pipeline-schedule octopipe")


@dataclass(frozen=True)
class ModelHooks:
    """The replacements (each `make(original) -> replacement`) that build a plan's chunks in pretrain."""

    initialize_model_parallel: Make
    get_model: Make
    build_model: Make
    build_distributed_models: Make
    build_data_iterators: Make


def install_model_hooks(hooks: ModelHooks) -> None:
    """Model construction under a plan whose stage->rank map is not looped (pretrain_hooks' wrappers)."""
    require_supported_megatron()
    import megatron.core.parallel_state as parallel_state
    import megatron.training.training as training
    from megatron.training.models.gpt import GPTModelBuilder
    from megatron.training.models.hybrid import HybridModelBuilder

    PATCHES.replace(parallel_state, "initialize_model_parallel", hooks.initialize_model_parallel,
                    "the plan's word-embedding ranks (Megatron's {first, last} deadlocks under a V)")
    PATCHES.replace(training, "get_model", hooks.get_model, "builds the plan's chunks through the model_provider")
    for builder in (GPTModelBuilder, HybridModelBuilder):
        PATCHES.replace(builder, "build_model", hooks.build_model, "builds the plan's chunk for a vp_stage")
        PATCHES.replace(builder, "build_distributed_models", hooks.build_distributed_models,
                        "ties same-rank embedding copies and the plan's fp16 casts")
    PATCHES.replace(training, "build_train_valid_test_data_iterators", hooks.build_data_iterators,
                    "each chunk's data iterator where the plan's chunk reads data (V-shape: rank 0's loss chunk)")


def _view_answer(original, answer):
    def replacement(ignore_virtual=True, vp_stage=None):
        view = _VIEW[0]
        if view is None:
            return original(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        return answer(*view, ignore_virtual=ignore_virtual, vp_stage=vp_stage)

    replacement.__name__ = getattr(original, "__name__", "is_pipeline_stage")
    replacement.__doc__ = f"{replacement.__name__}, answered for the plan inside octopipe's pipeline_view."
    return replacement


def _segment_answer(original):
    def select_pipeline_segment(main_pattern, pp_group, vp_stage, first_stage_layers=None, last_stage_layers=None,
                                **kwargs):
        view = _VIEW[0]
        if view is None:
            return original(main_pattern, pp_group, vp_stage, first_stage_layers=first_stage_layers,
                            last_stage_layers=last_stage_layers, **kwargs)
        from megatron.core.models.hybrid.hybrid_layer_allocation import validate_segment_layers

        plan, rank, _ = view
        segment, offset = plan_segment(plan, rank, vp_stage, main_pattern)
        layers = validate_segment_layers(segment)  # Megatron's own symbol check of the segment
        # the line Megatron's own select_pipeline_segment logs for each chunk, with the plan's stage
        log.info("octopipe: HybridModel: pp_rank=%d, vp_stage=%d, plan stage %d of %d, layers '%s' (%d layers), "
                 "layer_offset=%d", rank, vp_stage or 0, plan.stages_of(rank)[vp_stage or 0], plan.num_stages,
                 segment, len(layers), offset)
        return layers, offset

    select_pipeline_segment.__doc__ = "select_pipeline_segment, answered for the plan inside octopipe's pipeline_view."
    return select_pipeline_segment


@contextlib.contextmanager
def pipeline_view(plan, rank: int, running: int | None = None):
    """Inside: `parallel_state.is_pipeline_first_stage` / `is_pipeline_last_stage` answer for `plan` on `rank`.

    Callers that pass `vp_stage` (get_batch, MTP, get_model) learn whether *that chunk* holds the
    embedding / the loss; with `ignore_virtual=True` whether this rank holds any such chunk, or,
    with `running` (the stage whose forward runs), whether that stage does. A HybridModel built inside
    takes the plan's segment of its '|' pattern (`mapping.plan_segment`). The names are replaced once,
    on first use; outside a view they give Megatron's own answer.
    """
    require_supported_megatron()
    import megatron.core.models.hybrid.hybrid_layer_allocation as hybrid_allocation
    import megatron.core.parallel_state as ps

    PATCHES.replace(ps, "is_pipeline_first_stage", lambda orig: _view_answer(orig, is_first_stage),
                    "answers for the plan inside a pipeline_view (labels, MTP, pre/post flags)")
    PATCHES.replace(ps, "is_pipeline_last_stage", lambda orig: _view_answer(orig, is_last_stage),
                    "answers for the plan inside a pipeline_view (labels, MTP, pre/post flags)")
    # HybridModel.__init__ imports it from the module at call time, so the module attribute is the one to replace
    PATCHES.replace(hybrid_allocation, "select_pipeline_segment", _segment_answer,
                    "a HybridModel chunk built inside a pipeline_view takes the plan's stage of the '|' pattern")
    saved, _VIEW[0] = _VIEW[0], (plan, rank, running)
    try:
        yield
    finally:
        _VIEW[0] = saved


def replace_forward(module, make: Make, why: str) -> bool:
    """Replace one Megatron module instance's `forward` (once); returns whether it was replaced now."""
    if PATCHES.is_replaced(module, "forward"):
        return False
    PATCHES.replace(module, "forward", make, why)
    return True


def replace_sharded_state_dict(module, make: Make, why: str) -> bool:
    """Replace one Megatron module instance's `sharded_state_dict` (once); returns whether it was replaced now."""
    if PATCHES.is_replaced(module, "sharded_state_dict"):
        return False
    PATCHES.replace(module, "sharded_state_dict", make, why)
    return True


def replace_linear_impl(linear, impl: Callable, why: str) -> bool:
    """Route one Column/RowParallelLinear instance's `_forward_impl` through `impl` (once); whether it was now."""
    if PATCHES.is_replaced(linear, "_forward_impl"):
        return False
    PATCHES.replace(linear, "_forward_impl", lambda _megatron: impl, why)
    return True


def set_flags(module, flags: dict, why: str) -> None:
    """Set instance attributes of one Megatron module (each once; `uninstall` puts Megatron's values back)."""
    for name, value in flags.items():
        PATCHES.replace(module, name, lambda _megatron, v=value: v, why)
