"""examples/megatron/benchmark.py --stand-in runs both schedules on real Megatron chunks and prints its figures."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.framework, pytest.mark.distributed, pytest.mark.timeout(400)]


def test_stand_in_benchmark_runs_megatron_and_octopipe_side_by_side(tmp_path):
    # a tiny run (2 ranks, 4 micro-batches, 0.3 s steps): the figures' format, not their values, is the check
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples/megatron/benchmark.py"), "--stand-in", "--model",
                          "llama2-7b", "--cluster", "h100x2", "--microbatches", "4", "--tune-seconds", "1",
                          "--target-ms", "300", "--timeout", "120"], capture_output=True, text=True, timeout=380,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    for label in ("megatron", "octopipe"):
        assert any(re.match(rf"{label}\s+measured step\s+[\d.]+ ms\s+simulated\s+[\d.]+ ms\s+tokens/s [\d,]+", ln)
                   for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]
    refused = subprocess.run([sys.executable, str(ROOT / "examples/megatron/benchmark.py"), "--model", "llama2-7b"],
                             capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert refused.returncode == 2 and "--stand-in" in refused.stderr


def _local_links(path) -> str:
    """A cluster file of this host's links as `octopipe cluster --measure` writes one (figures of a gloo pair)."""
    from octopipe_plugin.formats import Cluster, Link, write_cluster

    link = Link(bandwidth_gb_per_s=2.0, latency_us=100.0)
    write_cluster(Cluster(num_devices=2, devices_per_node=2, memory_bytes=1 << 33, intra_node=link, inter_node=link,
                          name="local2"), path)
    return str(path)


def test_stand_in_benchmark_runs_on_the_wall_clock_with_real_boundaries(tmp_path):
    # wall clock: boundaries of the model's bytes (seq 128 x hidden 4096 x bf16 = 1 MiB) through Megatron's p2p
    from octopipe_plugin.cli import main

    assert main(["model", "llama2-7b", "--seq-len", "128", "-o", str(tmp_path / "m.json")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples/megatron/benchmark.py"), "--stand-in", "--model",
                          str(tmp_path / "m.json"), "--cluster", "h100x2", "--links", _local_links(tmp_path / "l.json"),
                          "--microbatches", "4", "--tune-seconds", "1", "--target-ms", "300", "--timeout", "120",
                          "--clock", "wall"], capture_output=True, text=True, timeout=380, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any("wall clock" in ln for ln in lines) and any(
        ln.startswith("transfers: boundaries of 1.00 MiB over gloo, predicted with") for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]
