"""End to end through megatron.training.pretrain: a plan that splits the LM head and the embedding
(examples/megatron/train_gpt.py), and checkpoints that move between that plan and Megatron's layout.

2 gloo ranks (pipeline size 2), the tiny GPT of test_pretrain_e2e.py (MoE layers with aux loss),
embeddings untied, 4 micro-batches per step, evaluation every 3 iterations on 2 micro-batches, `--save`
at iteration 3 (torch_dist, fully reshardable distributed optimizer) (tied: below).
Six launches, same seeds, one module-scoped fixture; the straight runs on the probe script
train_gpt_grads.py saving the first step's reduced gradients:

- Megatron's own schedule on the layout "Et|t|t|tL" (saves);
- an OctoPipe plan on the same stages (looped, so the same initial weights) without splits;
- the same plan with the LM head split over both ranks (uneven shares; the owner, rank 1, holds one)
  and the embedding too (stage 0's rank 0 holds one share): each rank's HeadShard and EmbeddingShard
  are attached by the model-construction hooks before DDP wrapping, initialised from the owners'
  Megatron-built head and word embedding; stage 0's forward steps (train_gpt.py's get_batch on the
  ranks Megatron builds data on) are read ahead and their token ids sent to rank 1's shard. Each
  shard rank saves its rows as its slice of the one global output_layer.weight and word embedding (saves);
- resumed at iteration 3: Megatron's layout from its own checkpoint (the oracle: a resumed run is not
  the uninterrupted one, iteration 5 differs in every resumed run alike, as in test_pretrain_e2e.py),
  Megatron's layout from the split plan's checkpoint, and the split plan from Megatron's.

Checked: the split run's logged training and validation losses (the executor's forward-only split
program, H and J's loss) equal the unsplit runs' per iteration (relative 1e-5: the shards sum the
softmax in another order than Megatron's vocab-parallel cross-entropy); every parameter's main_grad
before the first optimizer step equals Megatron's (the shards' rows against the same rows of Megatron's
output_layer and word embedding gradients) at a tolerance a 1% scale error fails; both cross-layout
resumed runs log iterations 4..6 and validation 6 with the losses of Megatron's own resumed run
(relative 1e-5), which needs the weights, Adam's moments and step of every row of the head and the
embedding (and of everything else) to have travelled; iteration 6 also ends where the straight runs do.
(This file took over test_pretrain_split_resume_e2e.py, which resumed a head-only split plan from two
straight runs of its own, without evaluation: the same checks on this file's straight launches.)

Tied (Megatron's default), two more launches' worth: Megatron's own schedule (conftest.py's tied_megatron,
the launch test_pretrain_e2e.py compares against too) and the plan splitting only the head (its shards are
rows of the embedding, tied to it): the same losses, and the embedding's and the shards' main_grads against
Megatron's tied gradient.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from e2e_runs import (MEGATRON_LAYOUT, MODEL, PROBE, RESUME, SPLIT_KINDS, SPLIT_M, TIED_ARGS, launch, loss_table,
                      split_head_plans)
from megatron_harness import grad_mismatches  # on sys.path through e2e_runs
from octopipe_plugin.formats.splits import SplitLayer

pytestmark = [pytest.mark.framework, pytest.mark.distributed,
              # the shards' math is the executor's VocabShards (SHARD_API.md, being built on branch w-shardcore)
              pytest.mark.skipif(not hasattr(__import__("octopipe_plugin.executor.vocab_shard", fromlist=["x"]),
                                             "VocabShards"),
                                 reason="executor.vocab_shard.VocabShards is not on this branch yet (w-shardcore)")]

ARGS = [*MODEL, "--global-batch-size", str(SPLIT_M), "--eval-global-batch-size", "2",
        "--untie-embeddings-and-output-weights"]
# the LM head and the embedding split over both ranks (uneven shares, owner rank 1)
SPLITS = (SplitLayer(layer=0, devices=(1, 0), shares=(0.45, 0.55)),
          SplitLayer(layer=len(SPLIT_KINDS) - 1, devices=(1, 0), shares=(0.35, 0.65)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e_split")
    plain, split = split_head_plans(d, splits=SPLITS)
    megatron = ["--pipeline-model-parallel-layout", MEGATRON_LAYOUT]
    split_plan = ["--pipeline-schedule", "octopipe", "--octopipe-plan", split]
    out = {}
    for name, extra in (("megatron", [*megatron, "--save", str(d / "ck_megatron")]),
                        ("octopipe", ["--pipeline-schedule", "octopipe", "--octopipe-plan", plain]),
                        ("split", [*split_plan, "--save", str(d / "ck_split")])):
        out[name] = launch(d / f"{name}.log", *ARGS, *extra, script=PROBE,
                           env={"OCTOPIPE_E2E_GRADS": str(d / f"grads_{name}.pt")})
    grads = {name: torch.load(d / f"grads_{name}.pt") for name in out}
    # the straight runs' checkpoints at iteration 3, resumed under the other layout and under Megatron's own
    for name, extra, ck in (("megatron<-megatron", megatron, "ck_megatron"), ("megatron<-split", megatron, "ck_split"),
                            ("split<-megatron", split_plan, "ck_megatron")):
        out[name] = launch(d / f"{name.replace('<-', '_from_')}.log", *ARGS, *extra, "--load", str(d / ck), *RESUME)
    shutil.rmtree(d / "ck_megatron", ignore_errors=True)
    shutil.rmtree(d / "ck_split", ignore_errors=True)
    print(loss_table(out))
    return {"losses": out, "grads": grads}


@pytest.mark.timeout(1800)
def test_split_plan_logs_the_unsplit_losses(runs):
    """Every iteration's logged training loss, and every validation loss, of the split run equal Megatron's."""
    losses = runs["losses"]
    meg, octo, split = losses["megatron"]["train"], losses["octopipe"]["train"], losses["split"]["train"]
    assert sorted(meg) == list(range(1, 7))
    # the plain plan's random order (I/W split) sums the micro-batches' gradients in another order than
    # Megatron's 1F1B: equal up to fp32 rounding, shown in the 7th digit of a logged loss (a 1% error fails)
    assert sorted(octo) == sorted(meg)
    for it in meg:
        assert octo[it] == pytest.approx(meg[it], rel=1e-6, abs=0), f"iteration {it}: {octo[it]} vs {meg[it]}"
    assert sorted(split) == sorted(meg)
    for it in meg:
        assert split[it] == pytest.approx(meg[it], rel=1e-5, abs=0), f"iteration {it}: {split[it]} vs {meg[it]}"
    valid, want = losses["split"]["valid"], losses["megatron"]["valid"]
    assert sorted(want) == [3, 6] and sorted(valid) == [3, 6]
    for it in want:
        assert valid[it] == pytest.approx(want[it], rel=1e-5, abs=0), f"validation {it}: {valid[it]} vs {want[it]}"


@pytest.mark.timeout(1800)
def test_split_plan_main_grads_match_megatron(runs):
    """Every parameter's reduced main_grad before the first step: the shards' rows against Megatron's head and word
    embedding rows."""
    got, want = runs["grads"]["split"], runs["grads"]["megatron"]
    sharded = ("output_layer.weight", "embedding.word_embeddings.weight")
    shard_keys = [k for k in got if k.startswith(tuple(f"{n}[" for n in sharded))]
    assert len(shard_keys) == 4, sorted(got)
    rows = {k: want[k.split("[")[0]][slice(*map(int, k.split("[")[1][:-1].split(":")))] for k in shard_keys}
    want_split = {**{k: v for k, v in want.items() if k not in sharded}, **rows}
    assert len(want) > 10 and set(got) == set(want_split)
    assert grad_mismatches(got, want_split) == []
    assert grad_mismatches({k: 1.01 * v for k, v in got.items()}, want_split), "a 1% scale error passes"


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory, tied_megatron):
    """Megatron's default, the embedding tied to the head: Megatron's own schedule (conftest.py's tied_megatron, the
    same arguments), and a plan splitting the head (its shards rows of the embedding, tied by executor.tied_rows;
    rank 0 holds the embedding and a shard)."""
    d = tmp_path_factory.mktemp("e2e_tied_split")
    _, split = split_head_plans(d)  # the head only: a split embedding tied to the head is refused
    assert TIED_ARGS == [a for a in ARGS if a != "--untie-embeddings-and-output-weights"]  # the twin's arguments
    out = {"megatron": tied_megatron,
           "split": launch(d / "split.log", *TIED_ARGS, "--pipeline-schedule", "octopipe", "--octopipe-plan", split,
                           script=PROBE, env={"OCTOPIPE_E2E_GRADS": str(d / "grads_split.pt")})}
    print(loss_table(out))
    return {"losses": out, "grads": {"megatron": tied_megatron["grads"], "split": torch.load(d / "grads_split.pt")}}


@pytest.mark.timeout(1800)
def test_tied_split_head_logs_megatrons_losses_and_main_grads(tied_runs):
    """Tied: every logged training and validation loss equals Megatron's tied run's (relative 1e-5), and every
    main_grad before the first step: the embedding's the whole tied gradient, each shard's its rows of it
    (Megatron's head copy holds the same after its embedding-group all-reduce); x1.01 fails."""
    losses = tied_runs["losses"]
    for kind, iters in (("train", list(range(1, 7))), ("valid", [3, 6])):
        want, got = losses["megatron"][kind], losses["split"][kind]
        assert sorted(want) == sorted(got) == iters, kind
        for it in want:
            assert got[it] == pytest.approx(want[it], rel=1e-5, abs=0), f"{kind} {it}: {got[it]} vs {want[it]}"
    got, want = tied_runs["grads"]["split"], tied_runs["grads"]["megatron"]
    embedding = "embedding.word_embeddings.weight"
    shard_keys = [k for k in got if k.startswith("output_layer.weight[")]
    assert len(shard_keys) == 2, sorted(got)
    rows = {k: want[embedding][slice(*map(int, k[len("output_layer.weight["):-1].split(":")))] for k in shard_keys}
    want_split = {**{k: v for k, v in want.items() if k != "output_layer.weight"}, **rows}
    assert len(want) > 10 and set(got) == set(want_split)
    assert grad_mismatches(got, want_split) == []
    assert grad_mismatches({k: 1.01 * v for k, v in got.items()}, want_split), "a 1% scale error passes"


@pytest.mark.timeout(1800)
def test_split_plan_and_megatron_resume_from_each_others_checkpoints(runs):
    """Resumed at iteration 3 across layouts (the split head and embedding <-> Megatron's whole ones): Megatron's own
    resumed losses, and iteration 6 where the straight runs end."""
    out = runs["losses"]
    for name in ("megatron<-megatron", "megatron<-split", "split<-megatron"):
        assert sorted(out[name]["train"]) == [4, 5, 6] and sorted(out[name]["valid"]) == [6], name
    want = out["megatron<-megatron"]
    for resumed in ("megatron<-split", "split<-megatron"):
        for kind, it in (("train", 4), ("train", 5), ("train", 6), ("valid", 6)):
            got = out[resumed][kind][it]
            assert got == pytest.approx(want[kind][it], rel=1e-5, abs=0), \
                f"{resumed} {kind} {it}: {got} vs {want[kind][it]}"
    assert want["train"][6] == pytest.approx(out["megatron"]["train"][6], rel=1e-5, abs=0)
