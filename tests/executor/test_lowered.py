"""The lowered plan (built once per plan and rank), its text form, and the runner check at binding."""

from __future__ import annotations

import random

import pytest
import torch

from octopipe_plugin.actions import RULES, Kind, parse_schedule, stage_kinds
from octopipe_plugin.executor import (
    PipelineExecutor, RunnerInterfaceError, TensorMeta, check_runnable, check_runner, forward_plan, lowered_plan,
)
from octopipe_plugin.executor import lowered as lowered_mod
from octopipe_plugin.executor.comm_cache import plan_key as cache_plan_key
from octopipe_plugin.executor.lowered import loss_rank, plan_pairs
from octopipe_plugin.executor.nccl_rules import check_nccl_rules
from octopipe_plugin.testing.plans import make_plan, random_plan
from octopipe_plugin.executor.posting import format_lowered
from octopipe_plugin.schedules.messages import MsgKind, plan_messages
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for


def builtin(name: str, p: int, m: int, v: int | None = None):
    """A built-in schedule's plan with one layer per stage."""
    spec = SCHEDULES[name]
    devs = stage_devices_for(name, p, spec.stages_for(v))
    return make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(len(devs))], num_devices=p,
                     num_microbatches=m, schedule=spec.generate(devs, p, m))


def test_plan_messages_runs_once_per_plan_for_every_rank_checker_and_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(lowered_mod, "plan_messages", lambda plan: calls.append(1) or plan_messages(plan))
    plan = random_plan(random.Random(8101), num_devices=3, num_layers=9, num_stages=6, num_microbatches=5,
                       placement_kind="arbitrary")
    lows = [lowered_plan(plan, r) for r in range(3)]
    assert all(lowered_plan(plan, r) is lows[r] for r in range(3))  # the same object, not a rebuild
    check_nccl_rules(plan)
    plan_pairs(plan)
    assert len(calls) == 1
    assert cache_plan_key(plan) == lowered_mod.plan_key(plan)  # the communicator cache keys by the same rule


def test_lowered_plan_holds_messages_pairs_and_roles():
    plan = builtin("zb-v", 4, 8)
    low = lowered_plan(plan, 1)
    assert dict(low.messages) == {k: tuple(v) for k, v in plan_messages(plan).items()}
    assert low.pairs == tuple(sorted(plan_messages(plan)))
    assert low.my_pairs == tuple(p for p in low.pairs if 1 in p)
    assert (low.first_rank, low.loss_rank) == (0, 0)  # V placement: the last stage is back on device 0
    assert loss_rank(plan) == plan.stages[-1].device
    assert not low.forward_only and low.program.rank == 1


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-zb"])
def test_last_backward_is_each_stages_last_weight_gradient_action_by_the_kind_table(name):
    plan = builtin(name, 4, 8, 2 if name == "interleaved-zb" else None)
    grads = {k for k, r in RULES.items() if r.weight_grad}
    assert grads == {Kind.B, Kind.W}
    for rank in range(4):
        low = lowered_plan(plan, rank)
        want = {}
        for i, step in enumerate(low.program.steps):
            if step.action.kind in grads:
                want[step.action.stage] = i
        assert dict(low.last_backward) == want and set(want) == set(plan.stages_of(rank))
        for s, i in want.items():
            assert low.is_last_backward(i, low.program.steps[i].action)


@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_forward_programs_exist_for_any_microbatch_count(m):
    plan = builtin("zb-v", 4, 8)
    fwd = forward_plan(plan, m)
    assert fwd.num_microbatches == m and all(a.kind is Kind.F for row in fwd.schedule for a in row)
    assert sorted(a for row in fwd.schedule for a in row) == sorted(
        parse_schedule([[f"{s}F{mb}" for s in range(plan.num_stages) for mb in range(m)]])[0])
    check_runnable(fwd, nccl=True)
    low = lowered_plan(plan, 2).forward(m)
    assert low.forward_only and low.plan.num_microbatches == m and not low.last_backward
    assert all(msg.kind is MsgKind.ACT for msgs in low.messages.values() for msg in msgs)
    assert set(low.pairs) <= set(lowered_plan(plan, 2).pairs)  # warmed with the training plan's pairs
    assert lowered_plan(plan, 2).forward(m) is low


