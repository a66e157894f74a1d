"""Megatron's own layers (local spec: TransformerLayer, MoE, embedding, output layer) through the profiler."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


@pytest.mark.timeout(240)
def test_megatron_layers_profile_and_cache(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "megatron_profile_run.py"), str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    first, second = json.loads(line[len("RESULT "):])
    layers = first["model"]["layers"]
    assert [l["kind"] for l in layers] == ["embedding", "dense", "moe", "moe", "lm_head"]
    assert all(l["source"] == "measured" for l in layers)
    assert first["measured"] == 4 and second["measured"] == 0 and second["hits"] == 4
    dense, moe, head = layers[1], layers[2], layers[4]
    assert dense["fwd_ms"] > 0 and dense["bwd_ms"] > 0 and dense["wgrad_ms"] > 0
    assert moe["state_bytes"] > dense["state_bytes"]  # 4 routed experts + a shared one vs one MLP
    assert dense["output_bytes"] == 32 * 1 * 64 * 4  # [s, b, h] float32
    assert head["output_bytes"] == 4  # the scalar loss
    assert layers[0]["bwd_ms"] == 0.0  # token ids: the embedding's whole backward is W
    assert first["model"]["meta"]["profile"]["versions"]["megatron-core"] != "absent"


@pytest.mark.timeout(240)
def test_megatron_i_and_w_are_profiled_as_the_runner_splits_them():
    """FLOPs, not times: the profiled I + W of a Megatron layer and of the output layer equal B (each GEMM once);
    the executor's generic split on Megatron's one-Function linears computes B at I and the weight GEMMs again."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "megatron_split_flops_run.py")],
                          capture_output=True, text=True, env=env, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    for kind in ("dense", "lm_head"):
        runner, generic, fused = got[kind]["runner"], got[kind]["generic"], got[kind]["B"]
        assert runner["I"] + runner["W"] == fused and runner["I"] < fused and runner["W"] > 0, (kind, got[kind])
        assert generic["I"] == fused and generic["W"] > 0  # the old figures: I + W > B
