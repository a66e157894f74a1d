"""Overlapped pairs in the simulator: the overlap rule against hand-computed times, the pair semantics against a
hand-timed schedule, phases in the model format, and the refusals (docs/formats.md, "Overlapped pairs")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from octopipe_plugin.actions import Action, Kind, PAIR_SEP, format_schedule, parse_entry, parse_paired
from octopipe_plugin.errors import DeadlockError, FormatError, PlanError
from octopipe_plugin.formats.cluster import Cluster, Link
from octopipe_plugin.formats.model import Layer, Model, Phase, model_from_dict, model_to_dict
from octopipe_plugin.formats.plan import Plan, Stage, plan_from_dict, plan_to_dict, validate_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.pairs import hidden_ms, overlap_ms, stage_phases

C, M = False, True  # a phase on the device's compute, on the link


def moe_layer(c=1.0, m=1.0, w=0.0, act=10) -> Layer:
    """F and I: compute c, comm m, compute c, comm m."""
    ph = (Phase(name="a", resource="compute", fwd_ms=c, bwd_ms=c), Phase(name="d", resource="comm", fwd_ms=m, bwd_ms=m),
          Phase(name="e", resource="compute", fwd_ms=c, bwd_ms=c), Phase(name="x", resource="comm", fwd_ms=m, bwd_ms=m))
    return Layer(name="moe", kind="moe", fwd_ms=2 * (c + m), bwd_ms=2 * (c + m), wgrad_ms=w, state_bytes=0,
                 activation_bytes=act, output_bytes=0, phases=ph)


def free_cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_per_s=1e6, latency_us=0.0)
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=link, inter_node=link)


def plan_of(rows, stages, m) -> Plan:
    sched, pairs = parse_paired(rows)
    plan = Plan(model="m", num_devices=len(rows), num_microbatches=m, stages=stages, schedule=sched, pairs=pairs)
    validate_plan(plan)
    return plan


def test_formats_worked_example():
    f = ((C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0))
    i = tuple(reversed(f))
    assert overlap_ms(f, i) == 4.0
    assert overlap_ms(f, ()) == 4.0 and overlap_ms((), i) == 4.0


@pytest.mark.parametrize("a,b,want", [
    (((C, 2.0),), ((C, 3.0),), 5.0),  # compute only: nothing overlaps
    (((M, 2.0),), ((M, 3.0),), 5.0),  # one link: nothing overlaps
    (((C, 2.0),), ((M, 3.0),), 3.0),  # one computes while the other communicates
    (((C, 1.0), (M, 4.0)), ((M, 1.0), (C, 1.0)), 5.0),
    # both want the device at 0: the forward half first (tie), the backward's comm then waits for its compute
    (((C, 2.0), (M, 1.0)), ((C, 1.0), (M, 2.0)), 5.0),
])
def test_overlap_rule_by_hand(a, b, want):
    assert overlap_ms(a, b) == pytest.approx(want)


seqs = st.lists(st.tuples(st.booleans(), st.floats(0.0, 10.0)), max_size=8).map(tuple)


@settings(max_examples=200, deadline=None)
@given(seqs, seqs)
def test_overlap_is_bounded_by_each_resource_and_by_the_sum(a, b):
    got = overlap_ms(a, b)
    total = sum(ms for _, ms in a) + sum(ms for _, ms in b)
    compute = sum(ms for comm, ms in a + b if not comm)
    link = sum(ms for comm, ms in a + b if comm)
    assert max(compute, link, sum(ms for _, ms in a), sum(ms for _, ms in b)) - 1e-9 <= got <= total + 1e-9


def test_stage_phases_merge_and_reverse():
    model = Model(name="m", layers=(moe_layer(w=0.5), moe_layer(w=0.5)))
    ph = stage_phases(model, (Stage(start=0, end=2, device=0),))
    assert ph.fwd[0] == ((C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0))
    assert ph.bwd[0] == ((M, 1.0), (C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0), (C, 1.0), (M, 1.0), (C, 1.0))
    # B: each layer's W right after its reversed phases
    assert ph.fused[0] == ((M, 1.0), (C, 1.0), (M, 1.0), (C, 1.5), (M, 1.0), (C, 1.0), (M, 1.0), (C, 1.5))
    plain = Model(name="p", layers=(Layer(name="d", kind="dense", fwd_ms=1, bwd_ms=1, wgrad_ms=1, state_bytes=0,
                                          activation_bytes=0, output_bytes=0),))
    assert stage_phases(plain, (Stage(start=0, end=1, device=0),)) is None


def test_pair_semantics_one_device():
    """Hand timeline: 0F0 [0,4], then 0F1+0B0 (4 + 4 - hidden 4) [4,8], then 0B1 [8,12]."""
    model = Model(name="m", layers=(moe_layer(),))
    plan = plan_of([["0F0", "0F1+0B0", "0B1"]], (Stage(start=0, end=1, device=0),), 2)
    res = simulate(model, free_cluster(1), plan)
    assert res.step_time_ms == pytest.approx(12.0)
    assert [(str(a), s, e) for a, s, e in res.timeline[0]] == [
        ("0F0", 0.0, 4.0), ("0F1", 4.0, 8.0), ("0B0", 4.0, 8.0), ("0B1", 8.0, 12.0)]
    assert res.peak_activation_bytes == [20]  # the pair's F counted before its B frees
    unpaired = Plan(model="m", num_devices=1, num_microbatches=2, stages=plan.stages, schedule=plan.schedule)
    assert simulate(model, free_cluster(1), unpaired).step_time_ms == pytest.approx(16.0)


def test_pair_waits_for_both_inputs():
    """Two devices: device 1's pair 1F1+1B0 waits for 0F1's activation, which comes after 0F1 [4, 8]."""
    model = Model(name="m", layers=(moe_layer(), moe_layer()))
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1))
    plan = plan_of([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1+1B0", "1B1"]], stages, 2)
    res = simulate(model, free_cluster(2), plan)
    t = {str(a): (s, e) for row in res.timeline for a, s, e in row}
    assert t["1F0"] == (4.0, 8.0)
    assert t["1F1"] == (8.0, 12.0) and t["1B0"] == (8.0, 12.0)  # 0F1 ends at 8; the pair hides 4
    assert t["0B0"] == (12.0, 16.0) and t["1B1"] == (12.0, 16.0)
    assert t["0B1"] == (16.0, 20.0)
    assert res.step_time_ms == pytest.approx(20.0)
    assert res.critical_path[-1] == (0, Action(0, Kind.B, 1))


def test_pairs_without_phases_cost_their_two_actions():
    plain = Layer(name="d", kind="dense", fwd_ms=2, bwd_ms=3, wgrad_ms=0, state_bytes=0, activation_bytes=0,
                  output_bytes=0)
    model = Model(name="m", layers=(plain,))
    plan = plan_of([["0F0", "0F1+0B0", "0B1"]], (Stage(start=0, end=1, device=0),), 2)
    assert simulate(model, free_cluster(1), plan).step_time_ms == pytest.approx(10.0)
    assert hidden_ms(None, Action(0, Kind.F, 1), Action(0, Kind.B, 0)) == 0.0


def test_pair_deadlock_is_named():
    """A pair whose second half waits for an action listed after the pair can never start: named as a deadlock."""
    model = Model(name="m", layers=(moe_layer(), moe_layer()))
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=0))
    # 0F1 is paired with 1B0 on device 0, and 1B0 waits for 1F0, which comes after the pair: a deadlock
    plan = plan_of([["0F0", "0F1+1B0", "1F0", "0B0", "1F1", "1B1", "0B1"]], stages, 2)
    with pytest.raises(DeadlockError, match="stuck at 0F1"):
        simulate(model, free_cluster(1), plan)


def test_plan_file_round_trip_and_refusals():
    doc = {"format": "octopipe-plan/1", "num_devices": 1, "num_microbatches": 2,
           "stages": [{"layers": [0, 1], "device": 0}], "schedule": [["0F0", "0F1+0B0", "0B1"]]}
    plan = plan_from_dict(doc)
    assert plan.pairs == ((Action(0, Kind.F, 1), Action(0, Kind.B, 0)),)
    assert plan_to_dict(plan)["schedule"] == doc["schedule"]
    assert format_schedule(plan.schedule) == [["0F0", "0F1", "0B0", "0B1"]]
    for bad, why in ((["0F0+0B0", "0F1", "0B1"], "both halves are micro-batch 0"),
                     (["0B0+0F1", "0F0", "0B1"], "followed by"),
                     (["0F0", "0F1+0B0+0B1"], "two halves")):
        with pytest.raises(FormatError, match=why):
            plan_from_dict({**doc, "schedule": [bad]})
    assert parse_entry("3F12+5B7") == (Action(3, Kind.F, 12), Action(5, Kind.B, 7))
    assert PAIR_SEP == "+"


def test_pairs_refused_in_code():
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1))
    sched = ((Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)),
             (Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)))
    base = dict(model="m", num_devices=2, num_microbatches=2, stages=stages, schedule=sched)
    with pytest.raises(PlanError, match="devices 0 and 1"):
        validate_plan(Plan(**base, pairs=((Action(0, Kind.F, 1), Action(1, Kind.B, 0)),)))
    with pytest.raises(PlanError, match="right after the first"):
        validate_plan(Plan(**base, pairs=((Action(0, Kind.F, 0), Action(0, Kind.B, 1)),)))


def test_model_phases_read_write_and_refuse_a_wrong_sum():
    model = Model(name="m", layers=(moe_layer(w=0.5),))
    doc = model_to_dict(model)
    assert model_from_dict(doc) == model
    doc["layers"][0]["phases"][0]["fwd_ms"] = 3.0
    with pytest.raises(FormatError, match=r"phases.*add up to the layer's fwd_ms"):
        model_from_dict(doc)
    doc["layers"][0]["phases"][0]["fwd_ms"] = 1.0
    doc["layers"][0]["phases"][0]["resource"] = "nvlink"
    with pytest.raises(FormatError, match="'compute' or 'comm'"):
        model_from_dict(doc)
    assert moe_layer().scaled(2.0).phases[1].fwd_ms == 2.0



def test_split_plan_with_pairs_checks_without_a_model():
    """check_runnable simulates with unit costs and no model: a split plan with pairs is checked too."""
    from octopipe_plugin.executor.validate import check_runnable
    from octopipe_plugin.testing.split_plans import head_split_plan

    layers = (Layer(name="e", kind="embedding", fwd_ms=0.1, bwd_ms=0.0, wgrad_ms=0.1, state_bytes=0,
                    activation_bytes=0, output_bytes=8),) + tuple(moe_layer() for _ in range(3)) + (
        Layer(name="h", kind="lm_head", fwd_ms=6, bwd_ms=3, wgrad_ms=3, state_bytes=0, activation_bytes=0,
              output_bytes=4),)
    model = Model(name="m", layers=layers)
    plan = head_split_plan(model, free_cluster(2), 4, schedule="dualpipev")
    assert plan.pairs and plan.splits
    check_runnable(plan)
    assert simulate(model, free_cluster(2), plan).step_time_ms > 0
