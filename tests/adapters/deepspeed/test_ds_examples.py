"""The DeepSpeed example files: the ds_config's block is valid, the benchmark's partitions are DeepSpeed's."""

import json
import sys
from pathlib import Path

import pytest

from octopipe_plugin.adapters.deepspeed.config import parse_block

pytestmark = pytest.mark.framework
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "deepspeed"


def test_example_ds_config_block_is_valid():
    block = parse_block(json.loads((EXAMPLES / "ds_config.json").read_text()))
    assert block is not None and block.tune is not None and block.save_plan


def test_benchmark_partitions_and_plans(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import benchmark

    from octopipe_plugin.costs import resolve_cluster, resolve_model

    model, cluster = resolve_model("deepseek-v3-mini"), resolve_cluster("h100x4")
    divisor = sum(layer.state_bytes for layer in model.layers) / 18 / 2e6
    parts = benchmark.deepspeed_parts(model, 4, divisor)
    assert parts[0] == 0 and parts[-1] == model.num_layers and len(parts) == 5
    args = benchmark.parse_args(["--stand-in", "--microbatches", "8", "--tune-budget", "1"])
    plans = benchmark.plans(args, model, cluster, divisor)
    assert plans["stock"].num_stages == 4 and plans["dualpipev"].num_stages == 8
    assert [st.start for st in plans["stock"].stages] == parts[:-1]
    assert plans["octopipe"].num_microbatches == 8
    sys.modules.pop("benchmark", None)


def test_benchmark_tunes_split_plans_its_stand_in_shards_run(monkeypatch):
    # the stand-in engine's shards= sleep a split LM head only (module.py refuses an embedding split beside them):
    # an untied 128k-vocabulary model on 8 ranks, where the DeepSpeed runner's own constraints often split entry 0
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import benchmark

    from octopipe_plugin.costs import resolve_cluster, resolve_model

    import octopipe_plugin.tuner.split as tuner_split

    seen = []
    real = tuner_split.tune_split

    def recording(*a, **kw):  # the real search, its constraints kept: which layers it splits is the budget's luck
        seen.append(kw["constraints"])
        return real(*a, **kw)

    monkeypatch.setattr(tuner_split, "tune_split", recording)
    model, cluster = resolve_model("llama3-8b", "H100"), resolve_cluster("h100x8")
    divisor = sum(layer.state_bytes for layer in model.layers) / 18 / 2e6
    args = benchmark.parse_args(["--stand-in", "--microbatches", "16", "--tune-budget", "1"])
    plans = benchmark.plans(args, model, cluster, divisor)
    assert len(seen) == 1 and seen[0].owner_shard and not seen[0].split_embedding
    split = plans.get("octopipe-split")
    assert split is None or [sp.layer for sp in split.splits] == [model.num_layers - 1], split.splits
    sys.modules.pop("benchmark", None)


@pytest.mark.distributed
@pytest.mark.timeout(900)  # three engines' deepspeed.initialize on 2 ranks: minutes on a loaded 2-core machine
def test_stand_in_benchmark_runs_every_engine_on_the_wall_clock(tmp_path):
    # a tiny run (2 ranks, 4 micro-batches, 0.3 s steps) with activations of the model's bytes through DeepSpeed's
    # p2p: the figures' format, not their values, is the check
    import os
    import re
    import subprocess

    from octopipe_plugin.cli import main
    from octopipe_plugin.formats import Cluster, Link, write_cluster

    assert main(["model", "gemma3", "--seq-len", "64", "-o", str(tmp_path / "m.json")]) == 0
    link = Link(bandwidth_gb_per_s=2.0, latency_us=100.0)  # this host's links, as `octopipe cluster --measure` says
    write_cluster(Cluster(num_devices=2, devices_per_node=2, memory_bytes=1 << 33, intra_node=link, inter_node=link,
                          name="local2"), tmp_path / "l.json")
    root = EXAMPLES.parents[1]
    out = subprocess.run([sys.executable, str(EXAMPLES / "benchmark.py"), "--stand-in", "--model",
                          str(tmp_path / "m.json"), "--cluster", "h100x2", "--links", str(tmp_path / "l.json"),
                          "--microbatches", "4", "--tune-budget", "1", "--target-ms", "300", "--steps", "1",
                          "--clock", "wall", "--splits", "off"], capture_output=True, text=True, timeout=880,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(ln.startswith("model ") and "wall clock" in ln for ln in lines), out.stdout  # DeepSpeed logs too
    for engine in ("PipelineEngine", "DualPipeVEngine", "OctoPipeEngine"):
        assert any(re.match(rf"DeepSpeed {engine}|{engine}", ln) and re.search(r"\s[\d.]+\s+[\d.]+\s+[\d.]+$", ln)
                   for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]


@pytest.mark.distributed
@pytest.mark.timeout(900)  # four engines' deepspeed.initialize on 4 ranks: minutes on a loaded 2-core machine
def test_stand_in_benchmark_runs_a_split_plan_beside_the_plan_without(tmp_path):
    # 4 ranks, 8 micro-batches, 0.4 s steps, a plan splitting the head over every rank: the split engine's row and
    # the split gain parse (no timing asserted)
    import os
    import re
    import subprocess

    from octopipe_plugin.costs import resolve_cluster, resolve_model
    from octopipe_plugin.formats import write_plan
    from octopipe_plugin.testing.split_plans import head_split_plan

    split = str(tmp_path / "split.json")
    write_plan(head_split_plan(resolve_model("gemma3"), resolve_cluster("h100x4"), 8), split)
    root = EXAMPLES.parents[1]
    out = subprocess.run([sys.executable, str(EXAMPLES / "benchmark.py"), "--stand-in", "--model", "gemma3",
                          "--cluster", "h100x4", "--microbatches", "8", "--tune-budget", "1", "--split-plan", split,
                          "--target-ms", "400", "--steps", "1"], capture_output=True, text=True, timeout=880,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(ln.startswith("OctoPipe with splits: ") and "over 4 ranks" in ln for ln in lines), out.stdout
    assert any(re.match(r"OctoPipeEngine with splits .*\s[\d.]+\s+[\d.]+\s+[\d.]+$", ln) for ln in lines), out.stdout
    assert re.fullmatch(r"measured speedup \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-2]), lines[-2]
    assert re.fullmatch(r"measured split gain \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]


def test_memory_levers_plans_full_recompute_against_whole_layer_choices(monkeypatch):
    # the stand-in list's layers have no sub-modules: the tuned plan recomputes whole layers only
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import benchmark

    from octopipe_plugin.costs import resolve_cluster, resolve_model
    from octopipe_plugin.formats.memory import RECOMPUTE
    from octopipe_plugin.testing.deepspeed_standin import whole_layer_model

    cluster = resolve_cluster("h100x4")
    model = whole_layer_model(resolve_model("gemma3"))
    args = benchmark.parse_args(["--stand-in", "--microbatches", "8", "--tune-budget", "1", "--memory-levers"])
    plans = benchmark.plans(args, model, cluster, 1.0)
    assert set(plans) == {"stock-recompute", "octopipe"}
    assert {i for i, _ in plans["stock-recompute"].memory} == set(range(model.num_layers))
    assert all(c.kind == RECOMPUTE for _, c in plans["octopipe"].memory)
    sys.modules.pop("benchmark", None)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_memory_levers_runs_deepspeeds_checkpointing_beside_the_plans_choices(tmp_path):
    # 2 ranks, gemma3 at 32k (over memory without recompute on h100x2): DeepSpeed's activation_checkpoint_interval=1
    # against OctoPipeEngine's per-layer checkpoints; the figures' format is the check
    import os
    import re
    import subprocess

    from octopipe_plugin.cli import main

    assert main(["model", "gemma3", "--seq-len", "32768", "-o", str(tmp_path / "m.json")]) == 0
    root = EXAMPLES.parents[1]
    out = subprocess.run([sys.executable, str(EXAMPLES / "benchmark.py"), "--stand-in", "--model",
                          str(tmp_path / "m.json"), "--cluster", "h100x2", "--microbatches", "4", "--tune-budget", "1",
                          "--target-ms", "300", "--steps", "1", "--memory-levers"], capture_output=True, text=True,
                         timeout=880, env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(re.match(r"OctoPipe: \d+ stages, (recompute on [\d, -]+|no memory choices); simulated peak memory: DeepSpeed [\d.]+ GiB, "
                        r"OctoPipe [\d.]+ GiB of [\d.]+ GiB usable", ln) for ln in lines), out.stdout
    assert any(ln.startswith("DeepSpeed PipelineEngine (1F1B, checkpoint every layer)") for ln in lines), out.stdout
    assert re.fullmatch(r"measured gain \d+\.\d\dx \(simulated \d+\.\d\dx\)", lines[-1]), lines[-1]
