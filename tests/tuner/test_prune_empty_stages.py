"""Empty stages are dropped from tuned plans without changing what runs or slowing it down."""

from hypothesis import given, settings, strategies as st

from octopipe_plugin.formats import Cluster, Layer, Link, Model, Stage, validate_plan
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner.prune import drop_empty_stages


def _model(n):
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + (i % 3), bwd_ms=1.0, wgrad_ms=1.0,
                         state_bytes=1, activation_bytes=1, output_bytes=1000) for i in range(n))
    return Model(name="m", layers=layers)


def _cluster(d):
    return Cluster(num_devices=d, devices_per_node=2, memory_bytes=10**9,
                   intra_node=Link(bandwidth_gb_per_s=1, latency_us=50), inter_node=Link(bandwidth_gb_per_s=0.1, latency_us=100))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_dropping_empty_stages_keeps_coverage_and_is_never_slower(d, m, empties):
    model = _model(5)
    bounds = sorted(empties + [0, 5])[: d + 1]
    while len(bounds) < d + 1:
        bounds.append(5)
    bounds[-1] = 5
    ranges = [(bounds[i], bounds[i + 1]) for i in range(d)]
    plan = build_plan(model, "1f1b", d, m, boundaries=ranges)
    pruned = drop_empty_stages(plan)
    validate_plan(pruned, num_layers=5)
    assert all(s.end > s.start for s in pruned.stages)
    assert [s.device for s in pruned.stages] == [s.device for s in plan.stages if s.end > s.start]
    cl = _cluster(d)
    assert simulate(model, cl, pruned).step_time_ms <= simulate(model, cl, plan).step_time_ms + 1e-9


def test_plan_without_empty_stages_is_returned_unchanged():
    model = _model(4)
    plan = build_plan(model, "1f1b", 2, 2, boundaries=[(0, 2), (2, 4)])
    assert drop_empty_stages(plan) is plan
    assert drop_empty_stages(plan).stages == (Stage(start=0, end=2, device=0), Stage(start=2, end=4, device=1))
