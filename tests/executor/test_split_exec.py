"""The executor runs plans with split layers (issue 20 item 4): loss and every gradient equal a float64 reference.

One group of gloo ranks per world size runs every plan of that size: a split LM head, a split
embedding and a tied pair, on looped, V-shape and tuned irregular plans (shard actions placed by
the split scheduler or chosen by `tune_split`), uneven shares, an owner that holds no shard, every
other plan untagged (the per-pair order rule alone matches the messages). Every rank compares the
gradients it holds, each shard against the same rows of the reference (testing/split_checks.py).
A split plan that would deadlock is refused before any process starts.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.executor import PipelineExecutor, RunnerInterfaceError, check_runnable, check_runner
from octopipe_plugin.executor.launch import spawn
from octopipe_plugin.formats import Plan, Stage, plan_to_dict
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for
from octopipe_plugin.testing.plans import make_plan, random_bounds
from octopipe_plugin.testing.split_checks import (
    check_split_plans_worker, cost_model, embedding_split, head_split, with_shards,
)
from octopipe_plugin.testing.toy import ToySpec

pytestmark = pytest.mark.timeout(600)

SPEC = ToySpec(layers=("embed", "mlp", "attn", "mlp", "attn", "mlp", "lm"), vocab=29)
TIED = replace(SPEC, tied=True)
TIED9 = replace(TIED, layers=("embed",) + ("mlp", "attn") * 3 + ("mlp", "lm"))  # 8 stages of a V on 4 devices


def generated(name: str, p: int, m: int, seed: int, splits_of, spec: ToySpec = SPEC, label: str = ""):
    """A built-in schedule on random non-uniform stages, its split layers' shard actions placed."""
    v = 2 if name in ("zb-v", "interleaved-1f1b") else 1
    devs = stage_devices_for(name, p, v)
    plan = make_plan(stage_devices=devs, bounds=random_bounds(len(spec.layers), len(devs), random.Random(seed)),
                     num_devices=p, num_microbatches=m, schedule=SCHEDULES[name].generate(devs, p, m))
    plan = with_shards(spec, plan, splits_of(plan))
    return _doc(plan, label or f"{name} p={p} m={m} splits={[(s.layer, s.devices) for s in plan.splits]}"), spec


def tuned(p: int, m: int, spec: ToySpec = SPEC):
    """The split-aware tuner's plan for the toy's cost model (a heavy head): its own irregular orders."""
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.tuner.split import tune_split

    cluster = replace(zero_cost_cluster(p), memory_bytes=1 << 40)
    plan = tune_split(cost_model(spec, 4.0), cluster, m, iterations=10, time_budget_s=20, seed=p).plan
    assert plan.splits, "the tuner chose no split for a 4 ms head: the test would not test splits"
    return _doc(plan, f"tuned p={p} m={m} splits={plan.splits}"), spec


def _doc(plan, label: str) -> dict:
    check_runnable(plan, nccl=True)  # every plan here also survives NCCL's rules
    doc = plan_to_dict(plan)
    doc["meta"] = {"label": label}
    return doc


def _run(p: int, cases) -> None:
    docs, specs = zip(*cases)
    spawn(check_split_plans_worker, p, list(docs), list(specs))


@pytest.mark.distributed
def test_split_head_embedding_and_tied_on_two_ranks_looped_and_v_shape():
    both = lambda plan: [head_split(SPEC, [0, 1]), embedding_split([0, 1])]  # noqa: E731
    _run(2, [
        generated("1f1b", 2, 3, 1, lambda plan: [head_split(SPEC, [0, 1], [0.3, 0.7])]),
        generated("interleaved-1f1b", 2, 4, 2, both, label="looped, head + embedding"),
        generated("zb-v", 2, 3, 3, both, label="V-shape, head + embedding"),
        generated("zb-v", 2, 2, 4, both, TIED, label="V-shape, tied head and embedding"),
        # the head moved whole onto device 0, away from its owner stage's device 1
        generated("gpipe", 2, 3, 5, lambda plan: [head_split(SPEC, [0], [1.0])], label="owner holds no shard"),
        generated("zb-h1", 2, 3, 6, lambda plan: [embedding_split([1, 0], [0.6, 0.4])], label="embedding only"),
    ])


