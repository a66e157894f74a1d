"""`octopipe simulate` and `octopipe schedules` end to end, on model/cluster files under tests/data."""

from __future__ import annotations

import json
import os

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import read_cluster, read_model, read_plan
from octopipe_plugin.schedules.registry import SCHEDULES, build_plan
from octopipe_plugin.simulator import SimOptions, simulate

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")
MODEL = os.path.join(DATA, "sim_uniform8.model.json")  # 8 layers, F = I = W = 1 ms, no output bytes
CLUSTER = os.path.join(DATA, "sim_flat8.cluster.json")  # 8 devices, 4 per node, 16 GiB each


def simulate_cli(capsys, *extra, expect: int = 0) -> str:
    rc = main(["simulate", "--model", MODEL, "--cluster", CLUSTER, *extra])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if rc == 0 else err


def test_schedules_lists_the_registry(capsys):
    assert main(["schedules"]) == 0
    out = capsys.readouterr().out
    for name, spec in SCHEDULES.items():
        assert name in out and spec.requirements in out
    assert main(["schedules", "--json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == set(SCHEDULES)


def test_table_report_for_1f1b(capsys):
    # 2 layers per stage: F = 2, B = 4; four devices in one node with free links: (8 + 3) * 6 = 66 ms.
    out = simulate_cli(capsys, "--schedule", "1f1b", "--devices", "4", "--microbatches", "8")
    assert "step time   66.000 ms" in out and "bubble      27.27%" in out
    assert "micro-batches/s" in out  # the model file does not say its micro-batch size
    assert out.count("yes") == 4  # 2 GiB state + <= 2 GiB activations fits 16 GiB


def test_json_report(capsys):
    out = simulate_cli(capsys, "--schedule", "interleaved-1f1b", "--devices", "4", "--microbatches", "8",
                       "--stages-per-device", "2", "--json")
    r = json.loads(out)
    assert r["step_time_ms"] == pytest.approx((8 + 3 / 2) * 6)
    assert r["num_stages"] == 8 and len(r["devices"]) == 4
    assert r["throughput"]["microbatches_per_s"] == pytest.approx(8 * 1000 / r["step_time_ms"])
    assert r["devices"][0]["peak_memory_bytes"] == 2 * 2**30 + 11 * 2**28  # 11 live stage activations
    assert all(0 < d["utilisation"] <= 1 for d in r["devices"])


def test_switches_reach_the_simulator(capsys):
    model, cluster = read_model(MODEL), read_cluster(CLUSTER)
    plan = build_plan(model, "zb-v", 8, 8, 2)
    want = simulate(model, cluster, plan, SimOptions(contention=True, overlap=False, launch_ms=0.05))
    out = simulate_cli(capsys, "--schedule", "zb-v", "--devices", "8", "--microbatches", "8", "--contention",
                       "--no-overlap", "--launch-us", "50", "--json")
    assert json.loads(out)["step_time_ms"] == pytest.approx(want.step_time_ms)
    plain = json.loads(simulate_cli(capsys, "--schedule", "zb-v", "--devices", "8", "--microbatches", "8", "--json"))
    assert plain["step_time_ms"] < want.step_time_ms  # devices 3 -> 4 cross nodes: 100 us latency and more


def test_save_plan_then_simulate_it(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    first = json.loads(simulate_cli(capsys, "--schedule", "zb-h1", "--devices", "4", "--microbatches", "6",
                                    "--split", "balanced", "--save-plan", str(saved), "--json"))
    plan = read_plan(str(saved))
    assert plan.predicted["step_time_ms"] == pytest.approx(first["step_time_ms"])
    err = simulate_cli(capsys, "--plan", str(saved), expect=2)  # a 4-device plan, an 8-device cluster
    assert "is for 4 devices but --cluster" in err and "has 8" in err and "--devices 4" in err
    again = json.loads(simulate_cli(capsys, "--plan", str(saved), "--devices", "4", "--json"))
    assert again["step_time_ms"] == pytest.approx(first["step_time_ms"]) and again["schedule"] == "zb-h1"


def test_trace_and_png(capsys, tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    simulate_cli(capsys, "--schedule", "dualpipev", "--devices", "2", "--microbatches", "4", "--trace", str(trace),
                 "--png", str(png))
    doc = json.loads(trace.read_text())
    compute = [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") != "transfer"]
    assert len(compute) == sum(len(r) for r in build_plan(read_model(MODEL), "dualpipev", 2, 4).schedule)
    assert {e["pid"] for e in compute} == {0, 1}
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in doc["traceEvents"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--schedule", "zb-v", "--devices", "4", "--microbatches", "8", "--stages-per-device", "1"], "exactly 2"),
    (["--schedule", "dualpipev", "--devices", "4", "--microbatches", "4"], "at least 8 micro-batches"),
    (["--schedule", "1f1b", "--devices", "4"], "needs --microbatches"),
    (["--schedule", "1f1b", "--devices", "16", "--microbatches", "4"], "cluster flat8 has only 8"),
    (["--schedule", "1f1b", "--microbatches", "4", "--launch-us", "-1"], "--launch-us"),
])
def test_bad_requests_are_one_line_errors(capsys, args, message):
    err = simulate_cli(capsys, *args, expect=2)
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_plan_flags_do_not_mix(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    simulate_cli(capsys, "--schedule", "1f1b", "--devices", "2", "--microbatches", "2", "--save-plan", str(saved))
    err = simulate_cli(capsys, "--plan", str(saved), "--microbatches", "2", expect=2)
    assert "--microbatches applies to --schedule" in err


def test_zoo_model_reports_samples_per_second(capsys):
    pytest.importorskip("octopipe_plugin.costs")
    rc = main(["simulate", "--model", "llama3-8b", "--cluster", "h100x8", "--schedule", "interleaved-1f1b",
               "--devices", "4", "--microbatches", "8", "--stages-per-device", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["throughput"]["samples_per_s"] > 0 and r["step_time_ms"] > 0