def test_forward_plan_of_the_plans_count_keeps_the_plans_order():
    plan = builtin("1f1b", 4, 6)
    fwd = forward_plan(plan)
    assert fwd.schedule == tuple(tuple(a for a in row if a.kind is Kind.F) for row in plan.schedule)
    assert forward_plan(plan, 6).schedule == fwd.schedule
    assert lowered_plan(fwd, 0).forward() is lowered_plan(fwd, 0)


def test_text_form_lists_compute_and_comm_in_posting_order():
    plan = builtin("1f1b", 2, 4)
    text = format_lowered(lowered_plan(plan, 0), warm=True)
    lines = [ln.strip() for ln in text.splitlines()]
    assert lines[:3] == ["rank 0:", "warm r0->r1", "warm r1->r0"]
    order = [lines.index(x) for x in ("0F0", "send ACT 0F0 to r1", "wait recv GRAD 1B0 from r1", "0B0",
                                      "wait send ACT 0F3 to r1")]
    assert order == sorted(order)
    assert "post recv GRAD 1B0 from r1" in lines[:lines.index("0F0")]  # prefetched before the first forward


# ----- the runner interface, checked where it is bound


class _Complete:
    def boundary_meta(self, stage):
        return TensorMeta(shape=(2,), dtype=torch.float32)

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):
        return inputs

    def backward(self, stage, mb, grad_output):
        return grad_output

    def backward_input(self, stage, mb, grad_output, *, last_backward=False):
        return grad_output

    def backward_weight(self, stage, mb, **kwargs):
        return None


class _OldForward(_Complete):
    def forward(self, stage, mb, inputs):  # the keywords the engine passes are missing
        return inputs


class _NoWeight:
    def boundary_meta(self, stage):
        return None

    def forward(self, stage, mb, inputs, **kwargs):
        return inputs

    def backward_input(self, stage, mb, grad_output):
        return grad_output


class _ShortBackward(_Complete):
    def backward(self, stage, mb):
        return None


def test_complete_runner_is_bound_and_last_backward_is_offered_where_accepted():
    binding = check_runner(_Complete(), set(stage_kinds()))  # shard kinds have optional methods of their own
    assert binding.takes_last_backward == {"backward_input", "backward_weight"}  # **kwargs accepts it too


def test_runner_missing_keywords_is_refused_with_one_message():
    with pytest.raises(RunnerInterfaceError) as err:
        check_runner(_OldForward(), {Kind.F, Kind.B})
    msg = str(err.value)
    assert "\n" not in msg
    assert "_OldForward" in msg and "forward(" in msg and "batch=" in msg and "forward_only=" in msg


def test_runner_missing_a_method_the_plan_needs_is_refused():
    check_runner(_NoWeight(), {Kind.F})  # an evaluation-only runner needs only forward
    with pytest.raises(RunnerInterfaceError, match=r"_NoWeight: has no method backward_weight\(\)"):
        check_runner(_NoWeight(), {Kind.F, Kind.I, Kind.W})
    with pytest.raises(RunnerInterfaceError, match=r"_ShortBackward: backward\(stage, mb\) cannot take 3 positional"):
        check_runner(_ShortBackward(), {Kind.F, Kind.B})


def test_executor_refuses_an_incomplete_runner_when_built_before_any_communication():
    plan = builtin("zb-h1", 2, 4)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RunnerInterfaceError, match="_NoWeight.*backward_weight"):
        PipelineExecutor(plan, _NoWeight(), rank=1)  # raises before touching torch.distributed
