"""Model construction inside megatron.training's pretrain under a plan whose stage->rank map is not looped.

Megatron builds chunk v of pipeline rank r as stage r + v*P: `get_model` (model_provider
scripts) and the 0.19.2 model builders (`GPTModelBuilder`, `HybridModelBuilder`, the
cfg_container route) derive pre/post_process, the layer offsets and the embedding group from
that rule. Under a V-shape or any other map these wrappers let the plan decide instead, with
the adapter's placement functions: the plan's `MappedLayout` in the TransformerConfig (GPT; a
HybridModel takes its layers and their offset from the plan's segment of the '|' pattern inside
the pipeline view), each chunk's pre/post flags, the ranks that really hold word-embedding
copies, same-rank tied copies made equal, and the Float16Module casts on the plan's first and
last stages, and under a split LM head each shard rank's HeadShard (placement.attach_head_shard).
Looped plans without splits pass straight through.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .embeddings import tie_local_copies
from .graph import hybrid_pattern, model_from_megatron
from .hooks import ModelHooks
from .mapping import chunk_specs, embedding_ranks_fn, is_looped, plan_of_args
from .placement import (apply_layout, attach_head_shard, mapped_layout, plan_float16_wrappers, plan_model_provider,
                        plan_pipeline_view)


@dataclass(frozen=True)
class PlanBuild:
    """What the wrappers need of a run whose plan is not looped."""

    plan: object
    graph: object  # the run's model graph (formats.Model)
    tied: bool  # the LM head shares the word embedding
    hybrid: bool  # a HybridModel (its stages are the '|' segments of --hybrid-layer-pattern)


def plan_to_build() -> PlanBuild | None:
    """This run's plan and model when the plan is not looped; None otherwise."""
    from megatron.training import get_args

    try:
        args = get_args()
    except AssertionError:  # megatron.training's arguments not set: a caller outside pretrain, pass through
        return None
    plan = plan_of_args(args)
    if plan is None or (is_looped(plan) and not plan.splits):  # a split head needs its shards built, looped or not
        return None
    return PlanBuild(plan=plan, graph=model_from_megatron(args),
                     tied=not getattr(args, "untie_embeddings_and_output_weights", False),
                     hybrid=bool(hybrid_pattern(args)))


def wrap_initialize_model_parallel(original):
    """initialize_model_parallel with the plan's embedding ranks (Megatron's {first, last} deadlocks under a V)."""
    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        found = plan_to_build()
        if found is not None:
            kwargs["get_embedding_ranks"] = embedding_ranks_fn(found.plan, found.graph, found.tied)
        return original(*args, **kwargs)

    return initialize_model_parallel


def wrap_get_model(original):
    """get_model building the plan's chunks through the script's model_provider."""
    @functools.wraps(original)
    def get_model(model_provider_func, *args, **kwargs):
        found = plan_to_build()
        if found is None:
            return original(model_provider_func, *args, **kwargs)
        from megatron.core import parallel_state

        provider = plan_model_provider(found.plan, found.graph, model_provider_func, hybrid=found.hybrid)
        model = original(provider, *args, **kwargs)
        plan_float16_wrappers(model, found.plan, parallel_state.get_pipeline_model_parallel_rank())
        return model

    return get_model


def wrap_build_model(build_model):
    """GPTModelBuilder / HybridModelBuilder.build_model building the plan's chunk for a vp_stage (cfg_container)."""

    @functools.wraps(build_model)
    def build_chunk(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        found = plan_to_build()
        if found is None:
            return build_model(self, pg_collection, pre_process=pre_process, post_process=post_process,
                               vp_stage=vp_stage)
        plan, graph = found.plan, found.graph
        rank = pg_collection.pp.rank()
        config = self._model_config.transformer
        if not found.hybrid and getattr(config.pipeline_model_parallel_layout, "stage_devices", None) is None:
            apply_layout(config, mapped_layout(plan, graph))
        spec = chunk_specs(plan, graph, rank)[vp_stage or 0]
        with plan_pipeline_view(plan, rank):
            return build_model(self, pg_collection, pre_process=spec.pre_process, post_process=spec.post_process,
                               vp_stage=vp_stage)

    return build_chunk


def wrap_build_distributed_models(build_distributed):
    """The builders' build_distributed_models adding the plan's hooks around Megatron's DDP/fp16 wrapping."""

    @functools.wraps(build_distributed)
    def build_distributed_models(self, pg_collection, *args, **kwargs):
        found = plan_to_build()
        pre = self._model_config.pre_wrap_hooks or []
        if found is not None and not any(getattr(h, "octopipe_plan_hook", False) for h in pre):
            plan = found.plan
            rank = pg_collection.pp.rank()

            def tie(model):
                tie_local_copies(model)
                if plan.splits:
                    attach_head_shard(plan, model, rank, self._model_config.transformer)
                return model

            def casts(model):
                plan_float16_wrappers(model, plan, rank)
                return model

            tie.octopipe_plan_hook = casts.octopipe_plan_hook = True  # our own functions: added once per builder
            # Megatron's own hook points around the DDP / Float16Module wrapping (compose_hooks: list in, list out)
            self._model_config.pre_wrap_hooks = [*pre, tie]
            self._model_config.post_wrap_hooks = [*(self._model_config.post_wrap_hooks or []), casts]
        return build_distributed(self, pg_collection, *args, **kwargs)

    return build_distributed_models


def wrap_build_data_iterators(original):
    """build_train_valid_test_data_iterators under the plan's pipeline view.

    pretrain builds one data iterator per model chunk, and the script's dataset provider asks
    `is_pipeline_first/last_stage(vp_stage=...)` whether the chunk reads data: round-robin, rank
    0's loss chunk of a V-shape would get no iterator (StopIteration at its first forward).
    """
    @functools.wraps(original)
    def build_train_valid_test_data_iterators(*args, **kwargs):
        found = plan_to_build()
        if found is None:
            return original(*args, **kwargs)
        from megatron.core import parallel_state

        with plan_pipeline_view(found.plan, parallel_state.get_pipeline_model_parallel_rank()):
            return original(*args, **kwargs)

    return build_train_valid_test_data_iterators


MODEL_HOOKS = ModelHooks(initialize_model_parallel=wrap_initialize_model_parallel, get_model=wrap_get_model,
                         build_model=wrap_build_model, build_distributed_models=wrap_build_distributed_models,
                         build_data_iterators=wrap_build_data_iterators)
