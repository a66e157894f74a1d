"""`octopipe plan --megatron-args`: the launch's model as the launch builds it, arguments that start it, its setup."""

from __future__ import annotations

import json
import os
import sys

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import plan_from_dict, read_plan
from octopipe_plugin.formats.fingerprint import model_fingerprint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "adapters", "megatron_launch"))
from launch_helpers import TINY_GPT, parse  # noqa: E402  (the launch tests' own Megatron parser helper)

pytestmark = [pytest.mark.framework, pytest.mark.timeout(300)]

# the arguments of the Megatron launch test (tests/adapters/megatron_launch/test_megatron_launcher.py)
RUN = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
HYBRID = ["--hybrid-layer-pattern", "M*-M*-M*-", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
          "--position-embedding-type", "rope", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]


def _plan(capsys, launch: list[str], *extra, expect=0):
    rc = main(["plan", "--cluster", "h100x2", "--iterations", "20", "--no-progress",
               "--megatron-args", " ".join(launch), *extra])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if expect == 0 else err


def _launch_model(launch: list[str], monkeypatch, world=2):
    """The model Megatron's start-up tunes for these arguments (tune_for_run, the tuner call captured)."""
    import octopipe_plugin.tuner as tuner
    from octopipe_plugin.adapters.megatron.arguments import run_facts
    from octopipe_plugin.adapters.megatron.startup import tune_for_run

    seen = {}

    class Captured(Exception):
        pass

    def capture(model, cluster, m, **kw):
        seen.update(model=model, m=m)
        raise Captured

    monkeypatch.setattr(tuner, "tune", capture)
    args = parse(launch + ["--octopipe-cluster", "h100x2"], world=world)
    with pytest.raises(Captured):
        tune_for_run(args, run_facts(args))
    return seen["model"], seen["m"]


@pytest.mark.parametrize("launch", [RUN, RUN + ["--num-virtual-stages-per-pipeline-rank", "2"], HYBRID],
                         ids=["gpt", "gpt-vp2", "hybrid"])
def test_graph_equals_the_launchs_and_the_printed_arguments_start_it(capsys, tmp_path, monkeypatch, launch):
    out_plan = tmp_path / "plan.json"
    text = _plan(capsys, ["pretrain_gpt.py", *launch], "-o", str(out_plan))
    model, m = _launch_model(launch, monkeypatch)
    plan = read_plan(out_plan, model.num_layers)
    assert plan.meta["fingerprint"]["model"] == model_fingerprint(model)  # the same graph, names, kinds and costs
    assert plan.num_microbatches == m and plan.meta["layer_kinds"] == [layer.kind for layer in model.layers]
    add = f"--pipeline-schedule octopipe --octopipe-plan {out_plan}"
    assert f"add to the launch   {add}" in text
    kept = launch
    if "--num-virtual-stages-per-pipeline-rank" in launch:
        assert "drop --num-virtual-stages-per-pipeline-rank" in text
        kept = launch[:-2]
    args = parse(kept + add.split(), world=2)  # Megatron's parse + OctoPipe's start-up + validate_args
    assert args.pipeline_schedule == "octopipe"
    assert plan_from_dict(args.octopipe_plan).stages == plan.stages  # the start-up took the plan as written
    if launch is HYBRID:  # a hybrid model's chunks follow any stage->rank map: no placement constraint is added
        assert "constraint added for Megatron: looped placement" not in text


