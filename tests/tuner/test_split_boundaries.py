"""Stage boundaries chosen with the split: moves keep each device's load, and the search judges them."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import Layer, Model, Stage
from octopipe_plugin.tuner.split import _boundary_moves, _follow, _rebalanced, tune_split

from test_tune_split import cluster, model


def chain(costs) -> Model:
    return Model(name="chain", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=c, bwd_ms=0.0, wgrad_ms=0.0, state_bytes=1, activation_bytes=1,
              output_bytes=1) for i, c in enumerate(costs)))


def stages(*cuts):
    bounds = list(cuts)
    return tuple(Stage(start=a, end=b, device=d) for d, (a, b) in enumerate(zip(bounds, bounds[1:])))


def test_shares_follow_the_moved_layers_so_every_devices_load_stays():
    old, new = [4.0, 2.0, 2.0], [3.0, 3.0, 2.0]  # a layer of 1 ms moved from device 0 to device 1
    shares = _follow([0.25, 0.25, 0.5], old, new, head_ms=4.0)
    assert shares == pytest.approx([0.5, 0.0, 0.5])  # device 0 takes 1 ms of head work, device 1 gives it up
    loads = [w + s * 4.0 for w, s in zip(new, shares)]
    assert loads == pytest.approx([w + s * 4.0 for w, s in zip(old, [0.25, 0.25, 0.5])])


def test_rebalance_moves_layers_off_the_heaviest_device_with_its_share():
    rest = chain([1.0] * 6 + [0.0])  # the last layer is the head, its work left to the shards
    # device 0 holds 4 layers and device 1 two: with no head share, one layer moves over
    moved = _rebalanced(rest, stages(0, 4, 7), [0.5, 0.5], head_ms=0.0)
    assert [(s.start, s.end) for s in moved] == [(0, 3), (3, 7)]
    # a device whose share already evens the loads: nothing lowers the heaviest, no move
    assert _rebalanced(rest, stages(0, 4, 7), [0.0, 1.0], head_ms=2.0) is None
    # the head's owner keeps the head
    for _, st in _boundary_moves(rest, stages(0, 6, 7), [0.5, 0.5], 0.0):
        assert st[-1].start <= 6 < st[-1].end


def test_the_split_search_judges_boundary_moves_and_stays_no_slower():
    m = model(3.0)
    r = tune_split(m, cluster(), 8, iterations=20, time_budget_s=120, seed=1)
    labels = [t[0] for t in r.tried]
    assert any(" cut " in x or "rebalance" in x for x in labels), labels
    assert r.step_ms <= r.unsplit_ms
