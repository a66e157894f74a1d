"""`octopipe plan`: summary and comparison table, JSON, plan file with predictions, clear errors."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import Cluster, Layer, Link, Model, read_plan, validate_plan, write_cluster, write_model
from octopipe_plugin.simulator import simulate

GIB = 2**30


@pytest.fixture()
def files(tmp_path):
    layers = [Layer(name="emb", kind="embedding", fwd_ms=0.2, bwd_ms=0.1, wgrad_ms=0.3, state_bytes=GIB,
                    activation_bytes=GIB, output_bytes=2**20)]
    layers += [Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + (i % 3), bwd_ms=1.0 + (i % 3), wgrad_ms=1.0,
                     state_bytes=GIB, activation_bytes=GIB, output_bytes=2**20) for i in range(9)]
    layers += [Layer(name="head", kind="lm_head", fwd_ms=4.0, bwd_ms=4.0, wgrad_ms=4.0, state_bytes=2 * GIB,
                     activation_bytes=GIB, output_bytes=2**20)]
    model = Model(name="cli-model", layers=tuple(layers))
    cl = Cluster(num_devices=4, devices_per_node=4, memory_bytes=40 * GIB,
                 intra_node=Link(bandwidth_gb_per_s=400, latency_us=1), inter_node=Link(bandwidth_gb_per_s=50,
                                                                                         latency_us=5))
    mpath, cpath = tmp_path / "model.json", tmp_path / "cluster.json"
    write_model(model, mpath)
    write_cluster(cl, cpath)
    return model, cl, str(mpath), str(cpath), tmp_path


def _args(mpath, cpath, *extra):
    # whole layers: the split search's default is tests/cli/test_plan_splits_cli.py's
    return ["plan", "--model", mpath, "--cluster", cpath, "--microbatches", "8", "--iterations", "60",
            "--no-progress", "--splits", "off", *extra]


def test_table_and_plan_file(files, capsys):
    model, cl, mpath, cpath, tmp = files
    out_plan = tmp / "plan.json"
    assert main(_args(mpath, cpath, "-o", str(out_plan))) == 0
    text = capsys.readouterr().out
    assert "OctoPipe plan for cli-model" in text and "faster than Megatron interleaved 1F1B" in text
    for name in ("gpipe (megatron)", "1f1b (balanced)", "interleaved-1f1b (megatron)", "zb-h1", "zb-v",
                 "interleaved-zb (balanced)", "dualpipev (balanced)", "baseline"):
        assert name in text
    plan = read_plan(out_plan, model.num_layers)
    validate_plan(plan, model.num_layers)
    res = simulate(model, cl, plan)
    assert plan.predicted["step_time_ms"] == pytest.approx(res.step_time_ms, abs=1e-5)
    assert plan.predicted["peak_memory_bytes"] == res.peak_memory_bytes


def test_png_is_written(files, tmp_path):
    _, _, mpath, cpath, _ = files
    png = tmp_path / "plan.png"
    assert main(_args(mpath, cpath, "--png", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_output_is_deterministic(files, capsys):
    _, _, mpath, cpath, _ = files
    assert main(_args(mpath, cpath, "--json", "--seed", "3")) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(_args(mpath, cpath, "--json", "--seed", "3")) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["plan"]["schedule"] == second["plan"]["schedule"]
    assert first["step_time_ms"] == second["step_time_ms"]
    assert first["speedup_over_baseline"] >= 1.0
    rows = {r["label"]: r for r in first["comparison"]}
    assert rows["OctoPipe (tuned)"]["step_ms"] == first["step_time_ms"]
    best = min(r["step_ms"] for r in first["comparison"][1:] if r["step_ms"] is not None and r["fits"])
    assert first["step_time_ms"] <= best + 1e-9


def test_bad_input_is_one_line_error(files, capsys):
    _, _, mpath, cpath, _ = files
    assert main(["plan", "--model", mpath, "--cluster", cpath, "--microbatches", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "argument --microbatches: expected an integer in 1..1000000, got 0" in err and "Traceback" not in err


def test_out_of_memory_is_reported(files, capsys, tmp_path):
    model, cl, mpath, _, _ = files
    small = Cluster(num_devices=4, devices_per_node=4, memory_bytes=GIB, intra_node=cl.intra_node,
                    inter_node=cl.inter_node)
    cpath = tmp_path / "small.json"
    write_cluster(small, cpath)
    assert main(_args(mpath, str(cpath))) == 2
    assert "smallest per-device memory any plan needed" in capsys.readouterr().err


def test_zoo_model_main_job(capsys):
    """The README's main job, on a zoo model with a tiny deterministic budget."""
    assert main(["plan", "--model", "deepseek-v3-mini", "--gpu", "H100", "--cluster", "h100x8", "--microbatches",
                 "16", "--iterations", "30", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3-mini" in out and "x faster than Megatron interleaved 1F1B" in out


def test_the_report_says_which_stage_got_which_memory_choices(capsys, tmp_path):
    # gemma3 at 128k on 8 H100s: memory binds, the default `--recompute auto` buys choices on some stages
    import re

    from octopipe_plugin.formats import read_plan

    assert main(["model", "gemma3", "--seq-len", "131072", "-o", str(tmp_path / "g.json")]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", str(tmp_path / "g.json"), "--cluster", "h100x8", "--microbatches", "16",
                 "--iterations", "40", "--no-progress", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    plan = read_plan(str(tmp_path / "p.json"))
    assert plan.memory
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  memory choices ")]
    assert line.startswith(f"  memory choices {len(plan.memory)} layer(s): ")
    listed = {int(s): int(d) for s, d in re.findall(r"stage (\d+)@(\d+): ", line)}
    holding = {s: st.device for s, st in enumerate(plan.stages)
               if any(st.start <= i < st.end for i, _ in plan.memory)}
    assert listed == holding
    for i, choice in plan.memory:  # every choice named on its stage's part of the line
        s = next(s for s, st in enumerate(plan.stages) if st.start <= i < st.end)
        part = line.split(f"stage {s}@")[1].split("; stage ")[0]
        assert choice.text in part
