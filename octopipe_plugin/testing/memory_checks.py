"""Executor exactness of plans with memory choices (docs/formats.md, "Memory choices"), for the multi-rank tests.

Every rank runs a plan with choices and the same plan without them on identically seeded toy models (float64)
and compares loss and every gradient of the layers it owns with `checks.check_plan`'s comparison (rtol 1e-10);
`check_plan` itself compares the plan with choices against the single-process reference. A 1% scale error on
one gradient must fail the same comparison.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..executor.engine import ExecutorOptions, PipelineExecutor
from ..executor.launch import init_gloo
from ..formats import plan_from_dict
from .checks import check_plan, toy_runner
from .toy import ToySpec, build_layers


def _same(got, want, label: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=label)  # check_plan's gradient rule


def _run(rank: int, plan, spec: ToySpec):
    layers = build_layers(spec)
    runner = toy_runner(spec, layers, plan, rank)
    result = PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=60)).run_step()
    grads = {}
    for s in plan.stages_of(rank):
        for idx in range(plan.stages[s].start, plan.stages[s].end):
            for name, p in layers[idx].named_parameters():
                grads[f"layer {idx} {name}"] = p.grad
    assert runner.pending() == 0, f"rank {rank}: state left after the step"
    return result.loss, grads


def check_memory_plans_worker(rank: int, world: int, port: int, docs: list[dict], spec: ToySpec) -> None:
    """Spawn target: each plan with choices equals the reference and the plan without them; 1% off fails."""
    init_gloo(rank, world, port, timeout_s=60)
    for doc in docs:
        plan = plan_from_dict(doc)
        label = f"rank {rank}, plan {plan.meta.get('label', '')}"
        check_plan(rank, plan, spec)
        loss, grads = _run(rank, plan, spec)
        base_loss, base = _run(rank, replace(plan, memory=()), spec)
        if loss is not None:
            _same(loss, base_loss, f"{label}: loss")
        assert grads.keys() == base.keys() and grads, label
        for name, g in grads.items():
            assert g is not None, f"{label}: {name} has no gradient"
            _same(g, base[name], f"{label}: {name}")
        name = next(iter(grads))
        try:
            _same(grads[name] * 1.01, base[name], f"{label}: {name} x 1.01")
        except AssertionError:
            pass
        else:
            raise AssertionError(f"{label}: a 1% scale error passed the comparison")
    dist.destroy_process_group()
