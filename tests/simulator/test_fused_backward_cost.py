"""B charged at the measured fused backward (Layer.fused_ratio): the simulator, the tuner and the model format.

Hand-computed cases: a ratio scales only B (I and W keep their figures), per layer inside a stage; no
ratio anywhere leaves B = bwd + wgrad exactly as before; the tuner's Job prices B like the simulator.
"""

from __future__ import annotations

import pytest

from octopipe_plugin.actions import Kind
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats import Cluster, Layer, Link, Model
from octopipe_plugin.formats.model import model_from_dict, model_to_dict
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.costs import kind_durations, stage_costs
from octopipe_plugin.tuner.layout import Layout, make_job


def model(ratios) -> Model:
    return Model(name="m", layers=tuple(
        Layer(name=f"l{k}", kind="dense", fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=1.0, state_bytes=0, activation_bytes=1,
              output_bytes=1000, fused_ratio=r) for k, r in enumerate(ratios)))


def cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_per_s=1.0, latency_us=0.0)
    return Cluster(num_devices=n, devices_per_node=n, memory_bytes=1 << 40, intra_node=link, inter_node=link)


def test_ratio_scales_only_the_fused_backward_per_layer():
    m = model([0.5, None, 0.75, 1.0])
    plan = build_plan(m, "1f1b", 2, 2)  # stages [0, 2) and [2, 4)
    dur = kind_durations(stage_costs(m, plan.stages))
    # stage 0: 3 * 0.5 + 3 (no ratio) = 4.5; stage 1: 3 * 0.75 + 3 * 1.0 = 5.25
    assert dur[Kind.B] == pytest.approx((4.5, 5.25))
    assert dur[Kind.I] == pytest.approx((4.0, 4.0)) and dur[Kind.W] == pytest.approx((2.0, 2.0))
    assert dur[Kind.F] == pytest.approx((2.0, 2.0))


def test_without_ratios_b_is_input_plus_weight_gradient():
    m = model([None] * 4)
    sc = stage_costs(m, build_plan(m, "1f1b", 2, 2).stages)
    assert sc.fused is None
    dur = kind_durations(sc)
    assert dur[Kind.B] == pytest.approx((6.0, 6.0))


def test_gpipe_step_pays_the_measured_b():
    # 2 stages, 1 micro-batch: F + hop + F + B + hop + B (1000 bytes at 1 GB/s: 0.001 ms a hop)
    plain = model([None, None])
    cheap = model([0.5, 0.5])
    plan = build_plan(plain, "gpipe", 2, 1)
    assert simulate(plain, cluster(2), plan).step_time_ms == pytest.approx(2 * 1.0 + 2 * 3.0 + 0.002)
    assert simulate(cheap, cluster(2), plan).step_time_ms == pytest.approx(2 * 1.0 + 2 * 1.5 + 0.002)


def test_split_backward_plans_ignore_the_ratio():
    plan = build_plan(model([None] * 4), "zb-v", 2, 4)
    assert (simulate(model([0.5] * 4), cluster(2), plan).step_time_ms ==
            pytest.approx(simulate(model([None] * 4), cluster(2), plan).step_time_ms))


def test_tuner_job_prices_b_like_the_simulator():
    m = model([0.5, 0.8, 0.9, 0.7])
    layout = Layout.from_cuts((1, 2, 3), 4, (0, 1, 1, 0))
    job, sc, _ = make_job(m, cluster(2), 2, layout)
    assert job.fused == sc.fused
    assert kind_durations(job)[Kind.B] == pytest.approx(kind_durations(sc)[Kind.B])
    assert kind_durations(job)[Kind.B] == pytest.approx((1.5, 2.4, 2.7, 2.1))


def test_ratio_round_trips_and_is_left_out_when_absent():
    m = model([0.9, None])
    doc = model_to_dict(m)
    assert doc["layers"][0]["fused_ratio"] == 0.9 and "fused_ratio" not in doc["layers"][1]
    assert model_from_dict(doc) == m


@pytest.mark.parametrize("bad", [0.0, -1.0, 11.0, "fast"])
def test_bad_ratio_is_refused_by_name(bad):
    doc = model_to_dict(model([None]))
    doc["layers"][0]["fused_ratio"] = bad
    with pytest.raises(FormatError, match=r"layers\[0\]\.fused_ratio"):
        model_from_dict(doc, "m.json")


@pytest.mark.parametrize("compiled", [False, True])
def test_tuner_schedules_with_the_measured_b(compiled):
    """docs/formats.md's 1F1B check, (m + p - 1)(F + B), with B at half its I + W: 11 * (1 + 1) = 22 ms."""
    from octopipe_plugin.formats import Plan
    from octopipe_plugin.tuner import Policy, Split, build_schedule, listsched_kernel

    if compiled and not listsched_kernel.AVAILABLE:
        pytest.skip("numba is not installed: no compiled scheduler")
    m = Model(name="w", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.5, wgrad_ms=0.5, state_bytes=0, activation_bytes=1,
              output_bytes=0, fused_ratio=0.5) for i in range(4)))
    cl = Cluster(num_devices=4, devices_per_node=4, memory_bytes=1 << 40,
                 intra_node=Link(bandwidth_gb_per_s=1.0, latency_us=0.0),
                 inter_node=Link(bandwidth_gb_per_s=1.0, latency_us=0.0))
    layout = Layout(bounds=((0, 1), (1, 2), (2, 3), (3, 4)), devices=(0, 1, 2, 3))
    job, _, _ = make_job(m, cl, 8, layout)
    rows = build_schedule(job, Policy(depth=(4, 3, 2, 1), split=(Split.FUSED,) * 4, w_limit=(0,) * 4),
                          compiled=compiled)
    plan = Plan(model="w", num_devices=4, num_microbatches=8, stages=layout.stages(), schedule=rows)
    assert simulate(m, cl, plan).step_time_ms == pytest.approx(22.0)
    if compiled:
        assert rows.clock[0] == pytest.approx(22.0)  # the compiled loop's own clock charges the same B