def test_table_against_the_launchs_layout(capsys, tmp_path):
    launch = RUN + ["--pipeline-model-parallel-layout", "Et|tt|tt|tL"]
    doc = json.loads(_plan(capsys, launch, "-o", str(tmp_path / "p.json"), "--json"))
    cur = doc["launch"]["current"]
    assert cur["schedule"] == "interleaved-1f1b" and cur["stages_per_rank"] == 2
    assert cur["stages"] == "--pipeline-model-parallel-layout Et|tt|tt|tL" and len(cur["peak_bytes"]) == 2
    assert doc["drop_arguments"] == ["--pipeline-model-parallel-layout"]
    text = _plan(capsys, launch, "-o", str(tmp_path / "p.json"))
    said = next(ln for ln in text.splitlines() if "your launch now:" in ln)
    assert "interleaved-1f1b on --pipeline-model-parallel-layout Et|tt|tt|tL, 2 stage(s) per rank" in said
    row = next(ln for ln in text.splitlines() if ln.startswith("  your setup  "))
    assert "%" in row and len(row.split()) == 2 + 3 + 2  # label (2 words), v, step, bubble, a peak per rank
    assert "x faster than your current setup; fullest rank" in text


def test_world_size_sets_data_parallel_and_micro_batches(capsys, tmp_path):
    doc = json.loads(_plan(capsys, RUN, "--world-size", "4", "-o", str(tmp_path / "p.json"), "--json"))
    assert doc["launch"]["data_parallel_size"] == 2 and doc["launch"]["num_microbatches"] == 2


@pytest.mark.parametrize("launch, fragment", [
    (RUN + ["--num-layers", "six"], "--megatron-args: Megatron's parser: "),
    (RUN + ["--no-such-megatron-flag"], "unrecognized arguments: --no-such-megatron-flag"),
    ([w if w != "4" else "3" for w in RUN] + ["--micro-batch-size", "2"], "--megatron-args: Megatron's validate_args"),
])
def test_bad_launch_arguments_get_megatrons_own_error_in_one_line(capsys, launch, fragment):
    err = _plan(capsys, launch, expect=2)
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans on a machine without CUDA")
def test_tensor_parallel_launch_plans_on_a_machine_without_cuda(capsys, tmp_path, monkeypatch):
    """At TP > 1 Megatron's validate_args asks the launch's GPU architecture (get_device_arch_version): on a machine
    without CUDA, through the real parser and validator, it is told the plan's GPU (H100: Hopper, which requires
    the launch's CUDA_DEVICE_MAX_CONNECTIONS=1; B200: Blackwell, which does not), nothing of Megatron or torch.cuda
    is left changed, and a CUDA_DEVICE_MAX_CONNECTIONS this process sets otherwise still gets Megatron's message."""
    import megatron.training.arguments as arguments
    import torch

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    own, cuda_props = arguments.get_device_arch_version, torch.cuda.get_device_properties
    tp2 = RUN + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    tp1 = json.loads(_plan(capsys, RUN, "-o", str(tmp_path / "tp1.json"), "--json"))
    docs = {}
    for cluster in ("h100x2", "b200x2"):
        out = tmp_path / f"{cluster}.json"
        doc = docs[cluster] = json.loads(_plan(capsys, tp2, "--cluster", cluster, "-o", str(out), "--json"))
        assert doc["launch"]["pipeline_size"] == 2 and doc["launch"]["num_microbatches"] == 4
        assert read_plan(out).num_devices == 2
        assert "--tensor-model-parallel-size 2" in doc["plan"]["meta"]["tuned_for"]["megatron_args"]
    assert docs["h100x2"]["tuned"]["step_ms"] != tp1["tuned"]["step_ms"]  # the TP 2 model, costed as such
    assert arguments.get_device_arch_version is own and torch.cuda.get_device_properties is cuda_props
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # this process's own setting: Megatron's word on it
    err = _plan(capsys, tp2, expect=2)
    assert "Megatron's validate_args: Using tensor model parallelism or context parallelism require setting the " \
           "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1" in err and len(err.strip().splitlines()) == 1
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_launch_whose_validation_asks_this_machines_gpu_names_megatrons_question_and_the_fix(capsys):
    """--moe-grouped-gemm: validate_args reads this machine's compute capability; without a GPU, the error says who
    asked and what to do."""
    err = _plan(capsys, RUN + ["--num-experts", "2", "--moe-grouped-gemm"], expect=2)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "Megatron's validate_args: Torch not compiled with CUDA enabled" in err
    assert "(validate_args, training/arguments.py:" in err and "run `octopipe plan` on a node that sees a GPU" in err


