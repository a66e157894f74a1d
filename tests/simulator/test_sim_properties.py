"""Property tests: the event-driven simulator against an explicit task-graph oracle.

The oracle builds the plan's task graph with networkx (compute nodes, one node per message,
edges for device order, data dependencies, link order and the no-overlap occupancy), takes
longest paths in topological order, and calls the plan deadlocked when the graph has a cycle.
It shares nothing with the simulator but the per-pair message order rule (messages.py).
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.formats import Cluster, Layer, Link, Model, Plan, Stage, validate_plan
from octopipe_plugin.actions import Action, Kind
from octopipe_plugin.schedules.messages import plan_messages
from octopipe_plugin.simulator import SimOptions, simulate

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stage_sum(model, stage, key):
    return sum(getattr(layer, key) for layer in model.layers[stage.start:stage.end])


def _duration(model, plan, a: Action) -> float:
    st_ = plan.stages[a.stage]
    if a.kind is Kind.F:
        return _stage_sum(model, st_, "fwd_ms")
    if a.kind is Kind.I:
        return _stage_sum(model, st_, "bwd_ms")
    if a.kind is Kind.W:
        return _stage_sum(model, st_, "wgrad_ms")
    return _stage_sum(model, st_, "bwd_ms") + _stage_sum(model, st_, "wgrad_ms")


def _boundary_bytes(model, plan, stage: int) -> int:
    end = plan.stages[stage].end
    return model.layers[end - 1].output_bytes if end > 0 else 0


def oracle(model, cluster, plan, opts: SimOptions):
    """(step time, {action: (start, end)}) by longest paths, or None when the task graph has a cycle."""
    g = nx.DiGraph()
    dur = {}
    for row in plan.schedule:
        for a in row:
            dur[("a", a)] = _duration(model, plan, a)
    recv_lag = {}
    for (src, dst), msgs in plan_messages(plan).items():
        prev = None
        for k, msg in enumerate(msgs):
            node = ("t", src, dst, k)
            boundary = msg.src_stage if msg.kind.value == "act" else msg.dst_stage
            cost = cluster.transfer_ms(src, dst, _boundary_bytes(model, plan, boundary)) + opts.launch_ms
            dur[node] = cost
            g.add_edge(("a", msg.producer), node, lag=0.0)
            g.add_edge(node, ("a", msg.consumer), lag=0.0)
            if opts.contention and prev is not None:
                g.add_edge(prev, node, lag=0.0)
            if not opts.overlap:
                recv_lag[msg.consumer] = cost
                row = plan.schedule[src]
                i = row.index(msg.producer)
                if i + 1 < len(row):
                    g.add_edge(node, ("a", row[i + 1]), lag=0.0)  # the sender is busy while sending
            prev = node
    for row in plan.schedule:
        for i, a in enumerate(row):
            g.add_node(("a", a))
            if i > 0:
                g.add_edge(("a", row[i - 1]), ("a", a), lag=0.0)
    index = {a for row in plan.schedule for a in row}
    for a in index:
        for dep in _same_device_or_local_inputs(plan, a, index):
            g.add_edge(("a", dep), ("a", a), lag=0.0)
    if not nx.is_directed_acyclic_graph(g):
        return None
    start, end = {}, {}
    for node in nx.topological_sort(g):
        t = 0.0
        for pred in g.predecessors(node):
            lag = recv_lag.get(node[1], 0.0) if node[0] == "a" and pred[0] == "a" and \
                _on_same_device(plan, pred[1], node[1]) else 0.0
            if pred[0] == "t" and node[0] == "a" and not opts.overlap:
                lag = recv_lag.get(node[1], 0.0) if _sender_busy_edge(plan, pred, node) else 0.0
            t = max(t, end[pred] + lag)
        start[node], end[node] = t, t + dur[node]
    times = {n[1]: (start[n], end[n]) for n in start if n[0] == "a"}
    step = max([e for n, e in end.items() if n[0] == "a"] + [0.0])
    if not opts.overlap:  # a sender's last transfer also ends the step for that device
        step = max([step] + [e for n, e in end.items() if n[0] == "t"])
    return step, times


def _on_same_device(plan, a: Action, b: Action) -> bool:
    return plan.stages[a.stage].device == plan.stages[b.stage].device


def _sender_busy_edge(plan, t_node, a_node) -> bool:
    """Whether this transfer -> action edge is the sender's occupancy edge (not the data edge)."""
    return plan.stages[a_node[1].stage].device == t_node[1]


def _same_device_or_local_inputs(plan, a: Action, index) -> list[Action]:
    """Inputs that need no message: own F / own I, and neighbours on the same device."""
    s, mb = a.stage, a.microbatch
    deps = []
    if a.kind is Kind.F and s > 0 and plan.stages[s - 1].device == plan.stages[s].device:
        deps.append(Action(s - 1, Kind.F, mb))
    if a.kind in (Kind.B, Kind.I):
        deps.append(Action(s, Kind.F, mb))
        if s + 1 < plan.num_stages and plan.stages[s + 1].device == plan.stages[s].device:
            b = Action(s + 1, Kind.B, mb)
            deps.append(b if b in index else Action(s + 1, Kind.I, mb))
    if a.kind is Kind.W:
        deps.append(Action(s, Kind.I, mb))
    return deps


