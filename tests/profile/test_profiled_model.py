"""A profiled model file plans and simulates like any other, with where each figure came from recorded."""

import json

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.costs import load_arch, named_cluster
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats import read_model, write_model
from octopipe_plugin.formats.model import model_from_dict, model_to_dict
from octopipe_plugin.profile import ProfileSettings
from octopipe_plugin.profile.arch_profile import profile_arch
from octopipe_plugin.profile.torch_layers import builders
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner.search import tune

SMALL = dict(hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512, seq_len=32, num_layers=6)
FAST = ProfileSettings(device="cpu", warmup=0, repeats=2)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """llama3-8b shrunk to a few small layers, profiled with plain-torch layers."""
    arch = load_arch("llama3-8b", **SMALL)
    tmp = tmp_path_factory.mktemp("prof")
    # module-scoped: set up before the per-test private cache, so name its own
    settings = ProfileSettings(device="cpu", warmup=0, repeats=2, cache_dir=str(tmp / "cache"))
    result = profile_arch(arch, builders(arch), settings=settings)
    path = tmp / "llama.json"
    write_model(result.model, path)
    return result, path


def test_profiled_file_round_trips_with_sources(profiled):
    result, path = profiled
    model = read_model(path)
    assert model.layers == result.model.layers
    assert [l.source for l in model.layers] == ["measured"] * model.num_layers
    assert [l.kind for l in model.layers] == ["embedding"] + ["dense"] * 6 + ["lm_head"]
    assert model.meta["profile"]["repeats"] == 2 and model.meta["cost_model"] == "measured"
    assert all(l.fwd_ms > 0 and l.output_bytes > 0 for l in model.layers)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v", "dualpipev"])
def test_profiled_model_plans_and_simulates(profiled, schedule):
    model = read_model(profiled[1])
    plan = build_plan(model, schedule, num_devices=2, num_microbatches=4, split="balanced",
                      stages_per_device=2 if schedule == "interleaved-1f1b" else None)
    res = simulate(model, named_cluster("H100", 2), plan)
    # every action costs its layers' figures; a fused B its measured share (Layer.fused_ratio), not I + W
    per_kind = {"F": lambda l: l.fwd_ms, "I": lambda l: l.bwd_ms, "W": lambda l: l.wgrad_ms,
                "B": lambda l: (l.bwd_ms + l.wgrad_ms) * (l.fused_ratio if l.fused_ratio is not None else 1.0)}
    busy = sum(per_kind[a.kind.value](l) for row in plan.schedule for a in row
               for l in model.layers[plan.stages[a.stage].start:plan.stages[a.stage].end])
    # and W its walks over the stage's graph: each layer's cost per node times the nodes of the layers below it
    busy += sum(l.walk_ms_per_node * sum(b.graph_nodes or 0 for b in layers[:j])
                for row in plan.schedule for a in row if a.kind.value == "W"
                for layers in [model.layers[plan.stages[a.stage].start:plan.stages[a.stage].end]]
                for j, l in enumerate(layers) if l.walk_ms_per_node is not None)
    assert all(l.fused_ratio is not None for l in model.layers)  # the profiler measured B of every layer
    assert res.step_time_ms >= busy / 2 and sum(res.busy_ms) == pytest.approx(busy)


def test_profiled_model_tunes(profiled):
    model = read_model(profiled[1])
    result = tune(model, named_cluster("H100", 2), 4, iterations=30, time_budget_s=20)
    assert result.plan.num_devices == 2


def test_cli_profile_writes_a_model_that_simulates_and_plans(tmp_path, capsys):
    out = tmp_path / "m.json"
    sets = [f"--set={k}={v}" for k, v in SMALL.items() if k != "seq_len"]
    assert main(["profile", "llama3-8b", "--seq-len", "32", *sets, "--repeats", "2", "--warmup", "0",
                 "--device", "cpu", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured kinds: dense, embedding, lm_head" in text and "distinct layers 3: measured 3" in text
    assert main(["profile", "llama3-8b", "--seq-len", "32", *sets, "--repeats", "2", "--warmup", "0",
                 "--device", "cpu"]) == 0
    assert "measured 0, from cache 3" in capsys.readouterr().out
    # the lower quartile from the same cached records: nothing measured again, no layer dearer than its median
    low = tmp_path / "low.json"
    assert main(["profile", "llama3-8b", "--seq-len", "32", *sets, "--repeats", "2", "--warmup", "0",
                 "--device", "cpu", "--statistic", "p25", "-o", str(low)]) == 0
    assert "lower quartile of 2 runs" in capsys.readouterr().out
    for a, b in zip(read_model(low).layers, read_model(out).layers):
        assert a.fwd_ms <= b.fwd_ms and a.bwd_ms <= b.bwd_ms and a.wgrad_ms <= b.wgrad_ms
    assert main(["simulate", "--model", str(out), "--cluster", "h100x2", "--schedule", "zb-v", "--devices", "2",
                 "--microbatches", "4"]) == 0
    assert main(["plan", "--model", str(out), "--cluster", "h100x2", "--microbatches", "4", "--iterations", "20",
                 "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "octopipe-plan/1"


def test_unbuildable_kinds_fall_back_to_the_analytic_model():
    arch = load_arch("nemotron-h", hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=0, tp=1, vocab=512, seq_len=32,
                     hybrid_pattern="M-*-M-", mamba_heads=4, mamba_head_dim=16, mamba_groups=2, mamba_state=16)
    result = profile_arch(arch, builders(arch), settings=FAST)
    sources = {l.kind: l.source for l in result.model.layers}
    assert sources == {"embedding": "measured", "mamba": "analytic", "mlp": "measured", "attention": "measured",
                       "lm_head": "measured"}
    assert result.model.meta["profile"]["analytic_kinds"] == ["mamba"]
    assert all(l.fwd_ms > 0 for l in result.model.layers)


def test_source_field_is_checked():
    doc = {"format": "octopipe-model/1", "name": "x", "layers": [
        {"fwd_ms": 1, "bwd_ms": 1, "wgrad_ms": 1, "state_bytes": 0, "activation_bytes": 0, "output_bytes": 0,
         "source": "guessed"}]}
    with pytest.raises(FormatError, match=r"\$\.layers\[0\]\.source"):
        model_from_dict(doc)
    doc["layers"][0]["source"] = "measured"
    assert model_to_dict(model_from_dict(doc))["layers"][0]["source"] == "measured"
    del doc["layers"][0]["source"]
    assert "source" not in model_to_dict(model_from_dict(doc))["layers"][0]


def test_a_kind_that_fails_to_build_falls_back_with_its_reason():
    arch = load_arch("llama3-8b", **SMALL)
    make = dict(builders(arch))

    def broken():
        raise RuntimeError("kernel not installed")

    make["lm_head"] = broken
    result = profile_arch(arch, make, settings=FAST)
    head = result.model.layers[-1]
    assert head.source == "analytic" and head.fwd_ms > 0
    assert result.model.meta["profile"]["failed_kinds"] == {"lm_head": "RuntimeError: kernel not installed"}
    assert result.model.meta["profile"]["analytic_kinds"] == ["lm_head"]
