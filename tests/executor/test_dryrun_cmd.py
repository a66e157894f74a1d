"""`octopipe dryrun`: real executor, sleeping stand-ins, every message checked; bad plans refused."""

from __future__ import annotations

import pytest
import torch

from octopipe_plugin.cli import main
from octopipe_plugin.executor import ExecutorError
from octopipe_plugin.testing.plans import make_plan
from octopipe_plugin.executor.standin import SleepStages, StandInCosts
from octopipe_plugin.formats import Layer, Model, write_model, write_plan
from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.schedules.registry import build_plan


def _model() -> Model:
    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + 0.5 * (i % 3), bwd_ms=1.0, wgrad_ms=0.7,
                         state_bytes=1, activation_bytes=1, output_bytes=1 << 20) for i in range(8))
    return Model(name="hetero8", layers=layers)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_dryrun_runs_a_split_backward_v_plan_and_checks_every_message(tmp_path, capsys):
    model = _model()
    plan = build_plan(model, "zb-v", 2, 3)
    write_model(model, tmp_path / "m.json")
    write_plan(plan, tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--target-s", "0.2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # every stage boundary carries one activation and one gradient per micro-batch
    expected = 2 * plan.num_microbatches * (plan.num_stages - 1)
    assert f"messages checked: {expected} " in out
    assert "predicted" in out and "measured" in out and out.count("\n") >= 5 + plan.num_devices


def test_dryrun_refuses_a_deadlocking_plan_before_starting_processes(tmp_path, capsys):
    model = _model()
    plan = make_plan(stage_devices=[0, 1, 1, 0], bounds=[(0, 2), (2, 4), (4, 6), (6, 8)], num_devices=2,
                     num_microbatches=1,
                     schedule=parse_schedule([["3F0", "0F0", "3B0", "0B0"], ["2F0", "1F0", "2B0", "1B0"]]))
    write_model(model, tmp_path / "m.json")
    write_plan(plan, tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json")])
    assert rc == 2
    assert "deadlock" in capsys.readouterr().err


def test_standin_rejects_a_message_for_the_wrong_microbatch():
    costs = StandInCosts(fwd=(0.0, 0.0, 0.0), bwd=(0.0, 0.0, 0.0), wgrad=(0.0, 0.0, 0.0), hop=(0.0, 0.0, 0.0))
    run = SleepStages(costs=costs, rank=1)
    good = run.forward(0, 2, None)
    run.forward(1, 2, good)  # matches: micro-batch 2 from stage 0
    with pytest.raises(ExecutorError, match="micro-batch 2 from stage 0.*expected micro-batch 3"):
        run.forward(1, 3, good)
    grad = (torch.tensor([3.0, 2.0, 1.0, 0.0, 1.0], dtype=torch.float64),)  # gradient of mb 3 from stage 2
    run.backward_input(1, 3, grad)
    with pytest.raises(ExecutorError, match="expected micro-batch 3 from stage 2"):
        run.backward(1, 3, good)  # an activation where a gradient was due


def _branched() -> Model:
    """vision -> projector, a text embedding (a second source), and a decoder layer consuming both."""
    kinds = ("vision", "vision", "projector", "embedding", "dense", "dense", "lm_head")
    layers = tuple(Layer(name=f"l{i}", kind=k, fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=0.5, state_bytes=1, activation_bytes=1,
                         output_bytes=(1 + i) << 16) for i, k in enumerate(kinds))
    return Model(name="branched7", layers=layers, inputs={3: (), 4: (2, 3)})


def test_standins_carry_one_payload_per_output_live_across_the_cut():
    from octopipe_plugin.executor.standin import stage_live_outputs
    from octopipe_plugin.formats import Stage

    stages = [Stage(start=0, end=2, device=0), Stage(start=2, end=4, device=1), Stage(start=4, end=7, device=0)]
    live = stage_live_outputs(_branched(), stages)
    assert live == ((1,), (2, 3), ())  # the cut before the decoder carries the projector's and the embedding's outputs
    zero = StandInCosts(fwd=(0.0,) * 3, bwd=(0.0,) * 3, wgrad=(0.0,) * 3, hop=(0.0,) * 3)
    run = SleepStages(costs=zero, rank=1, live=live)
    out = run.forward(1, 0, run.forward(0, 0, None))
    assert [int(p[4]) for p in out] == [2, 3]
    with pytest.raises(ExecutorError, match="1 payloads across boundary 1, the model graph has 2 live outputs"):
        run.forward(2, 0, out[:1])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_dryrun_of_a_plan_cutting_a_branch(tmp_path, capsys):
    model = _branched()
    devs = [0, 1, 1, 0]
    from octopipe_plugin.schedules.registry import SCHEDULES

    plan = make_plan(stage_devices=devs, bounds=[(0, 2), (2, 4), (4, 5), (5, 7)], num_devices=2, num_microbatches=3,
                     schedule=SCHEDULES["zb-v"].generate(devs, 2, 3))
    write_model(model, tmp_path / "m.json")
    write_plan(plan, tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--target-s", "0.2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"messages checked: {2 * 3 * 3} " in out


def _two_device_cluster(path) -> str:
    from octopipe_plugin.formats import Cluster, Link, write_cluster

    link = Link(bandwidth_gb_per_s=2.0, latency_us=100.0)  # the order of a gloo pair on one host
    write_cluster(Cluster(num_devices=2, devices_per_node=2, memory_bytes=1 << 33, intra_node=link, inter_node=link,
                          name="local2"), path)
    return str(path)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_wall_clock_dryrun_sends_the_models_bytes_and_checks_every_message(tmp_path, capsys):
    model = _model()
    plan = build_plan(model, "1f1b", 2, 3)
    write_model(model, tmp_path / "m.json")
    write_plan(plan, tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--target-s", "0.2",
               "--clock", "wall", "--cluster", "h100x2", "--links", _two_device_cluster(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "transfers: the model's bytes over gloo, predicted with links of" in out and "clock: wall" in out
    assert f"messages checked: {2 * plan.num_microbatches * (plan.num_stages - 1)} " in out


def test_wall_clock_payloads_carry_the_cut_bytes_and_wait_for_no_stamp(monkeypatch):
    import octopipe_plugin.executor.clock as clock_mod

    costs = StandInCosts(fwd=(1.0, 1.0), bwd=(1.0, 1.0), wgrad=(0.0, 0.0), hop=(5000.0, 0.0),
                         payload_bytes=(1 << 20, 0))
    wall = SleepStages(costs=costs, rank=1, clock="wall")
    assert wall.boundary_meta(0)[0].shape == ((1 << 20) // 8,)  # the model's bytes, float64
    assert SleepStages(costs=costs, rank=1).boundary_meta(0)[0].shape == (5,)  # device clock: the header only
    sent = wall.forward(0, 0, None)
    assert sent[0].numel() == (1 << 20) // 8
    slept = []
    monkeypatch.setattr(clock_mod.time, "sleep", slept.append)
    wall.forward(1, 0, sent)  # a 5 s hop is priced in `hop`, but the wall clock waits only its own 1 ms F
    assert slept and max(slept) <= 0.001 + 1e-9


def test_wall_clock_refuses_payloads_the_host_cannot_hold_and_warns_without_a_cluster(tmp_path, capsys, monkeypatch):
    import octopipe_plugin.profile.device as device_mod

    model = _model()
    write_model(model, tmp_path / "m.json")
    write_plan(build_plan(model, "1f1b", 2, 3), tmp_path / "p.json")
    monkeypatch.setattr(device_mod, "device_memory_bytes", lambda device: 4 << 20)  # a host with 4 MiB free
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--clock", "wall"])
    err = capsys.readouterr().err
    assert rc == 2 and "MiB of payloads per step" in err and "shorter seq_len" in err
    assert "prediction prices them free" in err


def test_links_go_with_the_wall_clock_only(tmp_path, capsys):
    model = _model()
    write_model(model, tmp_path / "m.json")
    write_plan(build_plan(model, "1f1b", 2, 3), tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--links",
               _two_device_cluster(tmp_path / "c.json")])
    assert rc == 2 and "add --clock wall" in capsys.readouterr().err
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--clock", "wall", "--links",
               "v100x2"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --links v100x2: unknown GPU" in err


def test_dryrun_refuses_a_scale_where_host_overhead_decides(tmp_path, capsys):
    # F costs 1 ms of host time per action (the file's figures): 3 micro-batches x 4 actions per device
    # are far more than 5% of a 10 ms step; the refusal names the target that would do, before any process
    import json

    model = _model()
    write_model(model, tmp_path / "m.json")
    write_plan(build_plan(model, "zb-v", 2, 3), tmp_path / "p.json")
    (tmp_path / "ov.json").write_text(json.dumps({
        "format": "octopipe-overheads/1", "action_us": {"F": 1000.0, "B": 0.0, "I": 0.0, "W": 0.0},
        "send_us": {"fixed": 0.0}, "recv_us": {"fixed": 0.0}}))
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--target-s", "0.01",
               "--overheads", str(tmp_path / "ov.json"), "--strict-host-share"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--strict-host-share" in err and "6.0 ms per step" in err and "use --target-s 0.12 or more" in err
