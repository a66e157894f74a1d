"""The built-ins with overlapped pairs: DualPipeV's F&B steps and Megatron's combined 1F1B.

Both generators return an `actions.PairedSchedule`; `build_plan` carries its pairs into
`Plan.pairs`. Checked here: the pairs are valid (the plan check accepts them; each is an F and
a B/I of two micro-batches adjacent on one device), DualPipeV's order is the one it had before
pairs existed (a hand-written case; tests/schedules/test_v_schedules_torch.py holds order and
pairs to torch's ScheduleDualPipeV), combined 1F1B's order and pairs are megatron-core's
(its own warm-up count with `overlap_moe_expert_parallel_comm`, plus hand-written cases), the
pricing (no communication phases: every pair takes exactly its two actions' time; with
all-to-all phases the step drops), and that every plan runs without deadlock.

Pairs also synchronise: a pair starts once both halves' inputs are there and both end
together (the simulator's semantics, DeepSeek's `_forward_backward_chunk` waits for both
receives likewise), so without phases a paired DualPipeV step can be longer than the same
order unpaired even though each pair costs F + B; see test_without_phases_a_pair_costs_its_two_actions.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_oracle import communicator, megatron_order
from octopipe_plugin.actions import Action, Kind, PairedSchedule, format_schedule, parse_paired
from octopipe_plugin.errors import PlanError
from octopipe_plugin.executor.validate import check_runnable
from octopipe_plugin.formats import Cluster, Layer, Link, Model, plan_from_dict, plan_to_dict, validate_plan
from octopipe_plugin.formats.model import Phase
from octopipe_plugin.schedules.generators import combined_1f1b, dualpipev, interleaved_1f1b, megatron_group_size
from octopipe_plugin.schedules.placement import looped, place, v_shape
from octopipe_plugin.schedules.registry import SCHEDULES, build_plan, get_schedule
from octopipe_plugin.simulator import simulate

PAIRED = ("dualpipev", "combined-1f1b")
CASES = [("dualpipev", p, 2, m) for p in (1, 2, 3, 4) for m in (2 * p, 2 * p + 1, 3 * p + 2)] + \
        [("combined-1f1b", p, v, m) for p, v in ((1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (4, 3), (2, 4))
         for m in sorted({p, p + 1, 2 * p, 3 * p + 1})]


def _model(n: int, phases: bool = False, name: str = "pairs") -> Model:
    """n MoE-like layers; with `phases`, each F and I is 40% attention, 20% dispatch, 20% experts, 20% combine."""
    ph = ()
    if phases:
        ph = (Phase(name="attention", resource="compute", fwd_ms=0.4, bwd_ms=0.8),
              Phase(name="dispatch", resource="comm", fwd_ms=0.2, bwd_ms=0.4),
              Phase(name="experts", resource="compute", fwd_ms=0.2, bwd_ms=0.4),
              Phase(name="combine", resource="comm", fwd_ms=0.2, bwd_ms=0.4))
    return Model(name=name, layers=tuple(
        Layer(name=f"l{i}", kind="moe", fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=0.5, state_bytes=1 << 20,
              activation_bytes=1 << 20, output_bytes=1 << 10, phases=ph) for i in range(n)))


def _cluster(p: int) -> Cluster:
    link = Link(bandwidth_gb_per_s=100.0, latency_us=5.0)
    return Cluster(num_devices=p, devices_per_node=8, memory_bytes=1 << 40, intra_node=link, inter_node=link)


def _plan(name, p, v, m, model=None):
    return build_plan(model or _model(p * v), name, p, m, stages_per_device=v)


def _flat(plan) -> list[list[str]]:
    return [[str(a) for a in row] for row in plan.schedule]


# --- validity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, v, m", CASES)
def test_pairs_are_valid_and_the_plan_runs(name, p, v, m):
    plan = _plan(name, p, v, m)
    validate_plan(plan, p * v)
    where = {a: (d, i) for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}
    for first, second in plan.pairs:
        assert first.kind is Kind.F and second.kind in (Kind.B, Kind.I)
        assert first.microbatch != second.microbatch
        (d1, i1), (d2, i2) = where[first], where[second]
        assert d1 == d2 and i2 == i1 + 1
    assert len({a for pr in plan.pairs for a in pr}) == 2 * len(plan.pairs)
    check_runnable(plan)
    # the plan file keeps them: `0F3+3B1` entries, read back to the same pairs
    again = plan_from_dict(plan_to_dict(plan), num_layers=p * v)
    assert again.pairs == plan.pairs and again.schedule == plan.schedule


@pytest.mark.parametrize("name", PAIRED)
def test_generators_return_paired_schedules_and_build_plan_keeps_the_pairs(name):
    spec = get_schedule(name)
    p, v = 3, 2
    sched = spec.generate(place(spec.placement, p, v), p, 4 * p)
    assert isinstance(sched, PairedSchedule) and sched.pairs and spec.overlapped_pairs
    plan = build_plan(_model(p * v), name, p, 4 * p, stages_per_device=v)
    assert plan.pairs == sched.pairs
    assert type(plan.schedule) is tuple and plan.schedule == tuple(sched)  # the plain rows; pairs beside them


def test_the_other_built_ins_have_no_pairs():
    for name, spec in SCHEDULES.items():
        if name in PAIRED:
            continue
        v = spec.stages_for(None)
        assert not build_plan(_model(4 * v), name, 4, 8, stages_per_device=v).pairs, name
        assert not spec.overlapped_pairs


# --- DualPipeV ------------------------------------------------------------------------------------------

# The generator's lists for p = 2, m = 4 before pairs existed (commit 98f46d6), and the same lists with the
# overlapped steps written as pairs: the main phase's (F0 & B1), (F1 & B0), phase 5's (F1 & B0); the last
# rank's first main step (1F2, 2B0) runs apart, as in DeepSeek's and torch's DualPipeV.
DUALPIPEV_2_4_BEFORE = [
    ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "0F3", "3B1", "3F2", "0B0", "3B2", "3F3", "0B1", "3B3",
     "0I2", "0W2", "0I3", "0W3"],
    ["1F0", "2F0", "1F1", "2F1", "1F2", "2B0", "2F2", "1B0", "1F3", "2B1", "2F3", "1B1", "2B2", "1B2", "2I3", "1I3",
     "2W3", "1W3"],
]
DUALPIPEV_2_4_PAIRED = [
    ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "0F3+3B1", "3F2+0B0", "3B2", "3F3+0B1", "3B3", "0I2", "0W2",
     "0I3", "0W3"],
    ["1F0", "2F0", "1F1", "2F1", "1F2", "2B0", "2F2+1B0", "1F3+2B1", "2F3+1B1", "2B2", "1B2", "2I3", "1I3", "2W3",
     "1W3"],
]


def test_dualpipev_order_is_unchanged_and_its_steps_are_pairs():
    plan = _plan("dualpipev", 2, 2, 4)
    assert _flat(plan) == DUALPIPEV_2_4_BEFORE
    assert format_schedule(plan.schedule, plan.pairs) == DUALPIPEV_2_4_PAIRED
    schedule, pairs = parse_paired(DUALPIPEV_2_4_PAIRED)
    assert schedule == plan.schedule and pairs == plan.pairs


def test_dualpipev_pair_count():
    """Per rank r: 2(m - 2p + r + 1) main-phase pairs (one fewer on the last rank) and p - r - 1 in phase 5."""
    for p in (1, 2, 3, 5):
        for m in (2 * p, 3 * p + 1):
            sched = dualpipev(v_shape(p, 2), p, m)
            want = sum(2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - r - 1) for r in range(p))
            assert len(sched.pairs) == want, (p, m)


# --- pricing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, v, m", [("dualpipev", 2, 2, 8), ("dualpipev", 4, 2, 8), ("combined-1f1b", 4, 2, 8),
                                           ("combined-1f1b", 2, 1, 6), ("combined-1f1b", 1, 1, 4)])
def test_without_phases_a_pair_costs_its_two_actions(name, p, v, m):
    """No communication phases: each pair spans exactly F + B of its halves, each device is busy exactly as long
    as with the same order unpaired, and the peaks are the same; the order unpaired is the old plan."""
    model, cl = _model(p * v), _cluster(p)
    plan = _plan(name, p, v, m, model)
    paired = simulate(model, cl, plan)
    alone = simulate(model, cl, replace(plan, pairs=()))
    dur = {a: end - start for row in alone.timeline for a, start, end in row}
    span = {a: (start, end) for row in paired.timeline for a, start, end in row}
    for first, second in plan.pairs:
        assert span[first] == span[second]
        assert span[first][1] - span[first][0] == pytest.approx(dur[first] + dur[second], abs=1e-9)
    assert paired.busy_ms == pytest.approx(alone.busy_ms, abs=1e-9)
    assert paired.peak_memory_bytes == alone.peak_memory_bytes
    # a pair waits for both halves' inputs and sends both outputs at its end: never faster without phases here
    assert paired.step_time_ms >= alone.step_time_ms - 1e-9


def test_without_phases_combined_1f1b_steps_as_its_order_unpaired():
    """Megatron's extra warm-up forward makes each steady-state F's input arrive before its B's: with free links
    pairing costs combined 1F1B nothing where nothing communicates."""
    free = Link(bandwidth_gb_per_s=1e6, latency_us=0.0)
    for p, v, m in ((2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (4, 2, 16), (3, 3, 6)):
        model = _model(p * v)
        cl = Cluster(num_devices=p, devices_per_node=8, memory_bytes=1 << 40, intra_node=free, inter_node=free)
        plan = _plan("combined-1f1b", p, v, m, model)
        assert simulate(model, cl, plan).step_time_ms == pytest.approx(
            simulate(model, cl, replace(plan, pairs=())).step_time_ms, rel=1e-9), (p, v, m)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_with_all_to_all_phases_the_paired_steps_drop(p, m):
    """Dispatch/combine phases on the link: each pair hides one half's all-to-all behind the other's compute."""
    model, cl = _model(4 * p, phases=True), _cluster(p)
    plain = _model(4 * p)
    for name, v in (("dualpipev", 2), ("combined-1f1b", 2), ("combined-1f1b", 1)):
        plan = build_plan(model, name, p, m, stages_per_device=v)
        paired = simulate(model, cl, plan).step_time_ms
        alone = simulate(model, cl, replace(plan, pairs=())).step_time_ms
        assert alone == pytest.approx(simulate(plain, cl, build_plan(plain, name, p, m, stages_per_device=v),
                                               detail=False).step_time_ms, rel=0.05)  # phases alone change nothing
        assert paired < 0.9 * alone, (name, v, paired, alone)
    # combined 1F1B against the interleaved 1F1B it replaces, same v: the overlap pays for the extra warm-up
    inter = simulate(model, cl, build_plan(model, "interleaved-1f1b", p, m, stages_per_device=2)).step_time_ms
    comb = simulate(model, cl, build_plan(model, "combined-1f1b", p, m, stages_per_device=2)).step_time_ms
    assert comb < 0.9 * inter


# --- Megatron's combined 1F1B ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcore():
    return pytest.importorskip("megatron.core.pipeline_parallel.schedules")


@pytest.mark.framework
@pytest.mark.parametrize("p, v, m", [(2, 1, 2), (2, 1, 5), (4, 1, 8), (2, 2, 2), (2, 2, 5), (4, 2, 8), (4, 2, 16),
                                     (4, 3, 12), (4, 4, 4), (3, 2, 7), (4, 2, 10), (4, 2, 6), (8, 2, 8), (2, 5, 9)])
def test_combined_1f1b_is_megatrons_order_with_its_merged_steps_as_pairs(mcore, p, v, m):
    g = megatron_group_size(p, m)
    ours = combined_1f1b(looped(p, v), p, m)
    entries = format_schedule(ours, ours.pairs)
    for r in range(p):
        order, pairs = megatron_order(mcore, p, r, v, m, g, overlap=True)
        assert list(ours[r]) == order, f"rank {r}"
        assert [e for e in entries[r] if "+" in e] == [f"{a}+{b}" for a, b in pairs], f"rank {r}"


@pytest.mark.framework
def test_megatron_adds_one_warm_up_forward_with_the_flag(mcore):
    """The claim the generator rests on: the same schedule, one more warm-up forward (capped at v*m)."""
    for p, v, m in ((4, 2, 8), (4, 1, 4), (2, 3, 6), (4, 2, 4)):
        for r in range(p):
            comm = communicator(p, r, v)
            g = megatron_group_size(p, m)
            plain = mcore.get_pp_rank_microbatches(m, v, g, p2p_communicator=comm)[2]
            flag = mcore.get_pp_rank_microbatches(m, v, g, overlap_moe_expert_parallel_comm=True,
                                                  p2p_communicator=comm)[2]
            assert flag == min(plain + 1, v * m)


# Hand-written (Megatron's loops followed by hand): p = 2, v = 2, m = 4, group size 2. Rank 0 warms up with
# 2(p-r-1) + (v-1)g + 1 = 5 forwards, rank 1 with 3; then F(k + warm-up) & B(k) merged; then the rest of B.
COMBINED_2_2_4 = [
    ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3+2B0", "2F2+2B1", "2F3+0B0", "0B1", "2B2", "2B3", "0B2", "0B3"],
    ["1F0", "1F1", "3F0", "3F1+3B0", "1F2+3B1", "1F3+1B0", "3F2+1B1", "3F3+3B2", "3B3", "1B2", "1B3"],
]
# One device: combined_1f1b_schedule_for_no_pipelining, F0 alone, F(i+1) with B(i), B(m-1) alone.
COMBINED_1_1_4 = [["0F0", "0F1+0B0", "0F2+0B1", "0F3+0B2", "0B3"]]
# v = 1 on 3 devices (megatron-core's interleaved function, one chunk): warm-up 2(p-r-1) + 1, capped at m.
COMBINED_3_1_4 = [
    ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"],
    ["1F0", "1F1", "1F2", "1F3+1B0", "1B1", "1B2", "1B3"],
    ["2F0", "2F1+2B0", "2F2+2B1", "2F3+2B2", "2B3"],
]


@pytest.mark.parametrize("p, v, m, want", [(2, 2, 4, COMBINED_2_2_4), (1, 1, 4, COMBINED_1_1_4),
                                           (3, 1, 4, COMBINED_3_1_4)])
def test_combined_1f1b_hand_written(p, v, m, want):
    ours = combined_1f1b(looped(p, v), p, m)
    assert format_schedule(ours, ours.pairs) == want


def _forwards_before_first_b(row) -> int:
    return next((i for i, a in enumerate(row) if a.kind is Kind.B), len(row))


def test_combined_1f1b_is_interleaved_1f1b_with_one_more_warm_up_forward():
    """Per device, the same forwards and the same backwards as Megatron's interleaved 1F1B, each in the same order,
    but one more warm-up forward (Megatron's warm-up W = 2(p-r-1) + (v-1)g becomes W + 1, capped at v*m): each
    steady-state B comes one forward later, so flattened the orders differ unless everything is warm-up. With
    v = 1 (megatron-core's interleaved function with one chunk) the warm-up is 2(p-r-1) + 1, not 1F1B's p-r-1."""
    for p, v, m in ((4, 2, 8), (4, 2, 16), (2, 3, 6), (8, 2, 8), (4, 1, 4), (4, 1, 9), (2, 4, 2)):
        comb, inter = combined_1f1b(looped(p, v), p, m), interleaved_1f1b(looped(p, v), p, m)
        g = megatron_group_size(p, m)
        total = v * m
        for r in range(p):
            c, i = list(comb[r]), list(inter[r])
            w = 2 * (p - r - 1) + (v - 1) * g + 1
            # the warm-up forwards, and the F of the first pair when there is a steady state
            assert _forwards_before_first_b(c) == min(w, total) + (w < total)
            fs = [a for a in c if a.kind is Kind.F]
            bs = [a for a in c if a.kind is Kind.B]
            if v == 1:
                assert fs == [Action(r, Kind.F, k) for k in range(m)] and bs == [Action(r, Kind.B, k) for k in range(m)]
                continue
            assert fs == [a for a in i if a.kind is Kind.F] and bs == [a for a in i if a.kind is Kind.B]
            assert _forwards_before_first_b(i) == min(w - 1, total) + (w - 1 < total)
            assert (c == i) == (w - 1 >= total)


@pytest.mark.parametrize("p, v, m, why", [
    (4, 2, 3, "at least 4 micro-batches"),
    (4, 1, 3, "at least 4 micro-batches"),
    (1, 2, 4, "no pipeline schedule with one device"),
])
def test_combined_1f1b_refusals(p, v, m, why):
    with pytest.raises(PlanError, match=why):
        build_plan(_model(p * v), "combined-1f1b", p, m, stages_per_device=v)


def test_combined_1f1b_refuses_the_wrong_placement():
    with pytest.raises(PlanError, match="stage->device map"):
        combined_1f1b(v_shape(2, 2), 2, 4)
