"""Constraints and headroom: no plan the tuner returns breaks them (a property over random models)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from octopipe_plugin.errors import OctoPipeError, OutOfMemoryError
from octopipe_plugin.formats import Model
from octopipe_plugin.headroom import Headroom, parse_headroom, with_headroom
from octopipe_plugin.schedules.placement import Placement, place_stages
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.constraints import Constraints

from tuner_helpers import GIB, cluster, hetero_model, layer

constraint_sets = st.builds(
    Constraints,
    placement=st.sampled_from(("looped", "v", "any")),
    max_stages_per_device=st.one_of(st.none(), st.integers(1, 3)),
    uniform_stages_per_device=st.booleans(),
    split_backward=st.booleans(),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(costs=st.lists(st.tuples(st.floats(0.1, 4.0), st.floats(0.1, 4.0), st.integers(1, 4)), min_size=6,
                      max_size=16),
       devices=st.integers(2, 4), m=st.integers(2, 8), cons=constraint_sets, seed=st.integers(0, 3))
def test_returned_plans_keep_to_the_constraints(costs, devices, m, cons, seed):
    layers = tuple(layer(i, f, w=w, act=a * GIB // 4) for i, (f, w, a) in enumerate(costs))
    model = Model(name="random", layers=layers)
    cl = cluster(devices, memory_gib=60.0)
    res = tune(model, cl, m, iterations=25, seed=seed, constraints=cons)
    plan = res.plan
    assert cons.plan_problems(plan) == []
    counts = [len(plan.stages_of(d)) for d in range(devices)]
    if cons.placement != "any":
        assert [s.device for s in plan.stages] == place_stages(Placement(cons.placement), devices, plan.num_stages)
    if cons.max_stages_per_device is not None:
        assert max(counts) <= cons.max_stages_per_device
    if cons.uniform_stages_per_device:
        assert len(set(counts)) == 1
    if not cons.split_backward:
        assert {a.kind.value for row in plan.schedule for a in row} <= {"F", "B"}
    assert res.constraints == cons


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gib=st.floats(0.0, 30.0), seed=st.integers(0, 3))
def test_headroom_is_kept_and_the_simulator_confirms_it(gib, seed):
    model = hetero_model(12)
    cl = with_headroom(cluster(4, memory_gib=40.0), Headroom(gib=gib))
    try:
        res = tune(model, cl, 8, iterations=20, seed=seed)
    except OutOfMemoryError as exc:
        assert "headroom" in str(exc) or gib == 0
        return
    sim = simulate(model, cl, res.plan)
    assert max(sim.peak_memory_bytes) <= cl.memory_bytes - int(round(gib * GIB))
    assert max(sim.peak_memory_bytes) <= cl.usable_memory_bytes


def test_no_constraints_and_no_headroom_change_nothing():
    """The library's defaults: the same plan as a tune without the new arguments, for the same seed."""
    model, cl = hetero_model(12), cluster(4, memory_gib=40.0)
    a = tune(model, cl, 8, iterations=40, seed=1)
    b = tune(model, with_headroom(cl, Headroom()), 8, iterations=40, seed=1, constraints=Constraints())
    assert a.plan.stages == b.plan.stages and a.plan.schedule == b.plan.schedule and a.step_ms == b.step_ms


def test_headroom_changes_the_plan_where_memory_binds():
    """A cluster where the fastest plan fills the device: with headroom the tuner returns a leaner one."""
    model, cl = hetero_model(12), cluster(4, memory_gib=13.0)
    free = tune(model, cl, 8, iterations=40, seed=0)
    tight_room = max(free.peak) - 1.5 * GIB
    kept = with_headroom(cl, Headroom(gib=(cl.memory_bytes - tight_room) / GIB))
    lean = tune(model, kept, 8, iterations=40, seed=0)
    assert max(lean.peak) <= kept.usable_memory_bytes < max(free.peak)


@pytest.mark.parametrize("text, expected", [("6", Headroom(gib=6.0)), ("6GiB", Headroom(gib=6.0)),
                                            ("0.5g", Headroom(gib=0.5)), ("8%", Headroom(fraction=0.08)),
                                            ("0.08", Headroom(fraction=0.08)), ("0", Headroom())])
def test_headroom_forms(text, expected):
    assert parse_headroom(text) == expected


@pytest.mark.parametrize("text", ["-1", "6TB", "100%", "lots", "1.5.2"])
def test_bad_headroom_is_one_line(text):
    with pytest.raises(OctoPipeError, match="--memory-headroom"):
        parse_headroom(text)


def test_headroom_cannot_take_the_whole_device():
    with pytest.raises(OctoPipeError, match="leaves nothing"):
        with_headroom(cluster(2, memory_gib=10.0), Headroom(gib=10.0))


def test_bad_constraints_are_refused():
    with pytest.raises(OctoPipeError, match="placement"):
        Constraints(placement="zigzag")
    with pytest.raises(OctoPipeError, match="max stages"):
        Constraints(max_stages_per_device=0)


def test_pruning_never_breaks_uniform_stages():
    """An empty stage dropped at the end would leave one device a stage short: kept when uniformity is asked."""
    model = Model(name="few", layers=tuple(layer(i, 1.0 + i % 2) for i in range(5)))
    cons = Constraints(uniform_stages_per_device=True, placement="looped")
    res = tune(model, cluster(2, memory_gib=60.0), 4, iterations=30, seed=0, constraints=cons)
    assert cons.plan_problems(res.plan) == []
    assert replace(cons) == cons


def test_min_stages_per_device_gives_every_device_that_many_chunks():
    # megatron-core's combined step at PP > 1 asks for a virtual pipeline size: two chunks or more on every rank
    model, cl = hetero_model(12), cluster(4, memory_gib=60.0)
    free = tune(model, cl, 8, iterations=30, seed=0, constraints=Constraints(max_stages_per_device=1))
    assert {len(free.plan.stages_of(d)) for d in range(4)} == {1}  # what the floor has to lift
    cons = Constraints(min_stages_per_device=2, uniform_stages_per_device=True)
    res = tune(model, cl, 8, iterations=30, seed=0, constraints=cons)
    assert min(len(res.plan.stages_of(d)) for d in range(4)) >= 2 and cons.plan_problems(res.plan) == []
    assert "fewer than 2" in cons.placement_problem([0, 1, 2, 3, 3, 2, 1], 4)
    with pytest.raises(OctoPipeError, match="min stages"):
        Constraints(min_stages_per_device=0)
