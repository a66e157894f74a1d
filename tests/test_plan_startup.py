"""plan_startup: the steps run in their order on rank 0, and every rank ends with rank 0's plan or its one-line
error (2 gloo ranks; the framework tests cover the same service through Megatron's and DeepSpeed's start-up)."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.executor.launch import init_gloo, spawn
from octopipe_plugin.formats import Layer, Model, plan_to_dict, read_plan, write_plan
from octopipe_plugin.plan_startup import PlanSteps, StartupError, obtain_plan, one_line, plan_at_startup
from octopipe_plugin.schedules.registry import build_plan

COST = dict(fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1, output_bytes=1)


def _plan(layers: int = 4):
    model = Model(name="m", layers=tuple(Layer(name=f"l{i}", kind="dense", **COST) for i in range(layers)))
    return build_plan(model, "1f1b", 2, 4)


def test_steps_run_in_order_checked_adapted_and_saved(tmp_path):
    given, resume = tmp_path / "given.json", tmp_path / "resume.json"
    write_plan(_plan(4), str(given))
    write_plan(_plan(6), str(resume))
    seen = []
    steps = PlanSteps(plan_file=str(given), resume_file=str(resume), tune=lambda: _plan(8),
                      check=lambda p, src: seen.append(("check", src)),
                      adapt=lambda p, src: seen.append(("adapt", src)) or p,
                      save_to=(str(tmp_path / "out" / "saved.json"),))
    plan, source = obtain_plan(steps)
    assert source == str(given) and plan.stages[-1].end == 4  # the user's file wins over resume and tuning
    assert seen == [("check", str(given)), ("adapt", str(given))]
    assert plan_to_dict(read_plan(str(tmp_path / "out" / "saved.json"))) == plan_to_dict(plan)
    plan, source = obtain_plan(PlanSteps(resume_file=str(resume), tune=lambda: _plan(8)))
    assert source == str(resume) and plan.stages[-1].end == 6
    plan, source = obtain_plan(PlanSteps(resume_file=str(tmp_path / "absent.json"), tune=lambda: _plan(8)))
    assert source == "the plan tuned at start-up" and plan.stages[-1].end == 8
    with pytest.raises(StartupError, match="no plan for this run; expected a plan"):
        obtain_plan(PlanSteps())


def test_one_line_keeps_octopipe_messages_and_names_other_errors():
    assert one_line(OctoPipeError("bad\n  plan")) == "bad plan"
    assert one_line(FileNotFoundError(2, "No such file", "/x/plan.json")) == "/x/plan.json: no such file (FileNotFoundError)"
    assert one_line(KeyError("stages")) == "KeyError: 'stages'"


def _worker(rank: int, world: int, port: int, out_dir: str, case: str) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    good = os.path.join(out_dir, "good.json")

    def broken_tune():
        raise RuntimeError("the tuner fell over")

    steps = {"missing": PlanSteps(plan_file=os.path.join(out_dir, "nowhere.json") if rank == 0 else good),
             "tune_error": PlanSteps(tune=broken_tune if rank == 0 else (lambda: _plan(4))),
             "ok": PlanSteps(plan_file=good if rank == 0 else os.path.join(out_dir, "nowhere.json"))}[case]
    try:
        plan, source = plan_at_startup(steps)
        result = {"plan": plan_to_dict(plan), "source": source}
    except StartupError as exc:
        result = {"error": str(exc)}
    with open(os.path.join(out_dir, f"{case}.{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, expected", [
    ("missing", "nowhere.json: field $: expected a readable file, got No such file or directory"),
    ("tune_error", "RuntimeError: the tuner fell over"),
])
def test_a_rank0_failure_ends_every_rank_with_its_one_line(tmp_path, case, expected):
    write_plan(_plan(4), str(tmp_path / "good.json"))
    spawn(_worker, 2, str(tmp_path), case)
    got = [json.load(open(tmp_path / f"{case}.{r}.json", encoding="utf-8")) for r in range(2)]
    assert got[0] == got[1]  # rank 1 had a plan of its own: only rank 0's outcome counts
    assert "error" in got[0] and got[0]["error"].endswith(expected), got[0]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_every_rank_gets_rank0s_plan(tmp_path):
    write_plan(_plan(4), str(tmp_path / "good.json"))
    spawn(_worker, 2, str(tmp_path), "ok")
    got = [json.load(open(tmp_path / f"ok.{r}.json", encoding="utf-8")) for r in range(2)]
    assert got[0] == got[1] and got[0]["source"] == str(tmp_path / "good.json")
    assert got[0]["plan"] == plan_to_dict(_plan(4))
