"""HeadShard (adapters/megatron/vocab_shards.py): a split plan's LM-head rows start as Megatron's, and checkpoint.

Initial values: Megatron's own initialisation (seeded per pipeline rank as megatron.training seeds it) of a
plan built whole, against the same plan with its head split: the shards' rows put together are the whole
run's output_layer.weight, every other parameter unchanged (the shard ranks drew nothing).

Checkpoints: torch_dist checkpoints (model chunks and distributed Adam, fully reshardable, as
megatron.training writes them) saved under one layout load under another: split plan -> Megatron's own
layout (unsplit output_layer), Megatron -> split plan, split plan -> another split plan (other owner, shard
order, shares and placement), at PP=2, TP=2 x PP=2, DP=2 x PP=2 and in bf16; the word embedding's rows
load as HeadShards under its own key, and a split embedding's EmbeddingShards (split_embedding.py) save to
and load from Megatron's layout; a head tied to the embedding (Megatron's default) splits into copies of the
embedding's rows and round-trips with Megatron's tied layout. The oracle is the same run without a checkpoint:
weights, fp32 main weights and Adam's step and moments identical at load, and after one more step the same weights.
Shards that overlap or leave rows uncovered are refused at save.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "megatron"))
sys.path.insert(0, HERE)

import megatron_harness as H  # noqa: E402
import megatron_head_shard_scenarios as HS  # noqa: E402

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

SPEC = H.TinyGPT(num_layers=4)  # graph layers: 0 embedding, 1..4 decoder layers, 5 LM head
# owner rank 1 (last stage), shards in order (1, 0): rank 1 rows [0, 40), rank 0 rows [40, 64)
SPLIT_A = {"pp": 2, "plan": HS.split_plan(SPEC, [(0, 3), (3, 6)], [0, 1], (1, 0), (0.625, 0.375), seed=1)}
# V-shape, owner rank 0: rank 0 rows [0, 19), rank 1 rows [19, 64)
SPLIT_B = {"pp": 2, "plan": HS.split_plan(SPEC, [(0, 2), (2, 3), (3, 4), (4, 6)], [0, 1, 1, 0], (0, 1), (0.3, 0.7),
                                          seed=2)}
MEGATRON = {"pp": 2, "layout": "Ett|ttL"}
# the embedding split too (placement.attach_embedding_shard): rank 1 rows [0, 26) in an EmbeddingRows of its
# chunk, stage 0's rank 0 rows [26, 64) as its word_embeddings
SPLIT_E = {"pp": 2, "plan": HS.split_plan(SPEC, [(0, 3), (3, 6)], [0, 1], (1, 0), (0.625, 0.375), seed=11,
                                          embedding=((1, 0), (0.4, 0.6)))}
# tied to the word embedding (Megatron's default): the shards save as copies of the embedding's rows, the embedding
# (on its rank) as the main replica; Megatron's tied layout keeps its head's copy the same way, whole
SPEC_TIED = H.TinyGPT(num_layers=4, tied=True)
CASES = [
    # and the word embedding's rows, as HeadShards under its key, load from the same checkpoint
    {"name": "split plan -> megatron layout", "first": SPLIT_A, "second": MEGATRON,
     "embedding_rows": [(0, 27), (27, 64)]},
    {"name": "megatron layout -> split plan", "first": MEGATRON, "second": SPLIT_A},
    {"name": "split plan -> other split plan", "first": SPLIT_A, "second": SPLIT_B},
    # a split embedding's rows save as their slice of the one word embedding, and load back from Megatron's
    {"name": "split embedding -> megatron layout", "first": SPLIT_E, "second": MEGATRON},
    {"name": "megatron layout -> split embedding", "first": MEGATRON, "second": SPLIT_E},
    # tied: split head -> Megatron's tied layout, and Megatron's -> a V-shape split (the embedding and the owner on
    # one rank: a local tie)
    {"name": "tied split plan -> megatron layout", "first": SPLIT_A, "second": MEGATRON, "spec": SPEC_TIED},
    {"name": "tied megatron layout -> other split plan", "first": MEGATRON, "second": SPLIT_B, "spec": SPEC_TIED},
]
INIT = [{"name": "init A", "init": True, "split": SPLIT_A}, {"name": "init B", "init": True, "split": SPLIT_B}]


# tensor parallelism 2 x pipeline 2 (4 ranks): each TP slice of the vocabulary cut by the shares
SPEC_TP = H.TinyGPT(num_layers=4, args=("--tensor-model-parallel-size", "2"))
TP_CASES = [
    {"name": "tp2 init", "init": True, "split": SPLIT_A},
    {"name": "tp2 split plan -> megatron layout", "first": SPLIT_A, "second": MEGATRON},
    {"name": "tp2 megatron layout -> other split plan", "first": MEGATRON, "second": SPLIT_B},
]


# bf16 (Megatron's Float16Module, fp32 main parameters in the distributed optimizer)
SPEC_BF16 = H.TinyGPT(num_layers=4, bf16=True)
BF16_CASES = [
    {"name": "bf16 split plan -> other split plan", "first": SPLIT_A, "second": SPLIT_B},
    {"name": "bf16 megatron layout -> split plan", "first": MEGATRON, "second": SPLIT_A},
]


# data parallelism 2 x pipeline 2 (4 ranks): the distributed optimizer shards each parameter's state over DP
DP_CASES = [
    {"name": "dp2 split plan -> megatron layout", "first": SPLIT_A, "second": MEGATRON},
    {"name": "dp2 megatron layout -> other split plan", "first": MEGATRON, "second": SPLIT_B},
]


def _run(tmp_path, cases, spec=SPEC, world=2):
    out = tmp_path / "results.pt"
    H.spawn(HS.worker, world, spec, cases, str(tmp_path / "ckpt"), str(out))
    return torch.load(out, weights_only=False)


def _check_init(r, name):
    assert "error" not in r, r.get("error")
    assert set(r["split"]) == set(r["whole"]), name
    assert r["whole"][HS.HEAD].std() > 0  # Megatron's init_method drew it (not a zero-filled copy)
    for key, w in r["whole"].items():
        assert torch.equal(r["split"][key], w), (name, key)


def _check_round_trip(r, name):
    assert "error" not in r, r.get("error")
    assert set(r["loaded_w"]) == set(r["saved_w"]), name
    for key, w in r["saved_w"].items():  # every weight (the head's rows included) arrives where the other keeps it
        assert torch.equal(r["loaded_w"][key], w), (name, key)
    assert r["loaded_adam"]["steps"] == r["saved_adam"]["steps"] == [1.0], name
    for part in ("exp_avg", "exp_avg_sq", "param"):  # Adam's moments and fp32 main weights, element by element
        for key, t in r["saved_adam"][part].items():
            assert torch.equal(r["loaded_adam"][part][key], t), (name, part, key)
    if r.get("embedding") is not None:
        assert torch.equal(r["embedding"], r["saved_w"]["embedding.word_embeddings.weight"]), name
    # one more step on the same gradients: the same weights (the clipping norm sums in another order; a head
    # row counted twice or missed in the norm changes every weight by the clip factor)
    for key, w in r["straight"].items():
        torch.testing.assert_close(r["resumed"][key], w, rtol=1e-6, atol=1e-7, msg=f"{name}: {key}")


# The ranks fork from the harness's forkserver (megatron_harness.spawn: Megatron imported once a session). The
# rest of Megatron's start (gloo) is paid once per world size: the harness re-initialises Megatron's parallel
# state for each case, and a case may bring its own model (spec), so the 2-rank cases (initial values,
# checkpoints untied and tied, bf16) share one spawn and the 4-rank ones (TP=2 x PP=2, DP=2 x PP=2) another.
@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """Results of the 2-rank cases: INIT, CASES and BF16_CASES (the latter on SPEC_BF16), one spawn."""
    bf16 = [{**case, "spec": SPEC_BF16} for case in BF16_CASES]
    return _run(tmp_path_factory.mktemp("head_shards_pp2"), INIT + CASES + bf16)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Results of the 4-rank cases: TP_CASES on SPEC_TP and DP_CASES on SPEC (DP = 4 / PP), one spawn."""
    dp = [{**case, "spec": SPEC} for case in DP_CASES]
    return _run(tmp_path_factory.mktemp("head_shards_4"), TP_CASES + dp, SPEC_TP, world=4)


