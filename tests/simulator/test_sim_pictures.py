"""The Perfetto trace and the Gantt PNG carry what the simulation computed."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.formats import Cluster, Layer, Link, Model
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.gantt import write_png
from octopipe_plugin.simulator.trace import trace_document, write_trace


def setup(name="zb-v", p=3, m=5):
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + i % 2, bwd_ms=1.0, wgrad_ms=0.5,
                         state_bytes=2**30, activation_bytes=2**28, output_bytes=2**24) for i in range(2 * p))
    model = Model(name="t", layers=layers)
    link = Link(bandwidth_gb_per_s=10, latency_us=10)
    cluster = Cluster(num_devices=p, devices_per_node=2, memory_bytes=8 * 2**30, intra_node=link, inter_node=link)
    plan = build_plan(model, name, p, m)
    return model, cluster, plan, simulate(model, cluster, plan)


def test_trace_has_every_action_transfer_and_memory_step(tmp_path):
    model, cluster, plan, res = setup()
    path = tmp_path / "t.json"
    write_trace(model, cluster, plan, path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] != "transfer"]
    sends = [e for e in events if e["ph"] == "X" and e["cat"] == "transfer"]
    assert sorted((e["pid"], e["name"], e["ts"]) for e in compute) == sorted(
        (d, str(a), s * 1000) for d, row in enumerate(res.timeline) for a, s, _ in row)
    assert len(sends) == len(res.transfers) > 0
    for d in range(plan.num_devices):
        counter = [(e["ts"] / 1000, e["args"]["GiB"]) for e in events if e["ph"] == "C" and e["pid"] == d]
        assert counter == [(pytest.approx(t), pytest.approx(b / 2**30)) for t, b in res.memory_curve(d)]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"device {d}" for d in range(plan.num_devices)}
    assert doc["otherData"]["step_time_ms"] == pytest.approx(res.step_time_ms)


def test_trace_marks_the_critical_path():
    model, cluster, plan, res = setup("1f1b", 3, 4)
    doc = trace_document(model, cluster, plan, result=res)
    marked = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("critical_path")}
    assert marked == {str(a) for _, a in res.critical_path}


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_png_is_written(tmp_path, name):
    model, cluster, plan, res = setup(name, 3, 6)
    path = tmp_path / "g.png"
    write_png(model, cluster, plan, path, result=res)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_png_labels_layers_and_explains_shades_at_16_to_64_devices(tmp_path):
    """Each row names its device and the layer ranges of its stages; the legend says what the shades mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from octopipe_plugin.formats import Cluster, Layer, Link, Model
    from octopipe_plugin.headroom import Headroom, with_headroom
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.simulator.gantt import _legend, device_label, draw

    for nd in (16, 64):
        model = Model(name="flat", layers=tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0,
                                                      wgrad_ms=1.0, state_bytes=2**20, activation_bytes=2**20,
                                                      output_bytes=2**10) for i in range(2 * nd)))
        link = Link(bandwidth_gb_per_s=100, latency_us=1)
        cl = with_headroom(Cluster(num_devices=nd, devices_per_node=8, memory_bytes=2**30, intra_node=link,
                                   inter_node=link), Headroom(fraction=0.1))
        plan = build_plan(model, "zb-v", nd, nd)
        assert device_label(plan, 0) == f"dev 0  L0, L{2 * nd - 1}"
        res = simulate(model, cl, plan, detail=True)
        fig, ax = plt.subplots()
        draw(ax, plan, res, cl.memory_bytes, cl.usable_memory_bytes, cl.devices_per_node)
        _legend(ax, res, plan, headroom=True)
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels[1] == f"dev 1  L1, L{2 * nd - 2}" and len(labels) == nd
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("lighter shade: the device's 2nd stage" in t for t in legend)
        assert any("usable memory" in t for t in legend)
        plt.close(fig)
        path = tmp_path / f"g{nd}.png"
        write_png(model, cl, plan, path, result=res)
        assert path.read_bytes()[:4] == b"\x89PNG"
