"""The profiled memory fields of a model (docs/formats.md, Model): `recompute_ms`, `selective`, `host_link_gb_per_s`
read, written and refused in one line, and what the memory model prices from them (hand-computed)."""

from __future__ import annotations

import pytest

from octopipe_plugin.errors import FormatError, PlanError
from octopipe_plugin.formats import Cluster, Link, model_from_dict, model_to_dict
from octopipe_plugin.formats.memory import RECOMPUTE, SELECTIVE, MemoryChoice
from octopipe_plugin.gpus import GPUS
from octopipe_plugin.simulator.costs import layer_memory

ACT = 1000


def _doc(**layer0) -> dict:
    base = {"name": "l", "kind": "dense", "fwd_ms": 4.0, "bwd_ms": 4.0, "wgrad_ms": 4.0, "state_bytes": 10,
            "activation_bytes": ACT, "output_bytes": 100}
    return {"format": "octopipe-model/1", "name": "m", "layers": [{**base, **layer0}, dict(base)]}


def test_the_fields_round_trip():
    doc = _doc(recompute_ms=1.5, selective={"core_attn": {"freed_bytes": 300, "rerun_ms": 0.25},
                                            "mlp": {"freed_bytes": 500, "rerun_ms": 1.0}})
    doc["host_link_gb_per_s"] = 12.5
    model = model_from_dict(doc, "m.json")
    lay = model.layers[0]
    assert lay.recompute_ms == 1.5 and model.host_link_gb_per_s == 12.5
    assert {(c.module, c.freed_bytes, c.rerun_ms) for c in lay.selective} == {("core_attn", 300, 0.25),
                                                                            ("mlp", 500, 1.0)}
    assert model.layers[1].recompute_ms is None and model.layers[1].selective == ()
    again = model_from_dict(model_to_dict(model), "again.json")
    assert again == model


@pytest.mark.parametrize("edit, where", [
    (dict(recompute_ms=-1.0), r"\$\.layers\[0\]\.recompute_ms"),
    (dict(selective={"attention": {"freed_bytes": 1, "rerun_ms": 0.1}}), r"\$\.layers\[0\]\.selective\.attention"),
    (dict(selective={"mlp": {"freed_bytes": ACT + 1, "rerun_ms": 0.1}}), r"\$\.layers\[0\]\.selective\.mlp"),
    (dict(selective={"mlp": {"freed_bytes": 1}}), r"\$\.layers\[0\]\.selective\.mlp"),
])
def test_bad_fields_are_refused_naming_the_path(edit, where):
    with pytest.raises(FormatError, match=rf"m\.json.*{where}"):
        model_from_dict(_doc(**edit), "m.json")


def test_a_bad_host_link_is_refused():
    doc = _doc()
    doc["host_link_gb_per_s"] = 0.0
    with pytest.raises(FormatError, match=r"m\.json.*\$\.host_link_gb_per_s"):
        model_from_dict(doc, "m.json")


def test_recompute_reruns_the_measured_time_and_selective_the_measured_modules():
    model = model_from_dict(_doc(recompute_ms=1.5, selective={"core_attn": {"freed_bytes": 300, "rerun_ms": 0.25},
                                                              "mlp": {"freed_bytes": 800, "rerun_ms": 1.0}}), "m.json")
    kept, rerun, back, off = layer_memory(model, 0, MemoryChoice(RECOMPUTE))
    # recompute keeps the layer's input (layer 0: what it saves) and re-runs the measured 1.5 ms, not fwd_ms 4.0
    assert (kept, rerun, back, off) == (ACT, 1.5, 0, 0)
    kept, rerun, back, _ = layer_memory(model, 1, MemoryChoice(RECOMPUTE))
    assert (kept, rerun, back) == (100, 4.0, ACT - 100)  # no measured re-run: the forward's time; keeps its input
    kept, rerun, back, _ = layer_memory(model, 0, MemoryChoice(SELECTIVE, ("core_attn",)))
    assert (kept, rerun, back) == (ACT - 300, 0.25, 300)
    kept, rerun, back, _ = layer_memory(model, 0, MemoryChoice(SELECTIVE, ("core_attn", "mlp")))
    assert (kept, rerun, back) == (0, 1.25, ACT)  # the two free 1100 bytes of 1000: capped at the activation
    with pytest.raises(PlanError, match=r"selective:moe_act on layer 0 .*whose profile measured no moe_act"):
        layer_memory(model, 0, MemoryChoice(SELECTIVE, ("moe_act",)))


def test_the_host_rate_is_the_clusters_then_the_profiles_then_the_gpus():
    link = Link(bandwidth_gb_per_s=100.0, latency_us=1.0)
    plain = Cluster(num_devices=2, devices_per_node=2, memory_bytes=1 << 30, intra_node=link, inter_node=link)
    said = Cluster(num_devices=2, devices_per_node=2, memory_bytes=1 << 30, intra_node=link, inter_node=link,
                   host_link_gb_per_s=20.0)
    assert said.host_rate(12.5) == 20.0
    assert plain.host_rate(12.5) == 12.5
    assert plain.host_rate() == GPUS["H100-SXM"].host_link_gb_per_s
    assert plain.host_copy_ms(25e9, 12.5) == pytest.approx(2000.0)