@pytest.mark.timeout(900)
def test_head_shards_start_from_megatrons_own_output_layer(pp2):
    for case in INIT:
        _check_init(pp2[case["name"]], case["name"])


@pytest.mark.timeout(900)
def test_head_shard_checkpoints_round_trip_with_megatrons_layout_and_other_splits(pp2):
    results = pp2
    for case in CASES:
        r = results[case["name"]]
        _check_round_trip(r, case["name"])
        if case.get("spec", SPEC).tied:  # the tie held: the head (shards or Megatron's copy) is the embedding
            for w in ("saved_w", "loaded_w"):
                assert torch.equal(r[w][HS.HEAD], r[w]["embedding.word_embeddings.weight"]), (case["name"], w)
    # the split embedding's layout held its rows in EmbeddingShards (2 ranks), Megatron's in its own embedding
    assert results["split embedding -> megatron layout"]["embedding_shards"] == [2, 0]
    assert results["megatron layout -> split embedding"]["embedding_shards"] == [0, 2]


@pytest.mark.timeout(900)
def test_head_shards_under_tensor_parallelism(four_ranks):
    for case in TP_CASES:
        check = _check_init if case.get("init") else _check_round_trip
        check(four_ranks[case["name"]], case["name"])


@pytest.mark.timeout(900)
def test_head_shard_checkpoints_under_data_parallelism(four_ranks):
    for case in DP_CASES:
        _check_round_trip(four_ranks[case["name"]], case["name"])


