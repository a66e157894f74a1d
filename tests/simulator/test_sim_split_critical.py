"""The critical path of split plans: from t = 0 to the step's end through the input or device that set each start."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import Cluster, Layer, Link, Model
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.trace import trace_events
from tests.simulator.test_sim_split import HEAD_MODEL, cluster, head_plan, layer


def _check_path(res):
    """Every link of the path is tight: the device's previous action, or an input arriving (after its transfer)."""
    when = {(d, a): (s, e) for d, row in enumerate(res.timeline) for a, s, e in row}
    path = res.critical_path
    assert path, "a split plan has a critical path"
    assert when[path[0]][0] == pytest.approx(0.0)
    assert when[path[-1]][1] == pytest.approx(res.step_time_ms)
    for prev, cur in zip(path, path[1:]):
        end, start = when[prev][1], when[cur][0]
        if prev[0] == cur[0]:
            assert start == pytest.approx(end), (prev, cur)
        else:
            assert start >= end - 1e-9, (prev, cur)
    return path


def test_worked_check_critical_path_is_device_0s_chain():
    res = simulate(HEAD_MODEL, cluster(), head_plan())
    path = _check_path(res)
    assert [(d, str(a)) for d, a in path] == [(0, "0F0"), (0, "1H0"), (0, "1J0"), (0, "0B0"), (0, "1K0")]


def test_critical_path_crosses_devices_through_the_statistics_and_partials():
    # the head's input and each partial take 1.01 ms over the link (test_sim_split's transfer case)
    model = Model(name="head", layers=(layer("embedding", 0, 0, 0), layer("dense", 1, 1, 1, out=1_000_000),
                                       layer("lm_head", 2, 2, 2)))
    sp = SplitLayer(layer=2, devices=(0, 1), shares=(0.5, 0.5), stats_bytes=1000)
    res = simulate(model, cluster(latency_us=10.0), head_plan(splits=(sp,)))
    path = [(d, str(a)) for d, a in _check_path(res)]
    # stage 0 -> the owner's F -> back to shard 0's H -> its statistics to shard 1's J -> ... -> the end
    assert path[:4] == [(0, "0F0"), (1, "1F0"), (0, "1H0"), (0, "1J0")]
    assert len({d for d, _ in path}) == 2


def test_tuned_split_plan_has_a_tight_critical_path_in_its_trace():
    from octopipe_plugin.tuner.split import tune_split

    def lay(name, kind, t):
        return Layer(name=name, kind=kind, fwd_ms=t, bwd_ms=t, wgrad_ms=t, state_bytes=1 << 20,
                     activation_bytes=1 << 20, output_bytes=1 << 16)
    model = Model(name="heavy-head", layers=(lay("embedding", "embedding", 0.01),)
                  + tuple(lay(f"l{i}", "dense", 1.0) for i in range(6)) + (lay("lm_head", "lm_head", 3.0),))
    link = Link(bandwidth_gb_per_s=100.0, latency_us=1.0)
    cl = Cluster(num_devices=4, devices_per_node=4, memory_bytes=1 << 34, intra_node=link, inter_node=link)
    r = tune_split(model, cl, 8, iterations=20, time_budget_s=120, seed=1)
    assert r.plan.splits
    res = simulate(model, cl, r.plan)
    path = _check_path(res)
    events = [e for e in trace_events(r.plan, res) if e.get("ph") == "X" and e.get("cat") != "transfer"]
    assert sum(e["args"]["critical_path"] for e in events) == len(path)
