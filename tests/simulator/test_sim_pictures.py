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