@pytest.mark.timeout(900)
def test_head_shard_checkpoints_in_bf16(pp2):
    for case in BF16_CASES:
        _check_round_trip(pp2[case["name"]], case["name"])


def test_head_rows_cut_each_tensor_parallel_slice_by_the_plans_shares():
    from octopipe_plugin.adapters.megatron.vocab_shards import head_rows
    from octopipe_plugin.formats.splits import SplitLayer

    split = SplitLayer(layer=5, devices=(3, 0, 2), shares=(0.5, 0.2, 0.3))
    rows = {(t, d): head_rows(split, 256, d, t, 2) for t in range(2) for d in range(4)}
    assert rows[(0, 3)] == (0, 64) and rows[(0, 0)] == (64, 90) and rows[(0, 2)] == (90, 128)
    assert rows[(1, 3)] == (128, 192) and rows[(1, 2)] == (218, 256)
    assert rows[(0, 1)] is None and rows[(1, 1)] is None  # device 1 holds no shard
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 3"):
        head_rows(split, 256, 3, 0, 3)


@pytest.mark.timeout(300)
def test_head_shards_that_overlap_or_leave_a_gap_are_refused_at_save(tmp_path):
    """Irregular shards are checked by torch DCP's global plan (Megatron's own check skips uneven grids): rows that
    cover the head once save; rows that overlap or miss some are refused, naming the key."""
    said = {}
    for name, rows in {"once": [(40, 64), (0, 40)], "overlap": [(0, 40), (30, 64)], "gap": [(0, 30), (40, 64)]}.items():
        out = tmp_path / f"{name}.pt"
        try:
            H.spawn(HS.save_rows_worker, 2, SPEC, rows, str(tmp_path / name), str(out))
        except Exception:  # noqa: BLE001 - a refused save ends the other rank's collectives too
            pass
        said[name] = torch.load(f"{out}.rank0", weights_only=False)
    assert said["once"] == "ok"
    assert "overlapping chunks" in said["overlap"] and "output_layer.weight" in said["overlap"], said["overlap"]
    assert "invalid fill" in said["gap"] and "output_layer.weight" in said["gap"], said["gap"]
