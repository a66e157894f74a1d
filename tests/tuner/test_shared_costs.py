"""The tuner plans with the simulator's own transfer times and activation accounting."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from octopipe_plugin.testing.plans import random_plan
from octopipe_plugin.simulator import SimOptions, simulate
from octopipe_plugin.simulator.costs import hop_times
from octopipe_plugin.simulator.memory import least_live
from octopipe_plugin.tuner.evaluate import Evaluator
from octopipe_plugin.tuner.layout import Layout

from tuner_helpers import cluster, hetero_model


def test_job_hops_are_the_simulators_with_the_same_launch_cost():
    model, cl = hetero_model(12), cluster(4, per_node=2)
    layout = Layout(bounds=((0, 3), (3, 6), (6, 9), (9, 12)), devices=(0, 1, 1, 3))
    ev = Evaluator(model, cl, 4, options=SimOptions(launch_ms=0.25))
    job, sc, _ = ev.job(layout)
    assert job.hop == hop_times(cl, layout.devices, sc.output, 0.25)
    assert job.hop[1] is None  # stages 1 and 2 share device 1: nothing is sent
    # inter-node hop (device 1 -> 3) costs more than the intra-node one (0 -> 1), both carry the launch cost
    assert job.hop[2] > job.hop[0] > 0.25


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.integers(1, 3), v=st.integers(1, 3), m=st.integers(1, 4))
def test_no_order_holds_less_than_least_live(seed, p, v, m):
    model, cl = hetero_model(12), cluster(p)
    plan = random_plan(random.Random(seed), num_devices=p, num_layers=12, num_stages=p * v, num_microbatches=m,
                       placement_kind="arbitrary" if v > 1 else "looped")
    res = simulate(model, cl, plan)
    floor = least_live([st.device for st in plan.stages], res.stage_activation, p)
    assert all(peak >= f for peak, f in zip(res.peak_activation_bytes, floor))
    for d in range(p):  # the memory curve and the peak count the same events
        assert max(b for _, b in res.memory_curve(d)) == res.peak_memory_bytes[d]
