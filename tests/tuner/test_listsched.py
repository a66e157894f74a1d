"""The list scheduler builds valid per-device orders that the simulator replays, within memory."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from octopipe_plugin.formats import Layer, Model, Plan, validate_plan
from octopipe_plugin.schedules.placement import place
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import Order, Policy, Split, WFill, build_schedule
from octopipe_plugin.tuner.bounds import refined_bound
from octopipe_plugin.tuner.layout import Layout, make_job

from tuner_helpers import cluster, layer


def _uniform(n):
    return Model(name="u", layers=tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0,
                                              state_bytes=0, activation_bytes=1, output_bytes=0) for i in range(n)))


def _plan(model, cl, m, layout, policy):
    job, _, _ = make_job(model, cl, m, layout)
    schedule = build_schedule(job, policy)
    assert schedule is not None
    return Plan(model=model.name, num_devices=cl.num_devices, num_microbatches=m, stages=layout.stages(),
                schedule=schedule)


def test_fused_depth_p_minus_r_is_1f1b():
    """With fused backwards and warm-up depth p-r the greedy order is 1F1B: (m+p-1)(F+B) = 33 ms (docs/formats.md)."""
    model = Model(name="w", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.5, wgrad_ms=0.5, state_bytes=0, activation_bytes=1,
              output_bytes=0) for i in range(4)))
    cl = cluster(4, latency_us=0.0)
    layout = Layout(bounds=((0, 1), (1, 2), (2, 3), (3, 4)), devices=(0, 1, 2, 3))
    pol = Policy(depth=(4, 3, 2, 1), split=(Split.FUSED,) * 4, w_limit=(0,) * 4)
    plan = _plan(model, cl, 8, layout, pol)
    res = simulate(model, cl, plan)
    assert abs(res.step_time_ms - 33.0) < 1e-6
    assert res.peak_activation_bytes == [4, 3, 2, 1]  # device r holds p - r micro-batches, as 1F1B does


def test_split_backward_beats_fused_on_uniform_pipeline():
    """Splitting I/W and deferring W fills the drain: strictly faster than 1F1B on a uniform pipeline."""
    model, cl = _uniform(4), cluster(4, latency_us=0.0)
    layout = Layout(bounds=((0, 1), (1, 2), (2, 3), (3, 4)), devices=(0, 1, 2, 3))
    fused = simulate(model, cl, _plan(model, cl, 8, layout, Policy(depth=(4, 3, 2, 1), split=(Split.FUSED,) * 4,
                                                                    w_limit=(0,) * 4)))
    split = simulate(model, cl, _plan(model, cl, 8, layout, Policy(depth=(4, 3, 2, 1), split=(Split.SPLIT,) * 4,
                                                                    w_limit=(8,) * 4)))
    assert split.step_time_ms < fused.step_time_ms


@settings(max_examples=25, deadline=None)
@given(
    costs=st.lists(st.tuples(st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0.1, 3)), min_size=4, max_size=9),
    devices=st.integers(2, 3),
    chunks=st.integers(1, 2),
    m=st.integers(1, 6),
    vshape=st.booleans(),
    depth=st.integers(1, 6),
    split=st.sampled_from(list(Split)),
    wfill=st.sampled_from(list(WFill)),
    order=st.sampled_from(list(Order)),
    cap=st.integers(3, 40),
)
def test_random_policies_give_valid_plans_within_memory(costs, devices, chunks, m, vshape, depth, split, wfill,
                                                        order, cap):
    """Any policy either starves (None) or yields a valid, deadlock-free plan inside the activation cap."""
    if devices * chunks > len(costs):
        chunks = 1
    model = Model(name="r", layers=tuple(layer(i, f, b, w, state=0, act=1) for i, (f, b, w) in enumerate(costs)))
    cl = cluster(devices)
    cl = type(cl)(num_devices=devices, devices_per_node=8, memory_bytes=cap, intra_node=cl.intra_node,
                  inter_node=cl.inter_node)
    n = devices * chunks
    cuts = [round(len(costs) * k / n) for k in range(n + 1)]
    layout = Layout(bounds=tuple(zip(cuts[:-1], cuts[1:])),
                    devices=tuple(place("v" if vshape and chunks == 2 else "looped", devices, chunks)))
    job, _, _ = make_job(model, cl, m, layout)
    pol = Policy(depth=(depth,) * devices, split=(split,) * devices, w_limit=(2,) * devices, w_fill=wfill,
                 f_order=order, b_order=order)
    schedule = build_schedule(job, pol)
    if schedule is None:
        return
    plan = Plan(model="r", num_devices=devices, num_microbatches=m, stages=layout.stages(), schedule=schedule)
    validate_plan(plan, model.num_layers)
    res = simulate(model, cl, plan)
    assert max(res.peak_memory_bytes) <= cap
    busiest = max(res.busy_ms)
    assert res.step_time_ms >= busiest - 1e-9
    assert res.step_time_ms >= refined_bound(model, devices, m) - 1e-9  # the bound holds for every plan


@settings(max_examples=40, deadline=None)
@given(
    costs=st.lists(st.tuples(st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0.1, 3), st.integers(1, 4)),
                   min_size=4, max_size=10),
    devices=st.integers(2, 4),
    chunks=st.integers(1, 2),
    m=st.integers(1, 9),
    split=st.sampled_from(list(Split)),
    depth=st.integers(1, 9),
    w_limit=st.integers(0, 6),
    flags=st.tuples(st.sampled_from(list(WFill)), st.sampled_from(list(Order)), st.sampled_from(list(Order))),
    mem=st.integers(3, 40),
)
def test_compiled_scheduler_takes_the_python_schedulers_decisions(costs, devices, chunks, m, split, depth, w_limit,
                                                                  flags, mem):
    """The numba event loop is checked against the Python reference on random jobs, policies and memory caps."""
    from octopipe_plugin.tuner import listsched_kernel

    if not listsched_kernel.AVAILABLE:
        return
    n = devices * chunks
    if len(costs) < n:
        return
    model = Model(name="r", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=f, bwd_ms=b, wgrad_ms=w, state_bytes=0, activation_bytes=a,
              output_bytes=1 << 20) for i, (f, b, w, a) in enumerate(costs)))
    cuts = [round(i * len(costs) / n) for i in range(n + 1)]
    layout = Layout(bounds=tuple(zip(cuts[:-1], cuts[1:])), devices=tuple(place("v" if chunks == 2 else "looped",
                                                                                    devices, chunks)))
    cl = cluster(devices, memory_gib=mem / 2**30)
    job, _, _ = make_job(model, cl, m, layout)
    pol = Policy(depth=(depth,) * devices, split=(split,) * devices, w_limit=(w_limit,) * devices,
                 w_fill=flags[0], f_order=flags[1], b_order=flags[2])
    ref = build_schedule(job, pol, compiled=False)
    got = build_schedule(job, pol, compiled=True)
    assert (ref is None) == (got is None)
    if ref is not None:
        assert got == ref
        # the compiled scheduler's own clock and live-memory peaks are the simulator's
        res = simulate(model, cl, Plan(model=model.name, num_devices=devices, num_microbatches=m,
                                       stages=layout.stages(), schedule=got), detail=False)
        step, live = got.clock
        assert abs(step - res.step_time_ms) <= 1e-9 * max(1.0, step)
        assert list(live) == list(res.peak_activation_bytes)