@st.composite
def plans(draw):
    """A random model, cluster and deadlock-free plan (a random topological order dealt to devices)."""
    ns, nd, m = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n_layers = draw(st.integers(ns, ns + 3))
    cuts = sorted(draw(st.lists(st.integers(0, n_layers), min_size=ns - 1, max_size=ns - 1)))
    bounds = [0] + cuts + [n_layers]
    devices = [draw(st.integers(0, nd - 1)) for _ in range(ns)]
    cost = st.integers(0, 8).map(lambda x: x / 4)
    layers = tuple(Layer(name=f"l{k}", kind="dense", fwd_ms=draw(cost), bwd_ms=draw(cost), wgrad_ms=draw(cost),
                         state_bytes=draw(st.integers(0, 100)), activation_bytes=draw(st.integers(0, 100)),
                         output_bytes=draw(st.sampled_from([0, 250_000, 4_000_000])))
                   for k in range(n_layers))
    model = Model(name="rand", layers=layers)
    link = Link(bandwidth_gb_per_s=1.0, latency_us=draw(st.sampled_from([0.0, 250.0])))
    slow = Link(bandwidth_gb_per_s=0.5, latency_us=500.0)
    cluster = Cluster(num_devices=nd, devices_per_node=draw(st.integers(1, 4)), memory_bytes=1 << 30,
                      intra_node=link, inter_node=slow)
    split = {(s, mb): draw(st.booleans()) for s in range(ns) for mb in range(m)}
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    rows = _random_topological_rows(ns, m, devices, nd, split, rng)
    plan = Plan(model="rand", num_devices=nd, num_microbatches=m,
                stages=tuple(Stage(start=bounds[s], end=bounds[s + 1], device=devices[s]) for s in range(ns)),
                schedule=rows)
    return model, cluster, plan


def _random_topological_rows(ns, m, devices, nd, split, rng):
    done: set[Action] = set()
    todo = []
    for s in range(ns):
        for mb in range(m):
            todo.append(Action(s, Kind.F, mb))
            todo += [Action(s, Kind.I, mb), Action(s, Kind.W, mb)] if split[(s, mb)] else [Action(s, Kind.B, mb)]
    rows = [[] for _ in range(nd)]

    def ready(a: Action) -> bool:
        s, mb = a.stage, a.microbatch
        if a.kind is Kind.F:
            return s == 0 or Action(s - 1, Kind.F, mb) in done
        if a.kind is Kind.W:
            return Action(s, Kind.I, mb) in done
        nxt = s + 1 == ns or Action(s + 1, Kind.B, mb) in done or Action(s + 1, Kind.I, mb) in done
        return Action(s, Kind.F, mb) in done and nxt

    while todo:
        a = rng.choice([x for x in todo if ready(x)])
        todo.remove(a)
        done.add(a)
        rows[devices[a.stage]].append(a)
    return tuple(tuple(r) for r in rows)


options = st.builds(SimOptions, contention=st.booleans(), overlap=st.booleans(),
                    launch_ms=st.sampled_from([0.0, 0.5]))


@pytest.mark.timeout(120)
@SETTINGS
@given(plans(), options)
def test_random_valid_plans_match_the_task_graph_oracle(case, opts):
    model, cluster, plan = case
    validate_plan(plan, model.num_layers)
    res = simulate(model, cluster, plan, opts)
    step, times = oracle(model, cluster, plan, opts)
    assert res.step_time_ms == pytest.approx(step)
    for row in res.timeline:
        for a, start, end in row:
            assert (start, end) == pytest.approx(times[a])
    # no device finishes its own work faster than its work
    for d, row in enumerate(plan.schedule):
        assert res.step_time_ms >= sum(_duration(model, plan, a) for a in row) - 1e-9
    assert res.busy_ms == pytest.approx([sum(_duration(model, plan, a) for a in row) for row in plan.schedule])


@pytest.mark.timeout(120)
@SETTINGS
@given(plans(), options, st.integers(0, 2**32 - 1))
def test_random_permutations_simulate_or_raise_deadlock(case, opts, seed):
    model, cluster, plan = case
    rng = random.Random(seed)
    rows = [list(r) for r in plan.schedule]
    for r in rows:
        if rng.random() < 0.7:
            rng.shuffle(r)
    shuffled = Plan(model=plan.model, num_devices=plan.num_devices, num_microbatches=plan.num_microbatches,
                    stages=plan.stages, schedule=tuple(tuple(r) for r in rows))
    expected = oracle(model, cluster, shuffled, opts)
    try:
        res = simulate(model, cluster, shuffled, opts)
    except DeadlockError as err:
        assert expected is None, "simulator reports a deadlock the task graph does not have"
        assert err.stuck and all(f"device {d} stuck at" in text for d, text in err.stuck.items())
        return
    assert expected is not None, "simulator finished a plan whose task graph has a cycle"
    assert res.step_time_ms == pytest.approx(expected[0])
