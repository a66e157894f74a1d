"""The tuner's pairing: the list scheduler's pairs (Python and compiled alike, replayed exactly by the simulator),
tuned plans with pairs where the model communicates, and unchanged plans where it does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe_plugin.formats import validate_plan
from octopipe_plugin.formats.model import Layer, Model, Phase
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import listsched_kernel, tune
from octopipe_plugin.tuner.evaluate import Evaluator
from octopipe_plugin.tuner.layout import Layout
from octopipe_plugin.tuner.listsched import Pairing, Policy, Split, build_schedule
from octopipe_plugin.tuner.pairing import adjacent_pairs

from tuner_helpers import cluster, hetero_model


def moe_model(n: int = 8) -> Model:
    ph = (Phase(name="a", resource="compute", fwd_ms=1, bwd_ms=1), Phase(name="d", resource="comm", fwd_ms=1, bwd_ms=1),
          Phase(name="e", resource="compute", fwd_ms=1, bwd_ms=1), Phase(name="c", resource="comm", fwd_ms=1, bwd_ms=1))
    moe = Layer(name="moe", kind="moe", fwd_ms=4, bwd_ms=4, wgrad_ms=1, state_bytes=1 << 20, activation_bytes=1 << 20,
                output_bytes=1 << 20, phases=ph)
    return Model(name="moe", layers=(moe,) * n)


def _layout(v: int, d: int = 4) -> Layout:
    devices = tuple(range(d)) if v == 1 else tuple(range(d)) + tuple(reversed(range(d)))
    return Layout.from_cuts([i for i in range(1, d * v)], d * v, devices)


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("pair", list(Pairing))
@pytest.mark.parametrize("split", [Split.FUSED, Split.AUTO])
def test_list_scheduler_pairs_and_the_simulator_replays_it(v, pair, split):
    model, cl, m = moe_model(4 * v), cluster(4), 8
    ev = Evaluator(model, cl, m)
    lay = _layout(v)
    job, sc, _ = ev.job(lay)
    pol = Policy(depth=(8,) * 4, split=(split,) * 4, w_limit=(m * v,) * 4, pair=pair)
    ref = build_schedule(job, pol, compiled=False)
    assert (len(getattr(ref, "pairs", ())) > 0) is (pair is not Pairing.OFF)
    plan = ev.plan_of(lay, ref)
    validate_plan(plan)
    res = simulate(model, cl, plan, detail=False)
    if listsched_kernel.AVAILABLE:
        got = build_schedule(job, pol, compiled=True)
        assert tuple(map(tuple, got)) == tuple(map(tuple, ref)) and got.pairs == getattr(ref, "pairs", ())
        step, live = got.clock
        assert step == pytest.approx(res.step_time_ms, abs=1e-9)  # the kernel's clock is the simulator's
        assert list(live) == res.peak_activation_bytes


def test_pairing_pays_on_a_model_that_communicates():
    """Hand check: 4 devices, 8 micro-batches, one MoE layer per stage, depth 8: pairing hides a quarter."""
    model, cl, m = moe_model(4), cluster(4), 8
    ev = Evaluator(model, cl, m)
    lay = _layout(1)
    off = ev.scheduled(lay, Policy(depth=(8,) * 4, split=(Split.FUSED,) * 4, w_limit=(8,) * 4))
    on = ev.scheduled(lay, Policy(depth=(8,) * 4, split=(Split.FUSED,) * 4, w_limit=(8,) * 4, pair=Pairing.READY))
    assert on.step_ms < 0.85 * off.step_ms


def test_tuned_plan_pairs_where_the_model_communicates():
    model, cl, m = moe_model(8), cluster(4), 8
    flat = replace(model, layers=tuple(replace(x, phases=()) for x in model.layers))
    got = tune(model, cl, m, iterations=80, seed=1)
    validate_plan(got.plan, model.num_layers)
    assert got.plan.pairs
    assert simulate(model, cl, got.plan).step_time_ms == pytest.approx(got.step_ms, abs=1e-6)
    base = tune(flat, cl, m, iterations=80, seed=1)
    assert not base.plan.pairs
    assert got.step_ms < simulate(model, cl, base.plan).step_time_ms


def test_no_pairs_and_the_same_plan_without_communication():
    """A model without communication phases never pairs: the tuner takes exactly its old path."""
    model, cl = hetero_model(10), cluster(4)
    a = tune(model, cl, 8, iterations=40, seed=2)
    assert not a.plan.pairs and "pair" not in a.plan.meta.get("policy", "")
    b = tune(model, cl, 8, iterations=40, seed=2)
    assert a.plan == b.plan


def test_adjacent_pairs():
    from octopipe_plugin.actions import parse_schedule

    sched = parse_schedule([["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]])
    assert [(str(a), str(b)) for a, b in adjacent_pairs(sched)] == [("0F1", "0B0"), ("0F2", "0B1")]


def test_pair_with_takes_the_partner_that_saves_most_net_of_its_wait():
    """Hand check of the rule: F of stage 0 at t=10 beside B/I of stages 1 and 2 (savings 3 and 2 ms)."""
    from octopipe_plugin.actions import Action, Kind
    from octopipe_plugin.tuner.pairing import pair_with

    hidden = {(Kind.B, 0, 1): 3.0, (Kind.I, 0, 2): 2.0}
    f = Action(0, Kind.F, 4)
    b1, i2, same = Action(1, Kind.B, 2), Action(2, Kind.I, 1), Action(1, Kind.B, 4)
    # B1 due at 12 saves 3 - 2 = 1, I2 ready now saves 2: I2
    assert pair_with(hidden, f, 10.0, [(12.0, b1, "b1"), (9.0, i2, "i2")])[1:] == (f, i2, "i2")
    # B1 due at 13.5 saves less than nothing; the same micro-batch never pairs; an F with an F never
    assert pair_with(hidden, f, 10.0, [(13.5, b1, "b1"), (0.0, same, "s"), (0.0, Action(1, Kind.F, 0), "f")]) is None
    # seen from the backward: the forward goes first and the pair starts when both are in
    assert pair_with(hidden, b1, 10.0, [(11.0, f, "f")]) == (11.0, f, b1, "f")


def _split_moe(nd: int = 4):
    from octopipe_plugin.formats.splits import SplitLayer
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.tuner.split import stats_bytes

    model = moe_model(8)
    head = Layer(name="head", kind="lm_head", fwd_ms=4, bwd_ms=4, wgrad_ms=2, state_bytes=1 << 20,
                 activation_bytes=1 << 20, output_bytes=0)
    model = replace(model, layers=model.layers + (head,))
    split = SplitLayer(layer=8, devices=tuple(range(nd)), shares=(1.0 / nd,) * nd, stats_bytes=stats_bytes(model))
    return model, replace(build_plan(model, "1f1b", nd, 8), splits=(split,))


def test_the_shard_inserter_pairs_with_the_shards_timing():
    """insert_shards(pair=True) on a model that communicates: pairs of an F and a B/I of two micro-batches, side by
    side on one device, each hiding something, replayed by the simulator as one unit (both halves end together);
    faster than the same insertion without pairing. A model without phases gets exactly the unpaired insertion."""
    from octopipe_plugin.actions import Kind
    from octopipe_plugin.simulator.pairs import hidden_ms, stage_phases
    from octopipe_plugin.simulator.split import without_split_layers
    from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards

    model, plan = _split_moe()
    cl = cluster(4)
    pol = ShardPolicy(window=4)
    paired = insert_shards(model, cl, plan, pol, pair=True)
    plain = insert_shards(model, cl, plan, pol)
    assert paired.pairs and not plain.pairs
    validate_plan(paired, model.num_layers)
    phases = stage_phases(without_split_layers(model, plan.splits), plan.stages)
    res = simulate(model, cl, paired)
    for first, second in paired.pairs:
        assert first.kind is Kind.F and second.kind in (Kind.B, Kind.I) and first.microbatch != second.microbatch
        row = paired.schedule[plan.stages[first.stage].device]
        assert row[row.index(first) + 1] == second and plan.stages[second.stage].device == plan.stages[first.stage].device
        assert hidden_ms(phases, first, second) > 0
        spans = {a: (s, e) for a, s, e in res.timeline[plan.stages[first.stage].device]}
        assert spans[first][1] == pytest.approx(spans[second][1])
    assert res.step_time_ms < simulate(model, cl, plain).step_time_ms
    flat = replace(model, layers=tuple(replace(x, phases=()) for x in model.layers))
    assert insert_shards(flat, cl, plan, pol, pair=True) == insert_shards(flat, cl, plan, pol)
