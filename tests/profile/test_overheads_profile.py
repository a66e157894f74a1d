"""`octopipe profile --overheads` on 2 gloo ranks: a well-formed, cached overheads file that simulate charges."""

from __future__ import annotations

import json
import os

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats.overheads import read_overheads

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
MODEL = os.path.join(DATA, "sim_uniform8.model.json")  # 8 layers, F = I = W = 1 ms, no output bytes
CLUSTER = os.path.join(DATA, "sim_flat8.cluster.json")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_profile_overheads_writes_a_cached_file_on_two_ranks(tmp_path, capsys):
    out = tmp_path / "ov.json"
    cache = tmp_path / "cache"
    args = ["profile", "--overheads", "-o", str(out), "--repeats", "4", "--warmup", "1", "--cache-dir", str(cache)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "per action:" in text and "per message: sender" in text and "busy sender's delivery" in text
    ov = read_overheads(out)
    assert ov.backend == "gloo" and ov.device.endswith("x1 threads")
    assert {k for k, _ in ov.action_ms} == {"F", "B", "I", "W"}
    assert all(ms >= 0 for _, ms in ov.action_ms) and ov.send.fixed_ms >= 0 and ov.recv.fixed_ms >= 0
    doc = json.loads(out.read_text())
    assert len(doc["meta"]["message_points"]["bytes"]) == 3 and len(doc["meta"]["gap_us"]) == 2
    # the busy sender's delivery delay: receiver waits from a busy and from an idle sender at every size, fitted
    assert len(doc["meta"]["message_points"]["busy_wait_us"]) == len(doc["meta"]["message_points"]["idle_wait_us"]) == 3
    assert ov.delivery.fixed_ms >= 0 and ov.delivery.per_mb_ms >= 0 and "delivery_us" in doc
    # an all-gather round over the 2 ranks at every size: it costs the host something (a gloo round trip)
    assert len(doc["meta"]["gather_round_us"]) == 3 and all(us > 0 for us in doc["meta"]["gather_round_us"])
    assert ov.gather_round.ms(4096) > 0 and "all-gather:" in text
    (record,) = cache.glob("*.json")
    stamp = record.stat().st_mtime_ns
    # the second run reads the cache: same figures, the record untouched
    again = tmp_path / "again.json"
    assert main(args[:3] + [str(again)] + args[4:]) == 0
    assert read_overheads(again) == ov and record.stat().st_mtime_ns == stamp


def test_simulate_charges_an_overheads_file(tmp_path, capsys):
    path = tmp_path / "ov.json"
    path.write_text(json.dumps({"format": "octopipe-overheads/1", "action_us": {"F": 100.0, "B": 200.0},
                                "send_us": {"fixed": 0.0}, "recv_us": {"fixed": 0.0}}))
    base = ["simulate", "--model", MODEL, "--cluster", CLUSTER, "--schedule", "gpipe", "--devices", "1",
            "--microbatches", "2", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["step_time_ms"]
    assert main(base + ["--overheads", str(path)]) == 0
    # one device, 2 micro-batches: 2 F and 2 B actions, each paying its kind's cost
    assert json.loads(capsys.readouterr().out)["step_time_ms"] == pytest.approx(plain + 2 * 0.1 + 2 * 0.2)


def test_profile_needs_a_model_or_overheads(capsys):
    assert main(["profile"]) == 2
    assert "--overheads" in capsys.readouterr().err


def test_plan_tunes_with_the_overheads_it_is_judged_by(tmp_path, capsys):
    path = tmp_path / "ov.json"
    path.write_text(json.dumps({"format": "octopipe-overheads/1", "action_us": {"F": 300.0, "I": 300.0, "W": 300.0},
                                "send_us": {"fixed": 100.0}, "recv_us": {"fixed": 100.0}}))
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--microbatches", "4", "--time-budget", "2",
                 "--iterations", "50", "--overheads", str(path), "-o", str(plan), "--no-progress"]) == 0
    capsys.readouterr()
    predicted = json.loads(plan.read_text())["predicted"]["step_time_ms"]
    assert main(["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", str(plan), "--overheads", str(path),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_ms"] == pytest.approx(predicted)
    assert main(["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_ms"] < predicted
