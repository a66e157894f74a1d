"""ModelGraph: DAG from Model.inputs, topological order, bytes across cuts, per-kind summaries, heaviest layer."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import Layer, Model
from octopipe_plugin.graph import ModelGraph


def layer(name, kind, ms, out=10, state=100, act=1000):
    return Layer(name=name, kind=kind, fwd_ms=ms, bwd_ms=ms, wgrad_ms=ms, state_bytes=state, activation_bytes=act,
                 output_bytes=out)


def encoder_decoder() -> Model:
    # enc0 -> enc1 -> proj ─┐
    #               emb ────┴-> dec0 -> dec1 -> head
    layers = (layer("enc0", "vision", 1, out=5), layer("enc1", "vision", 1, out=5), layer("proj", "projector", 1, out=7),
              layer("emb", "embedding", 0.5, out=11), layer("dec0", "dense", 3, out=20), layer("dec1", "dense", 3, out=20),
              layer("head", "lm_head", 9, out=4))
    return Model(name="ed", layers=layers, inputs={3: (), 4: (2, 3)})


def test_chain_model_is_a_path_graph():
    model = Model(name="c", layers=tuple(layer(f"l{i}", "dense", 1) for i in range(5)))
    g = ModelGraph(model)
    assert g.is_chain and g.order == (0, 1, 2, 3, 4) and g.sources() == [0]
    assert nx.is_isomorphic(g.graph, nx.path_graph(5, create_using=nx.DiGraph))
    assert [g.cut_bytes(b) for b in range(1, 5)] == [10] * 4


def test_branch_edges_order_and_cut_bytes():
    g = ModelGraph(encoder_decoder())
    assert not g.is_chain
    assert set(g.graph.edges) == {(0, 1), (1, 2), (2, 4), (3, 4), (4, 5), (5, 6)}
    assert g.order == tuple(range(7)) and g.sources() == [0, 3]
    assert g.cut_bytes(3) == 7  # after the projector: only its output is live
    assert g.cut_bytes(4) == 7 + 11  # before dec0: projector and embedding outputs both cross
    assert g.cut_bytes(5) == 20
    chain = g.as_chain()
    assert [x.output_bytes for x in chain.layers] == [5, 5, 7, 18, 20, 20, 4]


def test_kind_summaries_and_heaviest():
    g = ModelGraph(encoder_decoder())
    summary = {k.kind: k for k in g.kind_summaries()}
    assert list(summary) == ["vision", "projector", "embedding", "dense", "lm_head"]
    assert summary["dense"].count == 2 and summary["dense"].fwd_ms == 3 and summary["dense"].total_ms == 18
    h = g.heaviest()
    assert h.layer.name == "head" and h.ratio_to_median == pytest.approx(27 / 3)
    assert g.totals()["fwd_ms"] == pytest.approx(18.5)


def test_consumer_before_producer_is_refused():
    model = Model(name="bad", layers=(layer("a", "dense", 1), layer("b", "dense", 1)), inputs={0: (1,)})
    with pytest.raises(OctoPipeError, match="layer 0 consumes layer 1"):
        ModelGraph(model).graph


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_dags_topological_order_respects_edges(data):
    n = data.draw(st.integers(2, 12))
    inputs = {}
    for i in range(1, n):
        if data.draw(st.booleans()):
            inputs[i] = tuple(sorted(data.draw(st.sets(st.integers(0, i - 1), max_size=3))))
    model = Model(name="r", layers=tuple(layer(f"l{i}", "dense", 1, out=i + 1) for i in range(n)), inputs=inputs)
    g = ModelGraph(model)
    pos = {v: k for k, v in enumerate(g.order)}
    assert all(pos[p] < pos[c] for p, c in g.graph.edges)
    for b in range(1, n):  # a cut's bytes: each live producer's output once
        live = {p for p, c in g.graph.edges if p < b <= c}
        assert g.cut_bytes(b) == sum(p + 1 for p in live)
