"""Moves keep layouts well-formed; bounds are below every plan; rebalancing lowers the busiest device's load."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings, strategies as st

from octopipe_plugin.formats import Model
from octopipe_plugin.partition import balanced_split
from octopipe_plugin.schedules.placement import place
from octopipe_plugin.tuner import Policy, Split, lower_bound
from octopipe_plugin.tuner.bounds import packing_bound, whole_layer_makespan
from octopipe_plugin.tuner.layout import Layout
from octopipe_plugin.tuner.moves import MOVES, Context, rebalance, transfer

from tuner_helpers import layer


def _model(costs):
    return Model(name="m", layers=tuple(layer(i, c) for i, c in enumerate(costs)))


def _well_formed(layout: Layout, n: int, devices: int):
    assert layout.bounds[0][0] == 0 and layout.bounds[-1][1] == n
    for (a, b), (c, _) in zip(layout.bounds, layout.bounds[1:]):
        assert b == c and a <= b
    assert all(0 <= d < devices for d in layout.devices)


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.floats(0.1, 5), min_size=8, max_size=20), devices=st.integers(2, 4),
       v=st.integers(1, 2), seed=st.integers(0, 1000))
def test_every_move_yields_a_well_formed_candidate(costs, devices, v, seed):
    model = _model(costs)
    layout = Layout(bounds=tuple(balanced_split(model, devices * v)),
                    devices=tuple(place("v" if v == 2 else "looped", devices, v)))
    pol = Policy(depth=(4,) * devices, split=(Split.AUTO,) * devices, w_limit=(2,) * devices)
    ctx = Context.of(model, devices, 4)
    rng = random.Random(seed)
    for move, _ in MOVES:
        for spec in (pol, tuple(() for _ in range(devices))):
            out = move(rng, ctx, layout, spec)
            if out is not None:
                _well_formed(out[0], len(costs), devices)
                assert len(out[0].devices) == layout.num_stages


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.floats(0.1, 5), min_size=8, max_size=24), devices=st.integers(2, 5))
# costs equal to 9 decimals: the exact packing once priced their kind at the rounded cost, 1e-9 above a real plan
@example(costs=[1.0, 1.2828596901946012, 1.974296031895249, 0.5, 1.0, 3.0, 0.5, 0.974296031895249], devices=2)
def test_rebalance_never_raises_the_busiest_load(costs, devices):
    model = _model(costs)
    layout = Layout(bounds=tuple(balanced_split(model, 2 * devices)), devices=tuple(place("v", devices, 2)))
    ctx = Context.of(model, devices, 1)
    better = rebalance(model, layout, devices)
    _well_formed(better, len(costs), devices)
    assert max(ctx.loads(better)) <= max(ctx.loads(layout)) + 1e-9
    # no stage-per-device assignment beats the packing bound
    assert max(ctx.loads(better)) >= packing_bound(model, devices, 1) - 1e-9


def test_transfer_moves_one_layer_between_far_stages():
    layout = Layout(bounds=((0, 2), (2, 4), (4, 6), (6, 8)), devices=(0, 1, 2, 3))
    moved = transfer(layout, 3, 0)  # stage 3 gives its first layer, stage 0 gains one at its end
    assert moved.bounds == ((0, 3), (3, 5), (5, 7), (7, 8))
    assert transfer(layout, 0, 2).bounds == ((0, 1), (1, 3), (3, 6), (6, 8))
    v_layout = Layout(bounds=layout.bounds, devices=(0, 1, 1, 0))
    assert transfer(v_layout, 0, 3) is None  # same device
    assert transfer(Layout(bounds=((0, 1), (1, 8)), devices=(0, 1)), 0, 1) is None  # would empty stage 0


def test_bounds_on_known_model():
    model = _model([1.0, 1.0, 1.0, 1.0, 1.0, 4.0])  # totals 3, ..., 12 per layer (F = I = W)
    lb = lower_bound(model, 3, 2)
    assert lb.work_ms == 2 * 27 / 3 and lb.layer_ms == 2 * 12 and lb.value_ms == 24
    # 6 layers on 3 devices: the 5 cheap ones spread so that one device holds two of them
    assert packing_bound(model, 3, 2) == 24
    assert packing_bound(_model([1.0] * 7), 3, 1) == 9  # 7 equal layers: some device runs 3


def test_packing_bound_sees_what_the_thresholds_miss():
    # 6 layers of two kinds on 4 devices: two devices hold two layers, and no two fit under 36 (21 + 15)
    model = _model([7.0, 7.0, 7.0, 5.0, 5.0, 5.0])
    assert packing_bound(model, 4, 1) == pytest.approx(36.0)
    assert whole_layer_makespan([3.0 * c for c in range(1, 40)], 8) is None  # too many distinct costs to search


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.sampled_from([1.0, 2.0, 3.5, 5.0]), min_size=1, max_size=7), devices=st.integers(1, 3))
def test_whole_layer_makespan_equals_every_assignment_tried(sizes, devices):
    best = min(max(sum(s for s, d in zip(sizes, where) if d == k) for k in range(devices))
               for where in itertools.product(range(devices), repeat=len(sizes)))
    assert whole_layer_makespan(sizes, devices) == pytest.approx(best)
