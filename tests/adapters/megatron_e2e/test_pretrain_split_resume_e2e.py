"""End to end through megatron.training.pretrain: checkpoints move between a split-head plan and Megatron's layout.

2 gloo ranks (pipeline size 2), the tiny GPT of test_pretrain_e2e.py, embeddings untied, 4 micro-batches
per step, `--save` every 3 iterations (torch_dist, fully reshardable distributed optimizer):

- a plan with the LM head split over both ranks (uneven shares; each shard rank's HeadShard saves its rows
  as its slice of the one global output_layer.weight) trains 6 iterations and saves at iteration 3;
- Megatron's own schedule and layout (whole output_layer) trains 6 iterations and saves at iteration 3;
- Megatron's layout resumed from the split plan's checkpoint, and the split plan resumed from Megatron's.

- Megatron's layout resumed from its own checkpoint: the oracle (a resumed run is not the uninterrupted
  one: iteration 5 differs, in every resumed run alike, as in test_pretrain_e2e.py).

Checked: the straight runs agree per iteration, and both cross-layout resumed runs log iterations 4..6
with the losses of Megatron's own resumed run (relative 1e-5: the shards sum the softmax in another order
than Megatron's vocab-parallel cross-entropy), which needs the weights, Adam's moments and step of every
row of the head (and of everything else) to have travelled; iteration 6 also ends where the straight runs do.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from e2e_runs import MODEL, RESUME, launch, loss_table
from octopipe_plugin.executor.dryrun import zero_cost_cluster
from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.testing.plans import make_plan, sample_schedule
from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards


def _has_split_runtime() -> bool:
    import importlib

    try:
        placement = importlib.import_module("octopipe_plugin.adapters.megatron.placement")
        vocab_shard = importlib.import_module("octopipe_plugin.executor.vocab_shard")
    except ImportError:
        return False
    return hasattr(placement, "attach_head_shard") and hasattr(vocab_shard, "VocabShards")


pytestmark = [pytest.mark.framework, pytest.mark.distributed,
              # a split plan's pretrain() run is the Megatron adapter's split runtime (megsplit) over the executor's
              # VocabShards (shardcore); this test runs once both are on the branch
              pytest.mark.skipif(not _has_split_runtime(),
                                 reason="the Megatron split-head runtime (placement.attach_head_shard, "
                                        "executor.vocab_shard.VocabShards) is not on this branch yet")]

M = 4
BOUNDS = [(0, 2), (2, 3), (3, 4), (4, 6)]  # graph layers: embedding, 4 decoder layers, LM head
KINDS = ["embedding", "dense", "moe", "dense", "moe", "lm_head"]  # --moe-layer-freq [0,1,0,1]
MEGATRON_LAYOUT = "Et|t|t|tL"
# evaluation off: a split plan's evaluation step is not run by the adapter yet (test_pretrain_split_e2e.py)
ARGS = [*MODEL, "--global-batch-size", str(M), "--untie-embeddings-and-output-weights", "--eval-iters", "0"]


def _graph() -> Model:
    return Model(name="train_gpt", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1,
              output_bytes=1) for i, k in enumerate(KINDS)))


def _split_plan(d: Path) -> str:
    """A looped plan on Megatron's stages (the same initial weights) with its LM head split over both ranks."""
    devices = [0, 1, 0, 1]
    split = SplitLayer(layer=len(KINDS) - 1, devices=(1, 0), shares=(0.35, 0.65))
    cluster = replace(zero_cost_cluster(2), memory_bytes=1 << 40)
    for seed in range(21, 71):  # the first random order (I/W split at random) that takes the shard actions
        plan = make_plan(stage_devices=devices, bounds=BOUNDS, num_devices=2, num_microbatches=M,
                         schedule=sample_schedule(devices, 2, M, random.Random(seed)), model="train_gpt")
        with_split = insert_shards(_graph(), cluster, replace(plan, splits=(split,)), ShardPolicy())
        if with_split is not None:
            break
    assert with_split is not None, "no order takes the shard actions"
    write_plan(with_split, d / "split.json")
    return str(d / "split.json")


@pytest.mark.timeout(2400)
def test_split_plan_and_megatron_resume_from_each_others_checkpoints(tmp_path):
    split = ["--pipeline-schedule", "octopipe", "--octopipe-plan", _split_plan(tmp_path)]
    megatron = ["--pipeline-model-parallel-layout", MEGATRON_LAYOUT]
    out = {
        "split": launch(tmp_path / "split.log", *ARGS, *split, "--save", str(tmp_path / "ck_split")),
        "megatron": launch(tmp_path / "megatron.log", *ARGS, *megatron, "--save", str(tmp_path / "ck_megatron")),
    }
    out["megatron<-megatron"] = launch(tmp_path / "m_from_m.log", *ARGS, *megatron, "--load",
                                       str(tmp_path / "ck_megatron"), *RESUME)
    out["megatron<-split"] = launch(tmp_path / "m_from_s.log", *ARGS, *megatron, "--load", str(tmp_path / "ck_split"),
                                    *RESUME)
    out["split<-megatron"] = launch(tmp_path / "s_from_m.log", *ARGS, *split, "--load", str(tmp_path / "ck_megatron"),
                                    *RESUME)
    print(loss_table(out))
    for name in out:
        assert sorted(out[name]["train"]) == ([1, 2, 3, 4, 5, 6] if "<-" not in name else [4, 5, 6]), name
    for it in range(1, 7):  # the split run is exact
        assert out["split"]["train"][it] == pytest.approx(out["megatron"]["train"][it], rel=1e-5, abs=0), it
    want = out["megatron<-megatron"]["train"]
    for resumed in ("megatron<-split", "split<-megatron"):
        for it in (4, 5, 6):
            got = out[resumed]["train"][it]
            assert got == pytest.approx(want[it], rel=1e-5, abs=0), f"{resumed} iteration {it}: {got} vs {want[it]}"
    assert want[6] == pytest.approx(out["megatron"]["train"][6], rel=1e-5, abs=0)
