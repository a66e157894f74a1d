"""The executor runs overlapped pairs (docs/formats.md, "Overlapped pairs"; issue 32 item 5).

Lowering (both halves' receives posted before the pair, the host ops of a pair as one unit),
the NCCL-rules replay of a pair, the runner check of the optional `pair` method, and, over gloo,
pairs on real tensors: the toy model without a `pair` method (halves one after the other) and the
phased toy MoE (executor/phased.py, testing/toy_moe.py) whose all-to-alls are asynchronous and
interleaved, PP 2 x EP 2 and PP 1 x EP 4, paired runs equal to the unpaired ones and to a
single-process reference at float64, rtol 1e-10.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from octopipe_plugin.actions import Action, B, F, I, Kind, W
from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.executor import build_program, check_runnable
from octopipe_plugin.executor.interface import RunnerInterfaceError, check_runner
from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.executor.nccl_rules import check_nccl_rules, replay
from octopipe_plugin.executor.posting import OpKind, format_ops, rank_ops
from octopipe_plugin.formats import plan_to_dict
from octopipe_plugin.schedules import generators
from octopipe_plugin.simulator.pairs import overlap_order, overlap_ms
from octopipe_plugin.testing.checks import check_plans_worker
from octopipe_plugin.testing.pair_plans import greedy_pairs, random_pairs
from octopipe_plugin.testing.plans import make_plan, sample_schedule
from octopipe_plugin.testing.toy import ToySpec
from octopipe_plugin.testing.toy_moe import MoESpec, check_moe_worker


def v_plan(m: int = 4, layers: int = 4):
    """DualPipeV's order on 2 devices (stages 0, 3 on device 0; 1, 2 on device 1), without its pairs."""
    sched = generators.dualpipev([0, 1, 1, 0], 2, m)
    cuts = [round(i * layers / 4) for i in range(5)]
    return make_plan(stage_devices=[0, 1, 1, 0], bounds=list(zip(cuts[:-1], cuts[1:])), num_devices=2,
                     num_microbatches=m, schedule=tuple(tuple(r) for r in sched))


def one_device_plan(layers: int = 4):
    """One stage on one device: F0 F1 B0 F2 B1 B2 (F1+B0 and F2+B1 can pair)."""
    row = (F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), B(0, 2))
    return make_plan(stage_devices=[0], bounds=[(0, layers)], num_devices=1, num_microbatches=3, schedule=(row,))


def split_backwards(plan):
    """`plan` with every B run as I then W at once (the same order, zero-bubble style backwards)."""
    def parts(a):
        return (I(a.stage, a.microbatch), W(a.stage, a.microbatch)) if a.kind is Kind.B else (a,)
    return replace(plan, schedule=tuple(tuple(x for a in row for x in parts(a)) for row in plan.schedule))


def two_stage_plan(ahead: bool = False):
    """1F1B on 2 devices: F0 F1 B0 F2 B1 B2 on device 0, F0 B0 F1 B1 F2 B2 on device 1 (`ahead`: as device 0)."""
    ahead_row = lambda s: (F(s, 0), F(s, 1), B(s, 0), F(s, 2), B(s, 1), B(s, 2))  # noqa: E731
    last = ahead_row(1) if ahead else (F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2))
    return make_plan(stage_devices=[0, 1], bounds=[(0, 2), (2, 4)], num_devices=2, num_microbatches=3,
                     schedule=(ahead_row(0), last))


# ----- the pair rule and lowering


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 5)), max_size=8),
       st.lists(st.tuples(st.booleans(), st.floats(0, 5)), max_size=8))
def test_the_order_the_runtime_follows_gives_the_priced_time(first, second):
    """Replaying overlap_order's start order (each phase at max(its half's previous end, its resource free)) ends
    at the time overlap_ms prices: the phased runtime and the stand-ins interleave as the plan was priced."""
    order, makespan = overlap_order(first, second)
    assert sorted(order) == [0] * len(first) + [1] * len(second)
    seqs, pos, ready, free = (first, second), [0, 0], [0.0, 0.0], {False: 0.0, True: 0.0}
    for k in order:
        comm, ms = seqs[k][pos[k]]
        free[comm] = ready[k] = max(ready[k], free[comm]) + ms
        pos[k] += 1
    assert max(ready, default=0.0) == pytest.approx(overlap_ms(tuple(first), tuple(second)), abs=1e-9)
    assert makespan == overlap_ms(tuple(first), tuple(second))


def test_a_pair_posts_both_receives_before_it_starts():
    plan = replace(two_stage_plan(), pairs=((F(0, 2), B(0, 1)),))  # device 0: ... F2+B1: B1's gradient from r1
    check_runnable(plan)
    prog = build_program(plan, 0, prefetch=0)
    assert prog.pair_starts == frozenset({3})
    unpaired = build_program(replace(plan, pairs=()), 0, prefetch=0)
    grads = prog.recv_order[1]
    b1 = grads.index(prog.steps[4].recv)
    assert dict(prog.steps[3].post_upto)[1] == b1 + 1  # the first half posts the second's gradient
    assert dict(unpaired.steps[3].post_upto).get(1, 0) <= b1
    ops = rank_ops(prog)
    kinds = [(op.kind, op.step) for op in ops if op.step in (3, 4) and op.kind is not OpKind.POST_RECV]
    # the second half's wait, both computes, then F2's send, which belongs to the pair's last step
    assert kinds == [(OpKind.WAIT_RECV, 4), (OpKind.COMPUTE, 3), (OpKind.COMPUTE, 4), (OpKind.SEND, 4)]
    assert "0F2+" in format_ops(ops, 0)
    # unpaired plans lower exactly as before
    assert [op for op in rank_ops(unpaired) if op.overlapped] == []


