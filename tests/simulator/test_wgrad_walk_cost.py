"""W's graph walk charged per stage (Layer.graph_nodes, Layer.walk_ms_per_node): hand-computed cases.

The split W walks the retained graph once per parameter group, each walk traversing the stage's nodes below
the layer (profile/measure.py), so a layer's W costs its `wgrad_ms` plus `walk_ms_per_node` times the
`graph_nodes` of the stage's layers below it; a fused B (one walk) and a stage's first layer pay nothing.
"""

from __future__ import annotations

import pytest

from octopipe_plugin.actions import Kind
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats import Layer, Model
from octopipe_plugin.formats.model import model_from_dict, model_to_dict
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator.costs import kind_durations, stage_costs


def model(walks, nodes=100, ratio=None) -> Model:
    return Model(name="m", layers=tuple(
        Layer(name=f"l{k}", kind="moe", fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=1.0, state_bytes=0, activation_bytes=1,
              output_bytes=1000, fused_ratio=ratio, graph_nodes=nodes, walk_ms_per_node=w)
        for k, w in enumerate(walks)))


def test_each_layer_pays_for_the_nodes_below_it_in_its_stage():
    m = model([0.01, 0.02, 0.03, 0.01, 0.02, 0.03])
    plan = build_plan(m, "1f1b", 2, 2)  # stages [0, 3) and [3, 6)
    dur = kind_durations(stage_costs(m, plan.stages))
    # per stage: 3 * 1.0 + 0.02 * 100 + 0.03 * 200 = 11.0; the second stage starts afresh (its input is cut)
    assert dur[Kind.W] == pytest.approx((11.0, 11.0))
    # I, F and the fused B keep their figures: B is one walk
    assert dur[Kind.I] == pytest.approx((6.0, 6.0)) and dur[Kind.F] == pytest.approx((3.0, 3.0))
    assert dur[Kind.B] == pytest.approx((9.0, 9.0))


def test_one_layer_stages_and_layers_without_the_figures_pay_nothing():
    m = model([0.5, 0.5])
    one = build_plan(m, "1f1b", 2, 2)  # a layer per stage: nothing below either
    assert kind_durations(stage_costs(m, one.stages))[Kind.W] == pytest.approx((1.0, 1.0))
    bare = model([None, None, None, None])
    two = build_plan(bare, "1f1b", 2, 2)
    assert stage_costs(bare, two.stages).fused is None  # exactly as before the rule: B = bwd + wgrad
    assert kind_durations(stage_costs(bare, two.stages))[Kind.W] == pytest.approx((2.0, 2.0))


def test_a_layer_without_nodes_adds_none_below():
    m = Model(name="m", layers=(
        Layer(name="emb", kind="embedding", fwd_ms=1.0, bwd_ms=0.0, wgrad_ms=1.0, state_bytes=0, activation_bytes=1,
              output_bytes=1000),
        *model([0.1, 0.1], nodes=10).layers))
    sc = stage_costs(m, build_plan(m, "1f1b", 1, 1).stages)
    assert sc.wgrad == pytest.approx((3.0 + 0.1 * 10,))  # the embedding records no nodes: only moe over moe


def test_the_figures_round_trip_and_bad_ones_are_refused():
    m = model([0.25, None], nodes=7)
    back = model_from_dict(model_to_dict(m))
    assert [(l.graph_nodes, l.walk_ms_per_node) for l in back.layers] == [(7, 0.25), (7, None)]
    assert "walk_ms_per_node" not in model_to_dict(model([None]))["layers"][0]
    doc = model_to_dict(m)
    doc["layers"][0]["graph_nodes"] = -1
    with pytest.raises(FormatError, match="graph_nodes"):
        model_from_dict(doc, "m.json")
