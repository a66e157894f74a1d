"""The split search's parts: bounds that leave split layers out, W held back for the gaps, the work-unit budget."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import Cluster, Layer, Link, Model, validate_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.bounds import fill_bound, lower_bound, packing_bound
from octopipe_plugin.tuner.split import _insertions, attempt_units, tune_split


def lay(name, kind, t, state=1 << 20):
    return Layer(name=name, kind=kind, fwd_ms=t, bwd_ms=t, wgrad_ms=t, state_bytes=state, activation_bytes=1 << 20,
                 output_bytes=1 << 16)


MODEL = Model(name="heavy-head", layers=(lay("embedding", "embedding", 0.01),)
              + tuple(lay(f"l{i}", "dense", 1.0) for i in range(6)) + (lay("lm_head", "lm_head", 3.0),))
LINK = Link(bandwidth_gb_per_s=100.0, latency_us=1.0)
CLUSTER = Cluster(num_devices=4, devices_per_node=4, memory_bytes=1 << 34, intra_node=LINK, inter_node=LINK)


def test_bounds_leave_split_layers_out_of_their_whole_layer_terms():
    head = MODEL.num_layers - 1
    m, nd = 8, 4
    work = m * sum(x.total_ms for x in MODEL.layers) / nd
    assert lower_bound(MODEL, nd, m).layer_ms == m * 9.0  # the head, whole
    assert lower_bound(MODEL, nd, m, {head}).layer_ms == m * 3.0  # a dense layer
    assert lower_bound(MODEL, nd, m, {head}).value_ms == pytest.approx(work)
    # 6 dense layers on 4 devices: one device holds 2 of them (6 ms a micro-batch) whatever the head does
    assert packing_bound(MODEL, nd, m, {0, head}) == pytest.approx(m * max(6.0, work / m))
    assert packing_bound(MODEL, nd, m) >= m * 9.0
    # the head no longer runs all M micro-batches on one device after the fill
    assert fill_bound(MODEL, m, {0, head}) < fill_bound(MODEL, m)
    # the last dense layer: five layers' F before it (and the embedding's), then its f+i+w for every micro-batch
    assert fill_bound(MODEL, m, {0, head}) == pytest.approx(0.01 + 5 * 1.0 + m * 3.0)


def test_insertions_stay_within_their_work_units_and_the_first_always_runs():
    head = MODEL.num_layers - 1
    rest = tune(MODEL, CLUSTER, 8, iterations=10, time_budget_s=120, seed=1).plan
    every = list(_insertions(MODEL, CLUSTER, head, None, rest, _opts(), "x"))
    cost = attempt_units(rest, CLUSTER.num_devices)
    assert len(every) >= 6
    assert len(list(_insertions(MODEL, CLUSTER, head, None, rest, _opts(), "x", units=0.0))) == 1
    assert len(list(_insertions(MODEL, CLUSTER, head, None, rest, _opts(), "x", units=3 * cost))) == 3
    for label, res, cand in every:
        if cand is not None:
            validate_plan(cand, MODEL.num_layers)
            assert simulate(MODEL, CLUSTER, cand).step_time_ms == pytest.approx(res.step_time_ms)


def test_tuned_split_plans_try_the_deferred_w_policy_and_the_room_refinement():
    r = tune_split(MODEL, CLUSTER, 8, iterations=20, time_budget_s=120, seed=1)
    labels = [t[0] for t in r.tried]
    assert any("defer-w" in x for x in labels) and any("room" in x for x in labels)
    assert r.plan.splits and r.step_ms <= min(t[1] for t in r.tried if t[1] is not None and t[2]) + 1e-9


def _opts():
    from octopipe_plugin.simulator import SimOptions

    return SimOptions()


class _Clock:
    """time.monotonic for the split search, moved by the test: one second per shard insertion."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_insertions_stop_at_their_deadline(monkeypatch):
    import octopipe_plugin.tuner.split as split

    head = MODEL.num_layers - 1
    rest = tune(MODEL, CLUSTER, 8, iterations=10, time_budget_s=120, seed=1).plan
    clock, real = _Clock(), split.insert_shards

    def timed(*a, **k):
        clock.now += 1.0
        return real(*a, **k)
    monkeypatch.setattr(split, "time", clock)
    monkeypatch.setattr(split, "insert_shards", timed)
    assert list(_insertions(MODEL, CLUSTER, head, None, rest, _opts(), "x", deadline=-1.0)) == []
    # each attempt is expected to take as long as the one before (1 s): those starting at 0, 1 and 2 s end by the
    # 3.5 s deadline, the one at 3 s would not
    assert len(list(_insertions(MODEL, CLUSTER, head, None, rest, _opts(), "x", deadline=3.5))) == 3
    clock.now = 0.0  # the whole split search at a spent budget: only the plan without splits
    r = tune_split(MODEL, CLUSTER, 8, iterations=10, seed=1, split_budget_s=0.0)
    assert not r.plan.splits and r.tried == (("no split", r.unsplit_ms, True),)
