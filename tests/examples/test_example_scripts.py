"""The examples run, and what they print is accepted by the frameworks themselves.

Megatron's launch arguments go through megatron.training's own parse_args + validate_args
(in a subprocess: megatron_args_check.py); the DeepSpeed example builds its partitioned
PipelineModule on 2 gloo ranks.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe_plugin.costs import resolve_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.framework


def run(script, *args, timeout=200):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def megatron_verdicts(cases):
    out = subprocess.run([sys.executable, str(ROOT / "tests/examples/megatron_args_check.py"), json.dumps(cases)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def launch_line(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("--pipeline-model-parallel-size")]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0])


@pytest.mark.timeout(240)
def test_megatron_example_arguments_pass_megatrons_validation():
    gpt = run("examples/megatron/layout_from_plan.py", "--model", "deepseek-v3-mini", "--cluster", "h100x4")
    assert gpt.returncode == 0, gpt.stderr
    gpt_args = launch_line(gpt.stdout)
    hybrid = run("examples/megatron/layout_from_plan.py", "--model", "nemotron-h", "--cluster", "h100x8")
    assert hybrid.returncode == 0, hybrid.stderr
    hybrid_args = launch_line(hybrid.stdout)
    ok_gpt, refused, ok_hybrid = megatron_verdicts([
        {"args": gpt_args, "world": 4},
        # the form with an explicit virtual stage count: Megatron refuses it next to a layout
        {"args": gpt_args + ["--num-virtual-stages-per-pipeline-rank", "2"], "world": 4},
        {"args": hybrid_args, "world": 8},
    ])
    layout = gpt_args[gpt_args.index("--pipeline-model-parallel-layout") + 1]
    assert ok_gpt == {"ok": True, "vp": 2, "num_layers": 24, "pp": 4, "layout": layout, "hybrid": None}
    assert not refused["ok"] and "No more than one" in refused["error"]
    nemo = resolve_model("nemotron-h")
    assert ok_hybrid["ok"] and ok_hybrid["vp"] == 2 and ok_hybrid["pp"] == 8
    assert ok_hybrid["num_layers"] == sum(layer.kind in ("mamba", "attention", "mlp") for layer in nemo.layers)


@pytest.mark.timeout(120)
def test_megatron_example_with_tuner_and_refusal(tmp_path):
    tuned = run("examples/megatron/layout_from_plan.py", "--model", "llama3-8b", "--tune", "1",
                "-o", str(tmp_path / "plan.json"))
    # a looped tuned plan prints its arguments; any other placement is refused with the reason
    if tuned.returncode == 0:
        assert "--pipeline-model-parallel-layout" in tuned.stdout
    else:
        assert tuned.returncode == 2 and "executor" in tuned.stderr
    assert (tmp_path / "plan.json").exists()
    vlm = run("examples/megatron/layout_from_plan.py", "--model", "vlm")
    assert vlm.returncode == 2 and "vision" in vlm.stderr and "Traceback" not in vlm.stderr


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_deepspeed_example_builds_its_partition(tmp_path):
    out = run("examples/deepspeed/partition_from_plan.py", "--model", "deepseek-v3-mini", "--cluster", "h100x2",
              "--out", str(tmp_path), "--build")
    assert out.returncode == 0, out.stderr[-3000:]
    parts = json.loads(re.search(r"^parts (\[[^\]]*\])", out.stdout, re.M).group(1))
    config = json.loads((tmp_path / "ds_config.json").read_text())
    assert config["octopipe"]["plan"] == str(tmp_path / "plan.json")
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert parts == [st["layers"][0] for st in plan["stages"]] + [plan["stages"][-1]["layers"][1]]
    for rank in range(2):
        lo, hi = parts[rank], parts[rank + 1]
        assert re.search(rf"^rank {rank} built layers {lo}\.\.{hi - 1} \({hi - lo}:", out.stdout, re.M), out.stdout


@pytest.mark.parametrize("script,extra", [
    ("examples/megatron/benchmark.py", ["--model", "llama2-7b", "--tune-seconds", "1"]),
    ("examples/deepspeed/benchmark.py", ["--model", "llama2-7b", "--tune-budget", "1"]),
])
def test_stand_in_benchmarks_refuse_a_target_where_host_overhead_decides(tmp_path, script, extra):
    # 1 ms of host time per F (the file's figures) against a 50 ms step: refused before any process
    # starts, naming the --target-ms that would do (the one check the dry run uses: simulator/overheads.py)
    ov = tmp_path / "ov.json"
    ov.write_text(json.dumps({"format": "octopipe-overheads/1", "action_us": {"F": 1000.0},
                              "send_us": {"fixed": 0.0}, "recv_us": {"fixed": 0.0}}))
    out = run(script, "--stand-in", "--cluster", "h100x2", "--microbatches", "4", "--target-ms", "50",
              "--overheads", str(ov), "--strict-host-share", *extra)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(r"error: \w+: the executor's host overhead, [\d.]+ ms per step .* use --target-ms [\d.]+ or "
                     r"more", out.stderr), out.stderr[-2000:]
