"""A tied embedding and LM head split over the same devices in the same shares hold one weight per row range."""

from __future__ import annotations

import pytest

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats import Model, Plan, Stage, model_from_dict, model_to_dict
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.simulator import simulate
from tests.simulator.test_sim_split import cluster, layer

LAYERS = (layer("embedding", 1, 0, 1, state=800, act=40), layer("dense", 1, 1, 1, state=10),
          layer("lm_head", 2, 2, 2, state=1000, act=100))


def plan(emb_shares=(0.5, 0.5), head_shares=(0.5, 0.5)) -> Plan:
    rows = [["0E0", "0F0", "1H0", "1J0", "0B0", "0G0", "1K0"], ["0E0", "1F0", "1H0", "1J0", "1B0", "1K0", "0G0"]]
    return Plan(model="tied", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=2, device=0), Stage(start=2, end=3, device=1)),
                schedule=parse_schedule(rows),
                splits=(SplitLayer(layer=0, devices=(0, 1), shares=emb_shares),
                        SplitLayer(layer=2, devices=(0, 1), shares=head_shares)))


def test_tied_pair_on_the_same_shards_is_counted_once():
    tied = Model(name="tied", layers=LAYERS, tied=((0, 2),))
    untied = Model(name="tied", layers=LAYERS)
    # device 0 holds stage 0's dense layer (10) besides its shards; the larger of the pair counts
    assert simulate(tied, cluster(), plan()).static_bytes == [10 + 500, 500]
    assert simulate(untied, cluster(), plan()).static_bytes == [10 + 400 + 500, 400 + 500]
    # the step does not change: tying is memory only
    assert simulate(tied, cluster(), plan()).step_time_ms == simulate(untied, cluster(), plan()).step_time_ms


def test_tied_pair_in_different_shares_holds_both():
    tied = Model(name="tied", layers=LAYERS, tied=((0, 2),))
    res = simulate(tied, cluster(), plan(emb_shares=(0.25, 0.75)))
    assert res.static_bytes == [10 + 200 + 500, 600 + 500]


def test_tied_round_trips_and_bad_pairs_are_refused():
    m = Model(name="tied", layers=LAYERS, tied=((0, 2),))
    doc = model_to_dict(m)
    assert doc["tied"] == [[0, 2]] and model_from_dict(doc).tied == ((0, 2),)
    assert "tied" not in model_to_dict(Model(name="t", layers=LAYERS))
    for bad, what in (([[0, 5]], r"\$\.tied\[0\]\[1\]"), ([[1, 1]], "two different layers"), ([0], "a pair")):
        with pytest.raises(FormatError, match=what) as exc:
            model_from_dict({**doc, "tied": bad}, "m.json")
        assert "m.json" in str(exc.value)
