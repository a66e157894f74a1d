"""examples/megatron/benchmark.py --stand-in runs both schedules on real Megatron chunks and prints its figures."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.framework, pytest.mark.distributed, pytest.mark.timeout(400)]


def test_benchmark_without_stand_in_is_refused(tmp_path):
    # the default-clock run's figure lines (megatron, octopipe, the speedup) are checked by the split test below,
    # on 4 ranks; --splits off's last line by the wall-clock test: this file runs no third benchmark for them
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
                          "--clock", "wall", "--splits", "off"], capture_output=True, text=True, timeout=380, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any("wall clock" in ln for ln in lines) and any(
        ln.startswith("transfers: boundaries of 1.00 MiB over gloo, predicted with") for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]


def split_plan_file(path, model_name: str, devices: int, microbatches: int) -> str:
    """A plan splitting the model's LM head over every rank (what a short tune might not choose), written out."""
    from octopipe_plugin.costs import resolve_cluster, resolve_model
    from octopipe_plugin.formats import write_plan
    from octopipe_plugin.testing.split_plans import head_split_plan

    write_plan(head_split_plan(resolve_model(model_name), resolve_cluster(f"h100x{devices}"), microbatches), path)
    return str(path)


def test_stand_in_benchmark_runs_a_split_plan_beside_the_plan_without(tmp_path):
    # 4 ranks, 8 micro-batches, 0.4 s steps: the split run's line and the split gain parse (no timing asserted)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    split = split_plan_file(tmp_path / "split.json", "gemma3", 4, 8)
    out = subprocess.run([sys.executable, str(ROOT / "examples/megatron/benchmark.py"), "--stand-in", "--model",
                          "gemma3", "--cluster", "h100x4", "--microbatches", "8", "--tune-seconds", "1",
                          "--split-plan", split, "--target-ms", "400", "--timeout", "120", "--per-rank"],
                         capture_output=True, text=True, timeout=380, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(ln.startswith("octopipe with splits: ") and "over 4 ranks" in ln for ln in lines), out.stdout
    # --per-rank: each run's ranks, busy and waiting measured beside simulated
    for label in ("megatron", "octopipe", "octopipe with splits"):
        at = lines.index(next(ln for ln in lines if ln.startswith(f"{label}: per rank, busy / waiting ms")))
        assert all(re.fullmatch(rf"  rank {r:2d}  busy +[\d.]+ \( *[\d.]+\)  waiting +-?[\d.]+ \( *-?[\d.]+\)",
                                lines[at + 1 + r]) for r in range(4)), lines[at:at + 5]
    for label in ("megatron", "octopipe", "octopipe with splits"):
        assert any(re.match(rf"{label}\s+measured step\s+[\d.]+ ms\s+simulated\s+[\d.]+ ms\s+tokens/s [\d,]+", ln)
                   for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-2]), lines[-2]
    assert re.fullmatch(r"measured split gain \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]


def _bench(tmp_path, *extra, timeout=380):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "examples/megatron/benchmark.py"), "--stand-in", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def test_moe_overlap_runs_megatrons_combined_1f1b_beside_octopipes_pairs(tmp_path):
    # both through megatron-core's combined step on 4 ranks: Megatron's own interleaved schedule under the flag and
    # OctoPipe's with a plan with pairs; the figure lines parse (no timing asserted)
    from octopipe_plugin.cli import main

    import types

    from octopipe_plugin.adapters.megatron.pairs import PairSupport, tuning_model
    from octopipe_plugin.costs import resolve_model
    from octopipe_plugin.formats import write_plan
    from octopipe_plugin.schedules.registry import build_plan

    assert main(["model", "deepseek-v3-mini", "--ep", "8", "-o", str(tmp_path / "moe.json")]) == 0
    # OctoPipe's side runs a given plan with pairs (a 2 s tune on a loaded host may keep none): the combined 1F1B
    # at v = 2 on the balanced split, on the model the combined step's plans are tuned on (each backward one B)
    model = tuning_model(resolve_model(str(tmp_path / "moe.json")), PairSupport(runs=True, why=""),
                         types.SimpleNamespace(overlap_moe_expert_parallel_comm=True))
    write_plan(build_plan(model, "combined-1f1b", 4, 8, stages_per_device=2, split="balanced"), tmp_path / "p.json")
    out = _bench(tmp_path, "--model", str(tmp_path / "moe.json"), "--cluster", "h100x4", "--microbatches", "8",
                 "--plan", str(tmp_path / "p.json"), "--target-ms", "400", "--timeout", "120", "--moe-overlap")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(re.match(r"megatron: combined 1F1B under --overlap-moe-expert-parallel-comm, [234] virtual stages per "
                        r"rank, even split, [1-9]\d* overlapped pairs", ln) for ln in lines), out.stdout
    assert any(re.match(r"octopipe: 8 stages, .*, [1-9]\d* overlapped pairs$", ln) for ln in lines), out.stdout
    assert re.fullmatch(r"measured gain \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]


def test_moe_overlap_refuses_a_model_without_all_to_all_phases(tmp_path):
    out = _bench(tmp_path, "--model", "llama2-7b", "--cluster", "h100x2", "--moe-overlap", timeout=120)
    assert out.returncode == 2 and "no layer has an all-to-all phase" in out.stderr and "--ep" in out.stderr


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_benchmark", ROOT / "examples/megatron/benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_stand_in_stages_sleep_a_recomputed_forward_before_their_backward():
    # full recompute: each stage's first backward layer also sleeps the stage's forwards again (hand-summed here)
    from octopipe_plugin.costs import resolve_cluster, resolve_model
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.tuner.memory_choices import full_recompute

    bench = _benchmark_module()
    model, cluster = resolve_model("llama2-7b"), resolve_cluster("h100x2")
    plain = build_plan(model, "1f1b", 2, 4)
    full = full_recompute(model, plain)
    a, b = (bench.stand_in_stages(model, p, 0.5, cluster) for p in (plain, full))
    recomputed = {i for i, _ in full.memory}
    assert recomputed
    for st, x, y in zip(plain.stages, a, b):
        rerun = sum(model.layers[i].fwd_ms for i in range(st.start, st.end) if i in recomputed)
        assert [l[1] for l in y.layers][:-1] == [l[1] for l in x.layers][:-1]
        assert y.layers[-1][1] == pytest.approx(x.layers[-1][1] + 0.5 * rerun)
        assert y.fwd_ms == x.fwd_ms


def test_memory_levers_runs_megatron_with_full_recompute_beside_per_layer_choices(tmp_path):
    from octopipe_plugin.cli import main

    assert main(["model", "gemma3", "--seq-len", "32768", "-o", str(tmp_path / "g.json")]) == 0
    out = _bench(tmp_path, "--model", str(tmp_path / "g.json"), "--cluster", "h100x4", "--microbatches", "8",
                 "--tune-seconds", "2", "--target-ms", "400", "--timeout", "120", "--memory-levers")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(ln.startswith("megatron: interleaved 1F1B with full recompute (every layer)") for ln in lines)
    assert any(re.match(r"octopipe: \d+ stages, .*, (no memory choices|memory choices: .+)$", ln) for ln in lines)
    assert any(re.match(r"simulated peak memory: megatron [\d.]+ GiB, octopipe [\d.]+ GiB of [\d.]+ GiB usable", ln)
               for ln in lines), out.stdout
    assert re.fullmatch(r"measured gain \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]
