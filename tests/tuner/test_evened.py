"""Evened layouts (tuner/evened.py): boundaries that bring the busiest device down where one-layer greedy moves
stick, checked against every boundary choice; their plans are list-scheduled afresh and the split search tries them."""

from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from octopipe_plugin.formats import Model, Plan, Stage, validate_plan
from octopipe_plugin.schedules.placement import place
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner.evened import evened_layout, evened_plans
from octopipe_plugin.tuner.layout import Layout
from octopipe_plugin.tuner.split import tune_split

from tuner_helpers import cluster, layer


def _loads(costs, lay: Layout, nd: int) -> list[float]:
    out = [0.0] * nd
    for (a, b), d in zip(lay.bounds, lay.devices):
        out[d] += sum(costs[a:b])
    return out


def _optimum(costs, devices, nd: int) -> float:
    """The least busiest-device load over every choice of non-empty contiguous stages (the oracle)."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), len(devices) - 1):
        b = [0, *cuts, n]
        best = min(best, max(_loads(costs, Layout(bounds=tuple(zip(b, b[1:])), devices=devices), nd)))
    return best


def _encoder_then_decoder():
    # six small encoder layers in stage 0, then eight decoder layers one per stage: one stage holds two
    costs = [1.0] * 6 + [4.0] * 8
    devices = tuple(place("looped", 4, 2))
    start = Layout(bounds=((0, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11), (11, 12), (12, 14)), devices=devices)
    return costs, devices, start


def test_an_encoder_in_one_stage_is_spread_so_every_device_holds_as_many_decoder_layers():
    costs, devices, start = _encoder_then_decoder()
    assert max(_loads(costs, start, 4)) == 12.0
    lay = evened_layout(costs, start)
    assert lay.devices == devices and all(a < b for a, b in lay.bounds)
    assert max(_loads(costs, lay, 4)) == _optimum(costs, devices, 4) == 10.0


@settings(max_examples=60, deadline=None)
@given(data=st.data(), nd=st.integers(2, 3), v=st.integers(1, 3), placement=st.sampled_from(["looped", "v"]))
def test_evened_layouts_are_well_formed_lower_the_busiest_device_and_never_pass_the_optimum(data, nd, v, placement):
    devices = tuple(place(placement if v == 2 else "looped", nd, v))
    n = data.draw(st.integers(len(devices), 11))
    costs = data.draw(st.lists(st.sampled_from([0.3, 1.0, 4.0]), min_size=n, max_size=n))
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=len(devices) - 1, max_size=len(devices) - 1,
                                     unique=True)))
    bounds = [0, *cuts, n]
    start = Layout(bounds=tuple(zip(bounds, bounds[1:])), devices=devices)
    lay = evened_layout(costs, start)
    if lay is None:
        return
    assert lay.devices == devices and lay.bounds[0][0] == 0 and lay.bounds[-1][1] == n
    assert all(a < b for a, b in lay.bounds) and all(b == c for (_, b), (c, _) in zip(lay.bounds, lay.bounds[1:]))
    assert max(_loads(costs, lay, nd)) < max(_loads(costs, start, nd))
    assert max(_loads(costs, lay, nd)) >= _optimum(costs, devices, nd) - 1e-9


def _vlm_like() -> Model:
    # a vision encoder of small layers, an embedding, decoder layers and a heavy LM head (its work left to shards)
    layers = [layer(i, 0.25) for i in range(6)] + [layer(6, 0.1, kind="embedding")]
    layers += [layer(7 + i, 1.0) for i in range(8)] + [layer(15, 6.0, kind="lm_head")]
    return Model(name="vlm-like", layers=tuple(layers))


def test_evened_plans_are_valid_list_scheduled_plans_of_the_evened_layout():
    model, cl = _vlm_like(), cluster(4)
    devices = tuple(place("looped", 4, 2))
    bounds = ((0, 7), (7, 8), (8, 9), (9, 10), (10, 11), (11, 12), (12, 13), (13, 16))
    plan = Plan(model="vlm-like", num_devices=4, num_microbatches=8,
                stages=tuple(Stage(start=a, end=b, device=d) for (a, b), d in zip(bounds, devices)),
                schedule=((),) * 4)
    costs = [0.0 if i == 15 else x.total_ms for i, x in enumerate(model.layers)]
    want = evened_layout(costs, Layout(bounds=bounds, devices=devices))
    plans = evened_plans(model, cl, 8, plan, costs)
    assert want is not None and plans
    for p in plans:
        assert tuple((s.start, s.end) for s in p.stages) == want.bounds
        validate_plan(p, model.num_layers)
        assert simulate(model, cl, p).step_time_ms > 0


def test_the_split_search_tries_evened_layouts_and_stays_no_slower():
    model, cl = _vlm_like(), cluster(4)
    r = tune_split(model, cl, 8, iterations=20, time_budget_s=120, seed=0)
    assert r.step_ms <= r.unsplit_ms
    assert any("evened" in label for label, _, _ in r.tried), [t[0] for t in r.tried]
