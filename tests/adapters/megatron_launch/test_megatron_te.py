"""Transformer Engine, safe first: TE stages run fused B unless the GPU check verified their split and the run asks.

TE does not import on this CPU machine, so `te.te_available` is switched on by monkeypatch: what is
tested is start-up's decision and its plan rewrite (Megatron's parser, validation and the plan's
checks as a TE run on a GPU would get them), not TE's kernels.
"""

import logging

import pytest
import torch

from octopipe_plugin.actions import Kind
from octopipe_plugin.adapters.megatron import te
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import plan_from_dict, read_plan, validate_plan

from launch_helpers import TINY_GPT, parse
from test_megatron_startup import plan_file, tiny_model

pytestmark = [pytest.mark.framework, pytest.mark.timeout(120)]
RUN = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule", "octopipe"]


@pytest.fixture
def te_run(monkeypatch, tmp_path):
    """A run whose Megatron would build TE linears (the default --transformer-impl) on a machine with TE."""
    monkeypatch.setattr(te, "te_available", lambda: True)
    monkeypatch.setenv("OCTOPIPE_TE_SPLIT_RECORD", str(tmp_path / "gpu-check" / "te-split.json"))
    return tmp_path



def test_te_stages_run_fused_b_and_startup_says_so(te_run, caplog):
    path = plan_file(te_run)  # interleaved zero-bubble: I/W on every stage
    assert any(a.kind == Kind.I for row in read_plan(path).schedule for a in row)
    with caplog.at_level(logging.WARNING, logger="octopipe.megatron"):
        args = parse(RUN + ["--octopipe-plan", path, "--save", str(te_run / "ck"), "--save-interval", "1"], world=2)
    plan = plan_from_dict(args.octopipe_plan, "args")
    assert {a.kind for row in plan.schedule for a in row} == {Kind.F, Kind.B}
    validate_plan(plan)
    original = read_plan(path)
    assert sum(len(r) for r in original.schedule) - sum(len(r) for r in plan.schedule) == 4 * 4  # 16 W dropped
    lines = [r.getMessage() for r in caplog.records if "Transformer Engine" in r.getMessage()]
    assert len(lines) == 1 and "linears (stages [0, 1, 2, 3]) run fused B" in lines[0] and "16 I/W pairs" in lines[0]
    assert "gpu_check.sh --te-split" in lines[0]
    assert read_plan(te_run / "ck" / "octopipe-plan.json").schedule == plan.schedule  # saved as it runs


def test_local_linears_keep_their_split(te_run):
    args = parse(RUN + ["--octopipe-plan", plan_file(te_run), "--transformer-impl", "local"], world=2)
    assert "3I0" in args.octopipe_plan["schedule"][1]


def test_the_te_split_needs_the_gpu_check_record(te_run):
    path = plan_file(te_run)
    with pytest.raises(OctoPipeError) as exc:
        parse(RUN + ["--octopipe-plan", path, "--octopipe-te-split"], world=2)
    assert "\n" not in str(exc.value)
    assert str(exc.value).startswith("--octopipe-te-split: Transformer Engine's I/W split is not verified on this "
                                     f"machine: no record at {te_run / 'gpu-check' / 'te-split.json'} (run `bash "
                                     "scripts/gpu_check.sh --te-split`")
    te.write_record(passed=False, gpu="H100", detail="W gradients differ by 2x")
    with pytest.raises(OctoPipeError, match=r"the check failed on H100 \(W gradients differ by 2x\)"):
        parse(RUN + ["--octopipe-plan", path, "--octopipe-te-split"], world=2)
    te.write_record(passed=True, gpu="H100", detail="gradients equal")
    args = parse(RUN + ["--octopipe-plan", path, "--octopipe-te-split"], world=2)
    assert "3I0" in args.octopipe_plan["schedule"][1]  # verified and asked for: the split runs


def test_the_tuner_sees_fused_te_layers_as_b():
    model = tiny_model()
    fused = te.fused_backward_model(model, te.TeBackward(te=True, split=False))
    assert fused.meta["fused_backward_layers"] == [f"decoder.layers.{i}" for i in range(6)]
    for a, b in zip(model.layers, fused.layers):
        assert a.bwd_ms + a.wgrad_ms == pytest.approx(b.bwd_ms + b.wgrad_ms)
        assert b.wgrad_ms == (0.0 if a.kind == "dense" else a.wgrad_ms)
    assert te.fused_backward_model(model, te.TeBackward(te=True, split=True)) is model


def test_the_runtime_refuses_te_chunks_under_an_unverified_split(te_run):
    plan = read_plan(plan_file(te_run))
    TeLinear = type("TELinear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    chunks = [torch.nn.Sequential(TeLinear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))]
    problem = te.te_chunk_problem(plan, 0, chunks, decision_split=False)
    assert problem.startswith("plan: stage 0 on pipeline rank 0 holds Transformer Engine linears and runs I/W")
    assert te.te_chunk_problem(plan, 0, chunks, decision_split=True) is None
    assert te.te_chunk_problem(plan, 0, chunks[1:] * 2, decision_split=False) is None


def test_the_launch_schedule_refuses_te_chunks_under_an_unverified_split(te_run, monkeypatch):
    """launch.get_forward_backward_func's schedule checks the chunks it is given at its first call."""
    import megatron.core.parallel_state as ps

    from octopipe_plugin.adapters.megatron.launch import te_checked

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 0)
    plan = read_plan(plan_file(te_run))
    TeLinear = type("TELinear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    calls = []
    schedule = te_checked(plan, lambda **kw: calls.append(kw) or [], te_split=False)
    with pytest.raises(OctoPipeError, match="holds Transformer Engine linears and runs I/W"):
        schedule(model=[torch.nn.Sequential(TeLinear(2, 2)), torch.nn.Linear(2, 2)], forward_only=False)
    assert calls == []  # refused before anything ran
    local = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert schedule(model=local, forward_only=False) == [] and len(calls) == 1