def test_a_pair_that_waits_on_itself_is_refused_by_the_simulator():
    plan = two_stage_plan(ahead=True)
    both = replace(plan, pairs=((F(0, 1), B(0, 0)), (F(1, 1), B(1, 0))))  # r0 waits r1's B0, r1 waits r0's F1
    with pytest.raises(DeadlockError):
        check_runnable(both)
    check_runnable(replace(plan, pairs=((F(1, 1), B(1, 0)),)))  # the last stage alone: fine


@pytest.mark.parametrize("host_waits", [True, False])
def test_nccl_replay_runs_paired_plans(host_waits):
    """Per-direction communicators (what the executor makes on NCCL), host waits or CUDA's stream waits."""
    pair_groups = True
    plan = greedy_pairs(v_plan(m=6))
    assert len(plan.pairs) >= 4
    check_nccl_rules(plan, pair_groups=pair_groups, host_waits=host_waits, eager=True)
    for seed in range(6):
        rng = random.Random(seed)
        base = make_plan(stage_devices=[0, 1, 2, 0], bounds=[(0, 1), (1, 2), (2, 3), (3, 4)], num_devices=3,
                         num_microbatches=4, schedule=sample_schedule([0, 1, 2, 0], 3, 4, rng))
        paired = random_pairs(base, rng, prob=0.7)
        try:
            check_runnable(paired)
        except DeadlockError:
            continue
        check_nccl_rules(paired, pair_groups=pair_groups, host_waits=host_waits, eager=True)


def test_nccl_replay_waits_for_both_halves_inputs():
    """A pair's first half needs its partner's input on the device too (host_waits=False)."""
    plan = replace(two_stage_plan(), pairs=((F(0, 2), B(0, 1)),))
    progs = [build_program(plan, r) for r in range(2)]
    assert replay(progs, host_waits=False).ok
    assert replay(progs, host_waits=True).ok


class _Stages:
    def boundary_meta(self, stage):
        return None

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):
        return None

    def backward(self, stage, mb, grad_output):
        return None


class _Paired(_Stages):
    def pair(self, first, first_input, second, second_input, *, batch=None, last_backward=False):
        return None, None


class _BadPair(_Stages):
    def pair(self, first, second):
        return None, None


def test_runner_check_of_the_optional_pair_method():
    kinds = {Kind.F, Kind.B}
    assert not check_runner(_Stages(), kinds, pairs=True).runs_pairs  # halves one after the other
    got = check_runner(_Paired(), kinds, pairs=True)
    assert got.runs_pairs and "pair" in got.takes_last_backward
    assert not check_runner(_Paired(), kinds, pairs=False).runs_pairs  # no pair on this rank: never called
    with pytest.raises(RunnerInterfaceError, match="pair"):
        check_runner(_BadPair(), kinds, pairs=True)


# ----- over gloo


TOY = ToySpec(layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_paired_plans_without_a_pair_method_match_the_reference():
    """TorchStages has no `pair`: each pair runs half after half, after both inputs are in; loss and every gradient
    equal the single-process reference (rtol 1e-10, testing/checks.py)."""
    docs = []
    for m in (4, 6):
        plan = greedy_pairs(v_plan(m=m, layers=len(TOY.layers)))
        assert plan.pairs
        docs.append(plan_to_dict(plan))
    rng = random.Random(3)
    plan = make_plan(stage_devices=[0, 1, 0, 1], bounds=[(0, 2), (2, 4), (4, 6), (6, 8)], num_devices=2,
                     num_microbatches=5, schedule=sample_schedule([0, 1, 0, 1], 2, 5, rng, split_prob=0.5))
    docs.append(plan_to_dict(greedy_pairs(plan, rng=rng)))
    spawn(check_plans_worker, 2, docs, TOY)


MOE = MoESpec(hidden=4, tokens=8, layers=4)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_moe_pairs_overlap_all_to_alls_and_equal_the_unpaired_run():
    """PP 2 x EP 2 (two pipeline replicas of a V plan, same-device ranks one EP group) and PP 1 x EP 4 (one device,
    pairs of one stage's F and B): the paired run's losses and every gradient equal the unpaired run's and the
    single-process reference's (all experts in one process), rtol 1e-10 at float64; every pair went through
    PhasedStages.pair, its halves over one span, with all-to-alls in flight while the other half computed."""
    v = v_plan(m=4, layers=MOE.layers)
    paired = greedy_pairs(v)
    split_paired = greedy_pairs(split_backwards(v))  # I second halves (W after them, alone)
    assert paired.pairs and any(b.kind is Kind.I for _, b in split_paired.pairs)
    one = one_device_plan(MOE.layers)
    one_paired = replace(one, pairs=((F(0, 1), B(0, 0)), (F(0, 2), B(0, 1))))
    docs = [plan_to_dict(p) for p in (v, paired, split_paired, one, one_paired)]
    for d, label in zip(docs, ("V", "V paired", "V split paired", "1 device", "1 device paired")):
        d["meta"] = {"label": label}
    spawn(check_moe_worker, 4, docs, MOE)