def test_cluster_must_have_one_device_per_pipeline_rank(capsys):
    rc = main(["plan", "--cluster", "h100x8", "--no-progress", "--megatron-args", " ".join(RUN)])
    assert rc == 2 and "one device per pipeline rank (e.g. h100x2)" in capsys.readouterr().err


def test_args_from_a_file(capsys, tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("torchrun --nproc-per-node 2 pretrain_gpt.py \\\n  " + " ".join(RUN) + "\n")
    text = _plan(capsys, [f"@{f}"], "-o", str(tmp_path / "p.json"))
    assert "Your launch: 2 pipeline ranks x 4 micro-batches" in text
    # the printed check runs: the launch's model was written next to the plan
    check = next(ln for ln in text.splitlines() if "check it on CPU first:" in ln).split(": ", 1)[1].split("; ")[0]
    assert check.startswith("octopipe simulate ")
    assert main(check.split()[1:]) == 0


def test_the_launchs_own_headroom_is_used_unless_overridden(capsys, tmp_path):
    gib = 2**30
    launch = RUN + ["--octopipe-memory-headroom", "20GiB"]
    doc = json.loads(_plan(capsys, launch, "-o", str(tmp_path / "p.json"), "--json"))
    assert doc["memory_headroom_bytes"] == 20 * gib
    doc = json.loads(_plan(capsys, launch, "-o", str(tmp_path / "p.json"), "--json", "--memory-headroom", "2"))
    assert doc["memory_headroom_bytes"] == 2 * gib
    doc = json.loads(_plan(capsys, RUN, "-o", str(tmp_path / "p.json"), "--json"))
    assert doc["memory_headroom_bytes"] == int(80 * gib * 0.08)


UNIFORM_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def test_the_launchs_uniform_recompute_is_replaced_by_the_plans_choices_or_kept(capsys, tmp_path):
    out_plan = tmp_path / "plan.json"
    # --recompute full: every layer recomputed by the plan, which replaces the launch's uniform arguments
    # (--splits off: the split search hands back its plan without the memory choices, tuner/plan_split)
    text = _plan(capsys, RUN + UNIFORM_RECOMPUTE, "--recompute", "full", "--splits", "off", "-o", str(out_plan))
    plan = read_plan(out_plan)
    assert plan.memory and all(c.kind == "recompute" for _, c in plan.memory)
    drop = next(ln for ln in text.splitlines() if "and drop --recompute" in ln)
    assert f"and drop {' '.join(UNIFORM_RECOMPUTE)} (the plan's memory choices on {len(plan.memory)} layer(s)" in drop
    add = f"--pipeline-schedule octopipe --octopipe-plan {out_plan}".split()
    args = parse(RUN + add, world=2)  # the launch as printed starts: the plan's choices, no uniform recompute
    assert plan_from_dict(args.octopipe_plan).memory == plan.memory
    # ... and the start-up refuses the launch left as it was
    from octopipe_plugin.errors import OctoPipeError

    with pytest.raises(OctoPipeError, match="plan \\$.memory sets each layer's recompute/offload; drop"):
        parse(RUN + UNIFORM_RECOMPUTE + add, world=2, validate=False)
    # --recompute none --offload none: the launch's uniform recompute stays (costed as Megatron runs it)
    doc = json.loads(_plan(capsys, RUN + UNIFORM_RECOMPUTE, "--recompute", "none", "--offload", "none", "-o",
                           str(tmp_path / "kept.json"), "--json"))
    assert doc["memory_choices"] == 0 and not any(w.startswith("--recompute") for w in doc["drop_arguments"])