@pytest.mark.distributed
def test_split_plans_on_three_and_four_ranks_tuned_and_irregular():
    _run(3, [
        tuned(3, 4),
        generated("interleaved-1f1b", 3, 4, 7, lambda plan: [head_split(SPEC, [0, 2], [0.45, 0.55]),
                                                              embedding_split([1, 2])], label="looped, subsets"),
        generated("1f1b", 3, 4, 8, lambda plan: [head_split(TIED, [0, 1, 2]), embedding_split([0, 1, 2])], TIED,
                  label="tied over three"),
    ])
    _run(4, [tuned(4, 5), tuned(4, 3),
             generated("zb-v", 4, 5, 9, lambda plan: [head_split(TIED9, [0, 1, 2, 3], [0.1, 0.4, 0.2, 0.3]),
                                                      embedding_split([0, 1, 2, 3], [0.1, 0.4, 0.2, 0.3])], TIED9,
                       label="V-shape, tied over four, uneven")])


def _deadlocking() -> Plan:
    """Device 0 lists 1J0 before its own 1H0, whose statistics 1J0 needs (and device 1's 1J0 waits on device 0's)."""
    return Plan(model="toy-lm", num_devices=2, num_microbatches=1,
                stages=(Stage(start=0, end=4, device=0), Stage(start=4, end=7, device=1)),
                schedule=parse_schedule([["0F0", "1J0", "1H0", "0B0", "1K0"], ["1F0", "1H0", "1J0", "1B0", "1K0"]]),
                splits=(head_split(SPEC, [0, 1]),))


def test_a_split_plan_that_would_deadlock_is_refused_before_any_process_starts():
    plan = _deadlocking()
    with pytest.raises(DeadlockError, match="device 0 stuck at 1J0") as exc:
        PipelineExecutor(plan, object(), rank=0)  # no process group exists: refused before any is needed
    assert "waiting for head-shard forward 1H0 on device 0" in str(exc.value).splitlines()[1]

    from octopipe_plugin.executor.dryrun import dry_run

    with pytest.raises(DeadlockError, match="device 0 stuck at 1J0"):
        dry_run(cost_model(SPEC), plan, time_scale=1.0)  # simulated first: no process is spawned


def test_a_runner_without_a_shard_method_is_refused_in_one_line_naming_it():
    from octopipe_plugin.actions import Kind
    from octopipe_plugin.executor import TorchStages

    runner = TorchStages(modules={}, num_stages=2, num_microbatches=1)
    with pytest.raises(RunnerInterfaceError, match=r"has no method head_forward\(\)") as exc:
        check_runner(runner, {Kind.F, Kind.B, Kind.H, Kind.J, Kind.K})
    assert "\n" not in str(exc.value)
    with pytest.raises(RunnerInterfaceError, match=r"has no method split_meta\(\)"):
        check_runner(runner, {Kind.F, Kind.B}, split=True)


@pytest.mark.distributed
def test_octopipe_dryrun_of_a_tuned_split_plan_sleeps_the_shards_and_checks_every_hand_over(tmp_path, capsys):
    from octopipe_plugin.cli import main
    from octopipe_plugin.formats import plan_from_dict, write_model, write_plan
    from octopipe_plugin.schedules.split_messages import split_messages

    doc, spec = tuned(4, 5)
    plan = plan_from_dict(doc)
    write_model(cost_model(spec, 4.0), tmp_path / "m.json")
    write_plan(plan, tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json"), "--target-s", "0.3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    checked = int(out.split("messages checked: ")[1].split()[0])
    # every split hand-over crossing devices was checked on arrival (micro-batch and kind), besides the stage ones
    assert checked >= len(split_messages(plan)) + plan.num_microbatches, out
    assert "predicted" in out and "measured" in out


def test_octopipe_dryrun_refuses_a_deadlocking_split_plan_before_starting_processes(tmp_path, capsys):
    from octopipe_plugin.cli import main
    from octopipe_plugin.formats import write_model, write_plan

    write_model(cost_model(SPEC), tmp_path / "m.json")
    write_plan(_deadlocking(), tmp_path / "p.json")
    rc = main(["dryrun", str(tmp_path / "p.json"), "--model", str(tmp_path / "m.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "error: plan deadlocks:" in err and "device 0 stuck at 1J0" in err, err
