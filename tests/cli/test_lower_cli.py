"""`octopipe lower PLAN`: a rank's lowered program as text, and the NCCL replay's verdict."""

from __future__ import annotations

from octopipe_plugin.cli import main
from octopipe_plugin.testing.plans import make_plan
from octopipe_plugin.formats import write_plan
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for


def _plan_file(tmp_path) -> str:
    devs = stage_devices_for("1f1b", 2, 1)
    plan = make_plan(stage_devices=devs, bounds=[(0, 1), (1, 2)], num_devices=2, num_microbatches=3,
                     schedule=SCHEDULES["1f1b"].generate(devs, 2, 3))
    path = str(tmp_path / "1f1b.plan.json")
    write_plan(plan, path)
    return path


def test_lower_prints_compute_and_comm_in_order_and_the_nccl_verdict(tmp_path, capsys):
    path = _plan_file(tmp_path)
    assert main(["lower", path, "--rank", "1", "--nccl"]) == 0
    out = [ln.strip() for ln in capsys.readouterr().out.splitlines()]
    assert out[:3] == ["rank 1:", "warm r0->r1", "warm r1->r0"]
    assert out.index("wait recv ACT 0F0 from r0") < out.index("1F0") < out.index("1B0") < out.index(
        "send GRAD 1B0 to r0")
    assert out[-1].startswith("nccl: no rank hangs")


def test_lower_lazy_finds_the_communicator_cycle(tmp_path, capsys):
    assert main(["lower", _plan_file(tmp_path), "--lazy", "--nccl", "--compact"]) == 1
    program, verdict = capsys.readouterr().out.split("nccl: ")
    assert "post recv" not in program and "warm" not in program
    assert "rank 0: creating communicator r1->r0" in verdict


def test_lower_evaluation_on_another_count_and_a_bad_rank(tmp_path, capsys):
    path = _plan_file(tmp_path)
    assert main(["lower", path, "--forward-only", "--microbatches", "5", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "0F4" in out and "B" not in out.replace("rank", "")
    assert main(["lower", path, "--rank", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rank 2: expected 0..1" in err
