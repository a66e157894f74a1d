"""Gradient check of a plan: run it on the toy model and compare with a single-process step.

Shared by the multi-process tests and the benchmark; every rank compares the layers it
owns against a reference step it computes itself on an identically seeded model copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..formats import plan_from_dict
from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.launch import init_gloo
from ..executor.forward_step import ForwardStepStages
from ..executor.memory_choices import apply_memory
from ..executor.torch_stage import TorchStages
from .toy import (
    MegatronStyleChunk, ToySpec, boundary_metas, build_layers, loss_fn, megatron_style_forward_step, microbatch,
    reference_step, stage_modules,
)


def toy_runner(spec: ToySpec, layers, plan, rank: int) -> TorchStages:
    """TorchStages of `rank`'s stages of `plan` over the toy model's `layers`."""
    ns = plan.num_stages
    bounds = [(s.start, s.end) for s in plan.stages]
    modules = stage_modules(layers, bounds, plan.stages_of(rank))
    memory = apply_memory(modules, plan)  # the plan's recompute / offload choices (None without)
    return TorchStages(modules=modules, num_stages=ns,
                       num_microbatches=plan.num_microbatches, metas=boundary_metas(spec, ns),
                       load_input=lambda mb: microbatch(spec, mb)[0], loss_fn=loss_fn(spec), memory=memory)


def forward_step_runner(spec: ToySpec, layers, plan, rank: int) -> ForwardStepStages:
    """The same stages driven Megatron-style: chunks with set_input_tensor and a forward_step_func."""
    ns = plan.num_stages
    bounds = [(s.start, s.end) for s in plan.stages]
    mine = plan.stages_of(rank)
    chunks = {s: MegatronStyleChunk(m) for s, m in stage_modules(layers, bounds, mine).items()}
    data = {s: iter([microbatch(spec, mb) for mb in range(plan.num_microbatches)])
            for s in mine if s in (0, ns - 1)}
    return ForwardStepStages(models=chunks, forward_step_func=megatron_style_forward_step, data_iterators=data,
                             num_stages=ns, num_microbatches=plan.num_microbatches, metas=boundary_metas(spec, ns))


def check_plan(rank: int, plan, spec: ToySpec, timeout_s: float = 30.0, tags: bool = True) -> None:
    """Run `plan` on this rank and assert loss and owned gradients equal the reference (float64, tight)."""
    layers = build_layers(spec)
    make = forward_step_runner if plan.meta.get("runner") == "forward_step" else toy_runner
    runner = make(spec, layers, plan, rank)
    result = PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=timeout_s, tags=tags)).run_step()
    ref = build_layers(spec)
    ref_loss = reference_step(spec, ref, plan.num_microbatches)
    label = (f"rank {rank}, plan {plan.meta.get('label', '')}, {'tagged' if tags else 'untagged'}, "
             f"{type(runner).__name__}")
    mine = plan.stages_of(rank)
    if plan.num_stages - 1 in mine:
        torch.testing.assert_close(result.loss, ref_loss, rtol=1e-12, atol=1e-14, msg=f"{label}: loss")
    elif result.loss is not None:
        raise AssertionError(f"{label}: a rank without the last stage reported a loss")
    for s in mine:
        st = plan.stages[s]
        for idx in range(st.start, st.end):
            for (name, p), q in zip(layers[idx].named_parameters(), ref[idx].parameters()):
                if p.grad is None:
                    raise AssertionError(f"{label}: layer {idx} {name} has no gradient")
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                           msg=f"{label}: layer {idx} {name}")
    if runner.pending():
        raise AssertionError(f"{label}: state of {runner.pending()} (stage, micro-batch) pairs not freed")


def check_plans_worker(rank: int, world: int, port: int, docs: list[dict], spec: ToySpec) -> None:
    """Spawn target: join the group, check every plan document in turn (every other one untagged)."""
    init_gloo(rank, world, port, timeout_s=60)
    for i, doc in enumerate(docs):
        check_plan(rank, plan_from_dict(doc), spec, tags=i % 2 == 0)
    dist.destroy_process_group()
