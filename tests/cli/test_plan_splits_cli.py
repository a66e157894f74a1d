"""`octopipe plan --splits auto|off`: the split-aware tuner from the command line, both bests in the table."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.formats import Cluster, Layer, Link, Model, read_plan, validate_plan, write_cluster, write_model
from octopipe_plugin.simulator import simulate

GIB = 2**30


def _files(tmp_path, head_ms: float):
    def lay(name, kind, t):
        return Layer(name=name, kind=kind, fwd_ms=t, bwd_ms=t, wgrad_ms=t, state_bytes=GIB, activation_bytes=GIB,
                     output_bytes=2**20)
    layers = (lay("emb", "embedding", 0.2),) + tuple(lay(f"l{i}", "dense", 1.0 + (i % 3)) for i in range(9)) \
        + (lay("head", "lm_head", head_ms),)
    model = Model(name="cli-model", layers=layers)
    link = Link(bandwidth_gb_per_s=400, latency_us=1)
    cl = Cluster(num_devices=4, devices_per_node=4, memory_bytes=40 * GIB, intra_node=link, inter_node=link)
    mpath, cpath = tmp_path / "model.json", tmp_path / "cluster.json"
    write_model(model, mpath)
    write_cluster(cl, cpath)
    return model, cl, ["plan", "--model", str(mpath), "--cluster", str(cpath), "--microbatches", "8",
                       "--iterations", "30", "--no-progress"]


def test_auto_splits_a_heavy_head_and_shows_both_bests(tmp_path, capsys):
    model, cl, args = _files(tmp_path, 14.0)
    out = tmp_path / "plan.json"
    assert main(args + ["--splits", "auto", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "split layers   head over" in text
    rows = [line for line in text.splitlines() if line.startswith("OctoPipe (")]
    assert rows[0].startswith("OctoPipe (split layers)") and "chosen" in rows[0]
    assert rows[1].startswith("OctoPipe (no split)")
    split_ms, unsplit_ms = (float(r.split()[4]) for r in rows)
    assert split_ms < unsplit_ms
    # the bound the summary judges a split plan by does not count the split head as a heaviest layer
    assert "(total work / devices)" in text.splitlines()[1]
    plan = read_plan(out, model.num_layers)
    validate_plan(plan, model.num_layers)
    assert model.num_layers - 1 in {sp.layer for sp in plan.splits}
    assert plan.predicted["step_time_ms"] == pytest.approx(simulate(model, cl, plan).step_time_ms, abs=1e-5)
    assert plan.predicted["step_time_ms"] == pytest.approx(split_ms, abs=0.06)


def test_the_default_splits_where_it_pays_and_off_keeps_whole_layers(tmp_path, capsys):
    _, _, args = _files(tmp_path, 14.0)
    assert main(args + ["--json"]) == 0  # no flag: the 14 ms head is split
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["splits"] and doc["split_layers"].startswith("split layers   head over")
    assert main(args + ["--json", "--splits", "off"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "splits" not in doc["plan"] and "split_layers" not in doc
    assert [r["label"] for r in doc["comparison"]][0] == "OctoPipe (tuned)"


def test_the_default_keeps_a_split_only_where_it_beats_the_plan_without(tmp_path):
    # a 1 ms head among 1-3 ms layers: the default searches splits too (tuner/split.py splits_tried), the plan
    # without splits (as --splits off makes it, at the same --iterations) its candidate: never slower than it,
    # and that very plan where no split simulates faster
    model, cl, args = _files(tmp_path, 1.0)
    files = []
    for extra in ([], ["--splits", "off"]):
        out = tmp_path / f"plan{len(files)}.json"
        assert main(args + extra + ["-o", str(out)]) == 0
        files.append(out)
    default, off = (read_plan(f, model.num_layers) for f in files)
    assert not off.splits
    assert simulate(model, cl, default).step_time_ms <= simulate(model, cl, off).step_time_ms + 1e-9
    if not default.splits:
        assert files[0].read_bytes() == files[1].read_bytes()


def test_auto_json_names_the_split_and_keeps_the_unsplit_row(tmp_path, capsys):
    _, _, args = _files(tmp_path, 14.0)
    assert main(args + ["--splits", "auto", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["splits"] and doc["split_layers"].startswith("split layers   head over")
    labels = [r["label"] for r in doc["comparison"]]
    assert labels[:2] == ["OctoPipe (split layers)", "OctoPipe (no split)"]


# a 256k-vocabulary GPT whose LM head is the heaviest layer by far: a split pays
BIG_VOCAB = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--vocab-size", "256000",
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--pipeline-model-parallel-size", "4", "--global-batch-size", "16"]


@pytest.mark.framework
@pytest.mark.parametrize("tied,tp", [(False, 1), (True, 1), (False, 2)])
def test_auto_with_a_megatron_launch_keeps_only_a_split_its_run_takes(tmp_path, capsys, tied, tp):
    """--megatron-args --splits auto: the split-aware tune under the launch's constraints; the written plan is one
    the launch's Megatron run takes (adapters/megatron/startup.split_refusal), else the plan without splits with
    the reason on the split line; a tied head (Megatron's default) is split like an untied one. At
    --tensor-model-parallel-size 2 the head's split is kept (a split head runs under tensor parallelism) and no
    embedding split is tried (it runs at TP=1 only)."""
    from types import SimpleNamespace

    from octopipe_plugin.adapters.megatron.startup import split_refusal

    launch = BIG_VOCAB + ([] if tied else ["--untie-embeddings-and-output-weights"])
    if tp > 1:  # validate_args' GPU-architecture question is the plan's GPU's where there is no CUDA (from_args)
        launch += ["--tensor-model-parallel-size", str(tp)]
    out = tmp_path / "plan.json"
    # --iterations bounds the search; the generous --time-budget only keeps the wall-clock guard off on a busy machine
    rc = main(["plan", "--cluster", "h100x4", "--iterations", "30", "--no-progress", "--time-budget", "60",
               "--splits", "auto", "-o", str(out), "--megatron-args", " ".join(launch)])
    text = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in text.splitlines() if x.strip().startswith("split layers"))
    plan = read_plan(out)
    args = SimpleNamespace(untie_embeddings_and_output_weights=not tied, mtp_num_layers=None,
                           tensor_model_parallel_size=tp, hybrid_layer_pattern=None, hybrid_override_pattern=None)
    if plan.splits:
        assert split_refusal(args, plan) is None, line
        assert "head over" in line
    else:
        assert "the launch cannot run it" in line or "none" in line, line
    if tied:  # the head's split is kept (its shards tied to the embedding); a tied launch splits no embedding
        assert plan.splits and all(sp.layer == plan.stages[-1].end - 1 for sp in plan.splits), line
        assert plan.stages[-1].device in plan.splits[0].devices
    else:  # the tune keeps to what the runner runs (the head's owner holding a shard; the embedding too): kept
        head = [sp for sp in plan.splits if sp.layer == plan.stages[-1].end - 1]
        assert head and all(sp.layer in (0, plan.stages[-1].end - 1) for sp in plan.splits), line
        assert plan.stages[-1].device in head[0].devices
        if tp > 1:  # a split embedding runs at TP=1 only: the tune proposes none (startup.run_splits)
            assert all(sp.layer != 0 for sp in plan.splits), line


def test_auto_on_a_model_without_a_head_says_so_and_keeps_the_plain_table(tmp_path, capsys):
    from octopipe_plugin.formats import read_model

    _, _, args = _files(tmp_path, 14.0)
    path = args[2]
    m = read_model(path)
    write_model(Model(name=m.name, layers=m.layers[:-1]), path)
    assert main(args + ["--splits", "auto"]) == 0
    text = capsys.readouterr().out
    assert "split layers   none: the model's last layer is not an lm_head" in text
    assert "OctoPipe (tuned)" in text and "OctoPipe (split layers)" not in text
