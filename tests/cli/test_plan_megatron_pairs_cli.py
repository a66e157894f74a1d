"""`octopipe plan --megatron-args` plans overlapped pairs where the launch can run them (EP > 1, the all-to-all
dispatcher, bf16/fp16: megatron-core's combined step, adapters/megatron/pairs.py) and says which argument to add;
elsewhere it plans none and says why."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.actions import Kind
from octopipe_plugin.cli import main
from octopipe_plugin.formats import read_plan

pytestmark = [pytest.mark.framework, pytest.mark.timeout(300)]

# a MoE GPT whose all-to-alls are worth hiding (analytic costs on H100), EP 2 (PP 1 on 2 ranks unless given)
MOE = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
       "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--vocab-size", "32000",
       "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--global-batch-size", "16", "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size",
       "2", "--bf16"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _plan(capsys, tmp_path, launch):
    out = tmp_path / "plan.json"
    pp = int(launch[launch.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in launch \
        else 1
    rc = main(["plan", "--cluster", f"h100x{pp}", "--world-size", str(2 * pp), "--iterations", "30", "--no-progress",
               "--json", "-o", str(out), "--megatron-args", " ".join(launch)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(text), read_plan(str(out))


def test_an_alltoall_launch_gets_pairs_and_the_overlap_argument(capsys, tmp_path):
    got, plan = _plan(capsys, tmp_path, MOE + ["--moe-token-dispatcher-type", "alltoall"])
    assert plan.pairs and got["pairs"] == {"count": len(plan.pairs), "launch_runs_them": True,
                                           "why": got["pairs"]["why"]}
    assert "--overlap-moe-expert-parallel-comm" in got["add_arguments"]
    # the combined step runs every backward whole: the plan has no I/W, its simulated step what was tuned
    assert not any(a.kind in (Kind.I, Kind.W) for row in plan.schedule for a in row)
    assert not plan.splits and not plan.memory


def test_the_overlap_argument_already_given_is_not_added_again(capsys, tmp_path):
    got, plan = _plan(capsys, tmp_path, MOE + ["--moe-token-dispatcher-type", "alltoall",
                                               "--overlap-moe-expert-parallel-comm"])
    assert plan.pairs and "--overlap-moe-expert-parallel-comm" not in got["add_arguments"]


def test_an_allgather_launch_gets_no_pairs_and_the_reason(capsys, tmp_path):
    got, plan = _plan(capsys, tmp_path, MOE + ["--moe-token-dispatcher-type", "allgather"])
    assert not plan.pairs and not got["pairs"]["launch_runs_them"]
    assert "--moe-token-dispatcher-type allgather" in got["pairs"]["why"] and "alltoall" in got["pairs"]["why"]
    assert "--overlap-moe-expert-parallel-comm" not in got["add_arguments"]


def test_at_pp2_the_paired_plan_keeps_two_stages_on_every_rank(capsys, tmp_path):
    """At PP > 1 megatron-core's TransformerConfig wants a virtual pipeline size under the flag: the paired plan is
    tuned with two or more stages on every rank (not tuned again without pairs); the flag stays where the plan pairs
    and is to drop where no pair pays (here a 3-chunk plan without pairs beats combined 1F1B's pairs)."""
    got, plan = _plan(capsys, tmp_path, MOE + PP2 + ["--moe-token-dispatcher-type", "alltoall",
                                                     "--overlap-moe-expert-parallel-comm"])
    assert min(len(plan.stages_of(d)) for d in range(plan.num_devices)) >= 2
    assert got["pairs"]["launch_runs_them"] and "two or more stages per rank" not in got["pairs"]["why"]
    assert ("--overlap-moe-expert-parallel-comm" in got["drop_arguments"]) == (not plan.pairs)


def test_too_few_layers_for_two_stages_per_rank_are_tuned_again_without_pairs_and_the_flag_is_dropped(capsys,
                                                                                                        tmp_path):
    """Four decoder layers at PP 4 (with the embedding and the head six layers for eight chunks): no plan Megatron
    builds under the flag, so the plan is tuned again as the launch runs without pairs, and the launch's flag (which
    without pairs hides nothing and refuses I/W and split layers) is to drop."""
    few = ["--num-layers", "4"] + MOE[2:]
    assert MOE[:2] == ["--num-layers", "8"]
    got, plan = _plan(capsys, tmp_path, few + ["--pipeline-model-parallel-size", "4", "--moe-token-dispatcher-type",
                                               "alltoall", "--overlap-moe-expert-parallel-comm"])
    assert not plan.pairs and "two or more stages per rank" in got["pairs"]["why"]
    assert "--overlap-moe-expert-parallel-comm" in got["drop_arguments"]
