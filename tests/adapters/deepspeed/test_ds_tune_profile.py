"""`tune.profile`: rank 0 measures the PipelineModule's layers (profiler, disk cache) and tunes on them."""

import pytest
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec
from torch import nn

from octopipe_plugin.adapters.deepspeed.config import parse_block
from octopipe_plugin.adapters.deepspeed.plan_source import profile_specs, resolve_plan
from octopipe_plugin.errors import FormatError, OctoPipeError


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group: resolve_plan broadcasts the plan of rank 0."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _specs():
    return [LayerSpec(nn.Embedding, 64, 16), LayerSpec(nn.Linear, 16, 16), LayerSpec(nn.LayerNorm, 16),
            LayerSpec(nn.Linear, 16, 64)]


def _config(**tune):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "octopipe": {"tune": {"cluster": "h100x1", "time_budget_s": 1, "seq_len": 8, **tune}}}


@pytest.mark.timeout(60)
def test_tuned_plan_model_carries_measured_costs(one_rank_group, tmp_path, monkeypatch):
    monkeypatch.setenv("OCTOPIPE_PROFILE_CACHE", str(tmp_path / "cache"))
    config = _config(profile=True, profile_repeats=2)
    config["octopipe"]["save_plan"] = str(tmp_path / "plan.json")
    import octopipe_plugin.tuner as tuner

    tuned_on = []
    real_tune = tuner.tune

    def recording_tune(model, *args, **kwargs):  # the real tuner; records the model it was given
        tuned_on.append(model)
        return real_tune(model, *args, **kwargs)

    monkeypatch.setattr(tuner, "tune", recording_tune)
    torch.manual_seed(0)
    plan, block, _ = resolve_plan(_specs(), config=config)
    assert block.tune.profile and block.tune.profile_repeats == 2
    assert plan.num_microbatches == 2 and plan.stages[-1].end == 4
    (model,) = tuned_on
    assert [l.source for l in model.layers] == ["measured"] * 4
    assert [l.kind for l in model.layers] == ["Embedding", "Linear", "LayerNorm", "Linear"]
    assert model.meta["cost_model"] == "measured" and model.meta["profile"]["repeats"] == 2
    assert all(l.fwd_ms > 0 and l.bwd_ms + l.wgrad_ms > 0 for l in model.layers)
    assert (tmp_path / "plan.json").exists()
    # A second start-up measures nothing: every distinct layer comes from the profiler's disk cache.
    again = profile_specs(_specs(), block.tune, micro_batch_size=2)
    assert [r["cache"] for r in again.meta["profile"]["layers"]] == ["hit"] * 4
    assert [l.fwd_ms for l in again.layers] == [l.fwd_ms for l in model.layers]


@pytest.mark.parametrize("tune, field, expected", [
    ({"profile": "yes"}, "profile", "true or false"),
    ({"profile": True, "profile_repeats": 0}, "profile_repeats", "a positive integer"),
    ({"profile": True, "profile_input": [2, -1]}, "profile_input", "the shape"),
])
def test_bad_profile_value_refused_naming_the_key(tune, field, expected):
    with pytest.raises(FormatError, match=rf"ds_config: field \$\.octopipe\.tune\.{field}: expected {expected}"):
        parse_block(_config(**tune))


@pytest.mark.timeout(60)
def test_float_first_layer_needs_profile_input(one_rank_group, tmp_path, monkeypatch):
    monkeypatch.setenv("OCTOPIPE_PROFILE_CACHE", str(tmp_path / "cache"))
    specs = _specs()[1:]
    with pytest.raises(OctoPipeError, match=r"\$\.octopipe\.tune\.profile_input: expected the shape"):
        resolve_plan(specs, config=_config(profile=True))
    plan, _, _ = resolve_plan(specs, config=_config(profile=True, profile_repeats=1, profile_input=[2, 8, 16]))
    assert plan.stages[-1].end == 3
