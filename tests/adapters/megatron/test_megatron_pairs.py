"""Refusals of a plan that megatron-core's combined F/B step (`--overlap-moe-expert-parallel-comm`) cannot run
(adapters/megatron/pairs.py): one line naming the plan field or the flag, and the fix. The runs themselves (pairs
equal to Megatron's own combined 1F1B at PP 2 x EP 2) are in test_megatron_schedule.py's 4-rank spawn."""

import random

from octopipe_plugin.adapters.megatron.mapping import fuse_backward, split_stages
from octopipe_plugin.adapters.megatron.pairs import device_problem, overlap_problem
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.testing.plans import make_plan, placement, sample_schedule

import megatron_harness as H

GRAPH = H.TinyGPT(num_layers=4, moe_layers=(0, 1, 2, 3)).graph()


def test_combined_plan_runs():
    assert overlap_problem(build_plan(GRAPH, "combined-1f1b", 2, 4, stages_per_device=2), 0) is None


def test_split_backward_is_refused_and_fused_backward_runs():
    devices = placement("looped", 4, 2)
    plan = make_plan(stage_devices=devices, bounds=[(0, 2), (2, 3), (3, 4), (4, 6)], num_devices=2, num_microbatches=4,
                     schedule=sample_schedule(devices, 2, 4, random.Random(3)), model="tiny-gpt")
    split = [s for s in split_stages(plan) if plan.stages[s].device == 0]
    assert split, "the sampled plan splits no backward on rank 0"
    why = overlap_problem(plan, 0)
    assert why is not None and f"stages {split}" in why and "I/W" in why and "fuse_backward" in why
    fused, _ = fuse_backward(plan, range(plan.num_stages))
    assert overlap_problem(fused, 0) is None


def test_memory_choices_are_refused():
    why = overlap_problem(build_plan(GRAPH, "combined-1f1b", 2, 4, stages_per_device=2), 0, memory=object())
    assert why.startswith("plan.memory:") and "--overlap-moe-expert-parallel-comm" in why


def test_a_cpu_process_without_cuda_events_is_refused_naming_megatrons_line(monkeypatch):
    """torch's own Event class (the CPU shims of another test in this process put it back first): on a CPU build
    megatron-core's chunk plan cannot make its torch.cuda.Event(); on a GPU nothing is refused."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", torch.cuda.streams.Event)
    why = device_problem()
    if torch.cuda.is_available():
        assert why is None
        return
    assert "model_chunk_schedule_plan.py:376 torch.cuda.Event()" in why, why
    assert "drop --overlap-moe-expert-parallel-comm on CPU" in why


def test_a_launch_under_the_flag_refuses_at_start_up_what_the_combined_step_cannot_run():
    """Start-up (before any model is built): a plan of one stage per rank at PP 2 (megatron-core wants a virtual
    pipeline size under the flag), a plan with I/W on some rank; a launch without the flag refuses neither."""
    import argparse

    from octopipe_plugin.adapters.megatron.pairs import launch_refusal

    on = argparse.Namespace(overlap_moe_expert_parallel_comm=True, pipeline_model_parallel_size=2)
    off = argparse.Namespace(overlap_moe_expert_parallel_comm=False, pipeline_model_parallel_size=2)
    assert launch_refusal(on, build_plan(GRAPH, "combined-1f1b", 2, 4, stages_per_device=2)) is None
    flat = build_plan(GRAPH, "1f1b", 2, 4)
    why = launch_refusal(on, flat)
    assert "two or more stages per rank" in why and "drop --overlap-moe-expert-parallel-comm" in why
    assert launch_refusal(off, flat) is None
    split = build_plan(GRAPH, "zb-h1", 2, 4)
    assert "run I/W" in launch_refusal(on, split) and launch_refusal(off, split) is None
