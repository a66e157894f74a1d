"""Refusals of a plan that megatron-core's combined F/B step (`--overlap-moe-expert-parallel-comm`) cannot run
(adapters/megatron/pairs.py): one line naming the plan field or the flag, and the fix. The runs themselves (pairs
equal to Megatron's own combined 1F1B at PP 2 x EP 2) are in test_megatron_schedule.py's 4-rank spawn. Also the
start-up's warning of MoE checkpoints megatron-core 0.19.2 saves but cannot load (startup.moe_checkpoint_warning)."""

import random

import pytest

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


# --- start-up warning: checkpoints megatron-core 0.19.2 saves but cannot load (startup.moe_checkpoint_warning) ---
# graph layers: 0 = embedding, 1..8 = decoder layers, 9 = LM head; decoder layers 2 and 5 MoE -> graph layers 3, 6
def _ckpt_args(**kw):
    from argparse import Namespace

    fields = dict(num_experts=4, expert_model_parallel_size=1, save="/ckpt", ckpt_format="torch_dist", bf16=True,
                  fp16=False, use_distributed_optimizer=False)
    return Namespace(**{**fields, **kw})


def _plan(bounds, devices, num_devices):
    return make_plan(stage_devices=devices, bounds=bounds, num_devices=num_devices, num_microbatches=4,
                     schedule=sample_schedule(devices, num_devices, 4, random.Random(0)), model="tiny-gpt")


TWO_MOE = {3, 6}
# ranks 0 (layers 0..2) and 3 (layers 8, 9) hold no MoE layer
UNEVEN = _plan([(0, 3), (3, 5), (5, 8), (8, 10)], [0, 1, 2, 3], 4)


def test_a_plan_leaving_a_pipeline_rank_without_moe_warns_naming_ranks_cause_and_fixes():
    from octopipe_plugin.adapters.megatron.startup import moe_checkpoint_warning

    why = moe_checkpoint_warning(_ckpt_args(), UNEVEN, TWO_MOE)
    assert why is not None and "\n" not in why
    assert "pipeline ranks 0, 3 with no MoE layer" in why
    for cause in ("core/optimizer/__init__.py:359-374", "core/optimizer/optimizer.py:1162",
                  "dict_utils.py:55-62", "serialization.py:439-445", "dict_utils.py:230"):
        assert cause in why
    assert "gives every pipeline rank a MoE layer" in why and "--ckpt-format torch (measured to resume)" in why
    assert "(untested) --use-distributed-optimizer" in why and "--bf16" in why
    # Megatron's default format (no --ckpt-format given), fp16, and expert parallelism without --num-experts warn too
    fp16 = moe_checkpoint_warning(_ckpt_args(ckpt_format=None, bf16=False, fp16=True), UNEVEN, TWO_MOE)
    assert fp16 is not None and "--fp16" in fp16
    assert moe_checkpoint_warning(_ckpt_args(num_experts=None, expert_model_parallel_size=2), UNEVEN, TWO_MOE)
    one = moe_checkpoint_warning(_ckpt_args(), _plan([(0, 5), (5, 10)], [0, 1], 2), {3, 4})
    assert one is not None and "pipeline rank 1 with no MoE layer" in one


@pytest.mark.parametrize("change", [
    {"ckpt_format": "torch"}, {"save": None}, {"use_distributed_optimizer": True}, {"bf16": False},
    {"num_experts": 0},
])
def test_a_launch_whose_checkpoints_load_does_not_warn(change):
    from octopipe_plugin.adapters.megatron.startup import moe_checkpoint_warning

    assert moe_checkpoint_warning(_ckpt_args(**change), UNEVEN, TWO_MOE) is None


def test_a_plan_with_a_moe_layer_on_every_pipeline_rank_does_not_warn():
    from octopipe_plugin.adapters.megatron.startup import moe_checkpoint_warning

    looped = _plan([(0, 4), (4, 7), (7, 8), (8, 10)], [0, 1, 0, 1], 2)  # layer 3 on rank 0, layer 6 on rank 1
    assert moe_checkpoint_warning(_ckpt_args(), looped, TWO_MOE) is None
    vshape = _plan([(0, 3), (3, 5), (5, 8), (8, 10)], [0, 1, 1, 0], 2)  # rank 0: 0..2 and 8..9, no MoE layer
    assert "pipeline rank 0 with no MoE layer" in moe_checkpoint_warning(_ckpt_args(), vshape, TWO_MOE)
    assert moe_checkpoint_warning(_ckpt_args(), UNEVEN, set()) is None  # no layer holds experts: nothing to merge


def test_moe_layers_follow_megatrons_layer_specs_and_mtp_rule():
    from argparse import Namespace

    from octopipe_plugin.adapters.megatron.graph import layer_specs
    from octopipe_plugin.adapters.megatron.startup import moe_layers

    args = Namespace(num_layers=4, num_experts=4, moe_layer_freq=[1, 0, 0, 1], mtp_num_layers=1)
    assert moe_layers(args, layer_specs(args)) == {1, 4, 5}  # MTP takes the last decoder layer's (MoE) spec
    args.moe_layer_freq = [1, 0, 1, 0]
    assert moe_layers(args, layer_specs(args)) == {1, 3}
    hybrid = Namespace(hybrid_layer_pattern="M*ME/*E", num_experts=4)
    assert moe_layers(hybrid, layer_specs(hybrid)) == {4, 5}
