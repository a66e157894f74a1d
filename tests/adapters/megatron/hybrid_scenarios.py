"""Spawned workers: train the tiny HybridModel a few optimizer steps under one pipeline setup after another.

Like megatron_scenarios (the GPT cases) but the chunks are HybridModels: Megatron's own cases take
the '|' pattern round-robin (its select_pipeline_segment and interleaved schedule), OctoPipe's take
the pattern start-up writes for the plan (`mapping.stage_layout_args`) and are built through
`plan_model_provider(..., hybrid=True)`, whose pipeline view gives every chunk the plan's segment.
Run by megatron_scenarios.worker for cases marked scenario="hybrid" (one spawn may mix them with GPT cases);
rank 0 writes {case name: per-step losses, first-step main_grads, final weights} to a file.
"""

from __future__ import annotations

import torch

import hybrid_harness as HH
import megatron_harness as H
import megatron_scenarios as S

STEPS = 3


def _plan_pattern(spec: HH.TinyHybrid, plan) -> str:
    """The --hybrid-layer-pattern start-up writes for `plan` (its stages in stage order, '|' between)."""
    from octopipe_plugin.adapters.megatron.graph import layer_specs
    from octopipe_plugin.adapters.megatron.mapping import stage_layout_args

    user = type("Args", (), {"hybrid_layer_pattern": spec.pattern})()  # the user's pattern, no '|'
    return stage_layout_args(plan, layer_specs(user), user)["hybrid_layer_pattern"]


def _octopipe_chunks(spec: HH.TinyHybrid, plan, rank: int):
    """The plan's chunks for this rank, built as get_model would, through plan_model_provider(hybrid=True)."""
    from megatron.core import parallel_state as ps

    from octopipe_plugin.adapters.megatron import plan_model_provider

    pattern = _plan_pattern(spec, plan)
    config, _ = HH.make_config(spec, plan.num_devices, pattern)

    def model_provider(pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return HH.build_chunk(spec, config, pattern, pre_process, post_process, vp_stage)

    provider = plan_model_provider(plan, spec.graph(), model_provider, hybrid=True)
    vp = len(plan.stages_of(rank))
    chunks = []
    for i in range(vp):  # get_model's loop and its round-robin flags, which the wrapper replaces
        vs = i if vp > 1 else None
        chunks.append(provider(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs),
                               vp_stage=vs, config=config, pg_collection=None))
    return config, chunks, pattern


def _megatron_chunks(spec: HH.TinyHybrid, pattern: str, pp: int):
    """Megatron's own round-robin chunks (get_model's pre/post rule, its select_pipeline_segment)."""
    from megatron.core import parallel_state as ps

    config, _ = HH.make_config(spec, pp, pattern)
    vp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vp):
        vs = v if vp > 1 else None
        chunks.append(HH.build_chunk(spec, config, pattern, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                                     ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vs))
    return config, chunks


def _layers(chunks) -> list[tuple[int, int, str]]:
    """(global layer number, chunk index, layer class) of this rank's HybridStack layers."""
    from megatron.core.utils import get_attr_wrapped_model

    out = []
    for c, chunk in enumerate(chunks):
        decoder = get_attr_wrapped_model(chunk, "decoder")
        out += [(layer.layer_number - 1, c, type(layer).__name__) for layer in decoder.layers]
    return out


def run_case(case: dict) -> dict:
    """Train one case for STEPS steps; its losses, first-step main_grads, final weights, and layers per rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from octopipe_plugin.adapters.megatron.mapping import embedding_ranks_fn
    from octopipe_plugin.adapters.megatron.schedule import make_forward_backward_func
    from octopipe_plugin.formats import plan_from_dict

    spec: HH.TinyHybrid = case["spec"]
    pp, m = case["pp"], case["microbatches"]
    plan = plan_from_dict(case["plan"]) if case.get("plan") else None
    if plan is not None:
        H.init_parallel(pp, len(plan.stages_of(0)), embedding_ranks=embedding_ranks_fn(plan, spec.graph(), spec.tied))
        config, chunks, pattern = _octopipe_chunks(spec, plan, ps.get_pipeline_model_parallel_rank())
    else:
        pattern = case.get("pattern", spec.pattern)
        H.init_parallel(pp, len(pattern.split("|")) // pp)
        config, chunks = _megatron_chunks(spec, pattern, pp)
    layers = _layers(chunks)
    chunks = H.wrap_ddp(chunks, config)
    opt = H.make_optimizer(chunks)
    scheduler = H.make_scheduler(opt)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    if plan is not None:
        fb = make_forward_backward_func(plan)
    else:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
    fs = H.make_forward_step(spec)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    placed, device_problems = S._placement_check(case, chunks)
    losses = []
    for step in range(STEPS):
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        its = H.data_iterators(spec, len(chunks), step, m, dp_rank, dp_size)
        with placed:
            out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                     num_microbatches=m, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=False)
        losses.append(S._global_loss(out))
        if step == 0:  # the gradients the optimizer steps on, before any update has hidden their scale
            grads = H.reduced_main_grads(chunks)
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"
        scheduler.step(increment=m * spec.mbs * dp_size)
    H.release_optimizer(config)
    return {"losses": torch.stack(losses), "grads": grads, "weights": H.gathered_weights(chunks),
            "pattern": pattern, "layers": S._gathered(layers),
            "device_problems": S._gathered(device_problems) if case.get("device_check") else None}
