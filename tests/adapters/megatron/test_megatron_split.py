"""Plans that split the LM head, inside Megatron (megatron-core 0.19.2, CPU/gloo, tiny GPT, local spec, untied/tied).

Each shard rank holds a `HeadShard` (rows of Megatron's output_layer.weight, initialised from the
owner's Megatron-built head) attached to its chunk before DDP wrapping; the owner's chunk returns its
final-norm hidden states with the labels and Megatron's per-token loss coefficients, the shards run
the vocabulary-parallel cross-entropy across the shard group, and the owner's J reports through the
forward step's own loss_func. A split embedding (split_embedding.py): the shard ranks hold
EmbeddingShards (rows of the word embedding), stage 0's forward steps are read ahead and their
token ids sent to them, stage 0's lookup returns the shards' summed partials. Oracle: the same model at PP=1 in one process (Megatron's own
no-pipelining schedule on the unsplit model), same seeds. Compared: the per-step losses (3 optimizer
steps), every parameter's main_grad after the step-0 reduction before the optimizer (the shards' rows
against the matching rows of the unsplit output_layer / word embedding gradient; relative 1e-3, which a 1% scale
error fails), and the weights after three steps.
Tied to the word embedding (Megatron's default), the shards are rows of the embedding, initialised from
the embedding's rank and tied to it (executor/tied_rows.py): against the unsplit tied model, the
embedding's main_grad is the whole tied gradient and each shard's its rows.
"""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import megatron_harness as H
import megatron_scenarios as S
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.executor.dryrun import zero_cost_cluster
from octopipe_plugin.executor.validate import check_runnable
from octopipe_plugin.formats import plan_to_dict
from octopipe_plugin.formats.splits import SplitLayer
from octopipe_plugin.testing.plans import make_plan, placement, sample_schedule
from octopipe_plugin.tuner.split_sched import ShardPolicy, insert_shards

pytestmark = [pytest.mark.framework, pytest.mark.distributed]
# the shards' math is the executor's VocabShards (SHARD_API.md, being built on branch w-shardcore)
needs_vocab_shards = pytest.mark.skipif(
    not hasattr(__import__("octopipe_plugin.executor.vocab_shard", fromlist=["x"]), "VocabShards"),
    reason="executor.vocab_shard.VocabShards is not on this branch yet (w-shardcore)")

M = 4
DENSE = H.TinyGPT(num_layers=8)
HEAD = 9  # graph layers: 0 = embedding, 1..8 = decoder layers, 9 = the LM head (final norm, output layer, loss)


def split_plan(spec, bounds, devices, num_devices, seed, shard_devices=None, shares=None, m=M, embedding=None):
    """A random valid order of the stages (I/W split at random) into which the LM head's shard actions, split over
    `shard_devices`, and the embedding's (`embedding`: (devices, shares)) can be placed (the first such seed from
    `seed` on: a random order may leave them no room)."""
    cluster = replace(zero_cost_cluster(num_devices), memory_bytes=1 << 40)
    splits = tuple(([SplitLayer(layer=0, devices=tuple(embedding[0]), shares=tuple(embedding[1]))] if embedding
                    else []) + ([SplitLayer(layer=HEAD, devices=tuple(shard_devices), shares=tuple(shares))]
                                if shard_devices else []))
    for s in range(seed, seed + 50):
        plan = make_plan(stage_devices=devices, bounds=bounds, num_devices=num_devices, num_microbatches=m,
                         schedule=sample_schedule(devices, num_devices, m, random.Random(s)), model="tiny-gpt")
        out = insert_shards(spec.graph(), cluster, replace(plan, splits=splits), ShardPolicy())
        if out is not None:
            check_runnable(out)
            return out
    raise AssertionError(f"no order from seeds {seed}..{seed + 49} takes the shard actions of {splits}")


# owner = the last stage's device; it must hold a shard
PP2 = split_plan(DENSE, [(0, 4), (4, 10)], [0, 1], 2, seed=11, shard_devices=[1, 0], shares=[0.3, 0.7])
LOOPED = split_plan(DENSE, [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)], placement("looped", 8, 4),
                    4, seed=12, shard_devices=[3, 0, 2], shares=[0.25, 0.45, 0.3])
VSHAPE = split_plan(DENSE, [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)], placement("v", 8, 4), 4,
                    seed=13, shard_devices=[0, 1, 2, 3], shares=[0.1, 0.3, 0.2, 0.4])
# a split embedding (split_embedding.py): stage 0's rank holding rows (PP=2), and a V-shape whose stage 0's rank
# holds none (its lookup only fed) beside a split head over every rank
EMB_PP2 = split_plan(DENSE, [(0, 4), (4, 10)], [0, 1], 2, seed=15, embedding=([1, 0], [0.6, 0.4]))
EMB_VSHAPE = split_plan(DENSE, [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)], placement("v", 8, 4),
                        4, seed=16, shard_devices=[0, 1, 2, 3], shares=[0.1, 0.3, 0.2, 0.4],
                        embedding=([1, 2, 3], [0.3, 0.3, 0.4]))
DP_PLAN = split_plan(DENSE, [(0, 3), (3, 4), (4, 8), (8, 10)], [0, 1, 0, 1], 2, seed=14, shard_devices=[1, 0],
                     shares=[0.5, 0.5])

PER_TOKEN = H.TinyGPT(num_layers=8, args=("--calculate-per-token-loss",))  # finalize divides by the token count
TWO_TUPLE = H.TinyGPT(num_layers=8, three_tuple_loss=False)  # the legacy (loss, dict): / num_microbatches only
BF16 = H.TinyGPT(num_layers=8, bf16=True)  # Float16Module: the head's input stays bf16, the shards' loss is fp32
TIED = H.TinyGPT(num_layers=8, tied=True)  # Megatron's default: the head is the word embedding

REFERENCE = [dict(name="dense", spec=DENSE, pp=1, microbatches=M, eval=True),
             dict(name="dense_2m", spec=DENSE, pp=1, microbatches=2 * M),
             dict(name="per_token", spec=PER_TOKEN, pp=1, microbatches=M),
             dict(name="two_tuple", spec=TWO_TUPLE, pp=1, microbatches=M),
             dict(name="bf16", spec=BF16, pp=1, microbatches=M),
             dict(name="tied", spec=TIED, pp=1, microbatches=M),
             dict(name="tied_2m", spec=TIED, pp=1, microbatches=2 * M)]
SPLITS = [
    dict(name="split_pp2", spec=DENSE, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="dense", world=2),
    # Megatron's loss rules through the owner's coefficients and its J's report
    dict(name="split_per_token_loss", spec=PER_TOKEN, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="per_token",
         world=2),
    dict(name="split_two_tuple_loss", spec=TWO_TUPLE, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="two_tuple",
         world=2),
    dict(name="split_bf16", spec=BF16, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="bf16", world=2),
    dict(name="split_looped", spec=DENSE, pp=4, microbatches=M, plan=plan_to_dict(LOOPED), ref="dense", world=4),
    # V-shape: the owner (and the loss) on rank 0; every rank a shard; tensors placed on the model's device
    dict(name="split_vshape", spec=DENSE, pp=4, microbatches=M, plan=plan_to_dict(VSHAPE), ref="dense", world=4,
         device_check=True),
    # the split embedding: token ids read ahead on stage 0's rank, sent to the shards; evaluation steps too
    dict(name="split_embedding_pp2", spec=DENSE, pp=2, microbatches=M, plan=plan_to_dict(EMB_PP2), ref="dense",
         world=2, eval=True),
    dict(name="split_embedding_vshape", spec=DENSE, pp=4, microbatches=M, plan=plan_to_dict(EMB_VSHAPE), ref="dense",
         world=4, device_check=True),
    # PP=2 x DP=2, each chunk's reduce-scatter overlapped (the shard's chunk reduces after the step)
    dict(name="split_pp2_dp2_overlap", spec=DENSE, pp=2, microbatches=M, plan=plan_to_dict(DP_PLAN),
         overlap_grad_reduce=True, ref="dense_2m", world=4),
    # tied to the embedding: shards initialised from the embedding's rank, the tie's gradients summed (tied_rows)
    # before the reduction. PP=2: the embedding's rank holds a shard, the owner another
    dict(name="split_tied_pp2", spec=TIED, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="tied", world=2),
    # V-shape: the embedding and the owner on rank 0 (a local tie), every rank a shard
    dict(name="split_tied_vshape", spec=TIED, pp=4, microbatches=M, plan=plan_to_dict(VSHAPE), ref="tied", world=4),
    # DP=2, distributed optimizer, reduce-scatters overlapped: the tied chunks reduce after the tie's sum
    # (weights after three steps, every gradient before the optimizer within 5e-7 relative: two elements, one of
    # the embedding whose step-0 gradient is 300x below the mean and equal to 5e-5 relative, come out of Adam 3e-4
    # and 6e-4 off, 3-6% of an lr step: the Adam effect described in the test below)
    dict(name="split_tied_dp2_overlap", spec=TIED, pp=2, microbatches=M, plan=plan_to_dict(DP_PLAN),
         overlap_grad_reduce=True, ref="tied_2m", world=4),
]
EMBEDDING = "embedding.word_embeddings.weight"


def head_key(case: dict) -> str:
    """The unsplit model's weight the shards are rows of: the output layer's, or the tied embedding's."""
    return EMBEDDING if case["spec"].tied else "output_layer.weight"


# Tensor parallelism: TP2 x PP2 (4 gloo ranks), plain and with --sequence-parallel, against Megatron's own schedule on
# the unsplit model at the same TP2 x PP2, same seeds (TP slices seeded apart, compared per TP rank: "name@tp<r>")
TP2 = H.TinyGPT(num_layers=8, args=("--tensor-model-parallel-size", "2"))
TP2_SP = H.TinyGPT(num_layers=8, args=("--tensor-model-parallel-size", "2", "--sequence-parallel"))
# tied at TP2 x PP2 (the oracle: Megatron's own tied model, its head a copy of the embedding on the last rank)
TIED_TP2 = H.TinyGPT(num_layers=8, tied=True, args=("--tensor-model-parallel-size", "2"))
TP_REFERENCE = [dict(name="megatron_tp2_pp2", spec=TP2, pp=2, microbatches=M, world=4),
                dict(name="megatron_tied_tp2_pp2", spec=TIED_TP2, pp=2, microbatches=M, world=4),
                dict(name="megatron_tp2_sp_pp2", spec=TP2_SP, pp=2, microbatches=M, world=4)]
TP_SPLITS = [
    dict(name="split_tp2_pp2", spec=TP2, pp=2, microbatches=M, plan=plan_to_dict(PP2), ref="megatron_tp2_pp2",
         world=4),
    # the owner hands over its block of the sequence; tensors placed on the model's device
    dict(name="split_tp2_sp_pp2", spec=TP2_SP, pp=2, microbatches=M, plan=plan_to_dict(PP2),
         ref="megatron_tp2_sp_pp2", world=4, device_check=True),
    # tied: each TP rank's shards are rows of its slice of the embedding, tied within its pipeline group
    dict(name="split_tied_tp2_pp2", spec=TIED_TP2, pp=2, microbatches=M, plan=plan_to_dict(PP2),
         ref="megatron_tied_tp2_pp2", world=4),
]


SHARDED = ("output_layer.weight", "embedding.word_embeddings.weight")  # the weights a split plan holds in rows


def joined(values: dict) -> dict:
    """The shards' rows of output_layer.weight and the word embedding ("NAME[lo:hi]") put together as the one
    weight."""
    out = {k: v for k, v in values.items() if not k.startswith(tuple(f"{n}[" for n in SHARDED))}
    for name in SHARDED:
        rows = sorted((int(k[len(name) + 1:-1].split(":")[0]), v) for k, v in values.items()
                      if k.startswith(f"{name}["))
        if rows:
            out[name] = torch.cat([v for _, v in rows])
    return out


@pytest.fixture(scope="module")
def reference(single_process_references):
    return single_process_references(REFERENCE)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    out = {}
    every = SPLITS + TP_REFERENCE + TP_SPLITS  # the TP cases share the 4-rank spawn (one start-up)
    for world in sorted({c["world"] for c in every}):
        cases = [c for c in every if c["world"] == world]
        out.update(S.run_spawned(world, cases, tmp_path_factory.mktemp(f"split{world}") / "split.pt"))
    return out


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.timeout(600)
def test_a_spawn_running_case_after_case_keeps_its_thread_count(splits):
    """Each case's Megatron parallel state makes ~20 gloo groups (3 threads each); a finished case's groups, models
    and optimizer are freed (process_groups.destroy_groups_since, megatron_harness.release_optimizer, patching's
    weakly held patched objects), so the 4-rank spawn's rank 0 does not gain ~60 threads per case (it reached ~730).
    What stays (measured: 14 threads after the first case, 47 after the twelfth): about one gloo group per case, and
    while a V-shape plan's per-direction groups are cached by the executor (default_cache) ~18 more."""
    four = [c["name"] for c in SPLITS + TP_REFERENCE + TP_SPLITS if c["world"] == 4]
    threads = [splits[name]["threads"] for name in four]
    assert len(four) >= 6 and max(threads) - threads[0] < 100, dict(zip(four, threads))


@needs_vocab_shards
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c["name"] for c in SPLITS])
def test_split_head_trains_as_the_unsplit_model(case, reference, splits):
    """Three steps under a split-head plan give the unsplit PP=1 run's losses and weights (the shards' rows
    put together are its output_layer.weight)."""
    spec = next(c for c in SPLITS if c["name"] == case)
    got, want = splits[case], reference[spec["ref"]]
    # bf16 (8 bits of mantissa): the tolerances of test_megatron_schedule's bf16 case
    half = spec["spec"].bf16
    lt = dict(rtol=1e-2, atol=1e-2) if half else dict(rtol=1e-5, atol=1e-6)
    # fp32: the shards sum the softmax in another order than Megatron's cross-entropy (~1e-7 relative in the
    # gradients, checked before the optimizer below, where a 1% scale error fails); Adam's first steps divide each
    # element by its own magnitude, so an element whose gradient is near zero carries that rounding up to a few % of
    # an lr=1e-2 step (measured: 2.3e-4 on one element of 2048 in decoder.layers.1.mlp.linear_fc2 on one machine,
    # under 2e-4 on another): a tenth of a step; Adam is blind to gradient scale, which the gradient test checks
    wt = spec.get("weight_tol", dict(rtol=1e-4, atol=1e-3))
    torch.testing.assert_close(got["losses"], want["losses"], **lt, msg=f"{case}: losses")
    if got.get("evals") is not None:
        torch.testing.assert_close(got["evals"], want["evals"], **lt, msg=f"{case}: eval losses")
    if half:
        # bf16: the head's GEMMs round differently from Megatron's output layer (its gradients differ by 0.7%
        # (median) to 1.7% relative, about bf16's rounding, checked below at a bf16 tolerance), and Adam turns the
        # sign of a near-zero gradient into a whole lr step: weights after the optimizer are not comparable
        return
    weights = joined(got["weights"])
    if spec["spec"].tied:  # each shard against its rows of the tied embedding, the embedding itself as it is
        rows = weights.pop("output_layer.weight")
        torch.testing.assert_close(rows, want["weights"][EMBEDDING], **wt, msg=f"{case}: the shards' rows")
        torch.testing.assert_close(rows, weights[EMBEDDING], rtol=1e-6, atol=1e-7, msg=f"{case}: the tie held")
    assert set(weights) == set(want["weights"]), sorted(set(weights) ^ set(want["weights"]))
    for name, w in want["weights"].items():
        torch.testing.assert_close(weights[name], w, **wt, msg=lambda m, name=name: f"{case}: weight {name}: {m}")


@needs_vocab_shards
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c["name"] for c in SPLITS if not c["spec"].bf16])
def test_split_head_gradients_match_before_the_optimizer(case, reference, splits):
    """Step 0's main_grad of every parameter after the reduction (each shard's rows against the same rows of the
    unsplit output_layer gradient): relative 1e-3 per parameter; the same gradients x1.01 fail (fp32: bf16's
    rounding is about as large as the scale errors this check is for, as in test_megatron_schedule)."""
    spec = next(c for c in SPLITS if c["name"] == case)
    want = reference[spec["ref"]]["grads"]
    got = splits[case]["grads"]
    shard_keys = [k for k in got if k.startswith(tuple(f"{n}[" for n in SHARDED))]
    assert len(shard_keys) == sum(len(sp["devices"]) for sp in spec["plan"]["splits"]), shard_keys
    # tied: the head's shards are rows of the embedding, whose rank holds the whole tied gradient
    per_rows = {k: want[head_key(spec) if k.startswith("output_layer.weight[") else k.split("[")[0]]
                [slice(*map(int, k.split("[")[1][:-1].split(":")))] for k in shard_keys}
    split_names = {k.split("[")[0] for k in shard_keys}
    want_split = {**{k: v for k, v in want.items() if k not in split_names}, **per_rows}
    bad = H.grad_mismatches(got, want_split)
    assert not bad, f"{case}: " + "; ".join(bad[:5])
    scaled = {k: v * 1.01 for k, v in got.items()}
    assert len(H.grad_mismatches(scaled, want_split)) == len(want_split)


@needs_vocab_shards
@pytest.mark.timeout(600)
def test_split_head_bf16_gradients_match_at_bf16_rounding(reference, splits):
    """bf16 (Float16Module; the head's input stays bf16 on the owner, the shards' statistics and loss fp32): every
    main_grad before the optimizer within 5% relative of the unsplit bf16 run's (bf16 rounding is 0.7-1.7% here;
    a missing or doubled loss coefficient, x2 or x0.5, fails)."""
    got, want = splits["split_bf16"]["grads"], reference["bf16"]["grads"]
    shards = {k: v for k, v in got.items() if k.startswith("output_layer.weight[")}
    got = joined(got)
    assert set(got) == set(want) and len(shards) == 2
    assert not H.grad_mismatches(got, want, rel=5e-2)
    assert len(H.grad_mismatches({k: 2 * v for k, v in got.items()}, want, rel=5e-2)) == len(want)


@needs_vocab_shards
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c["name"] for c in SPLITS if c.get("device_check")])
def test_split_head_places_every_tensor_on_the_model_device(case, splits):
    """The owner's hand-over, the shards' statistics and partials, the loss report, a split embedding's token ids
    and partials: nothing made without the model's device, no tensor through pickling."""
    problems = [p for rank in splits[case]["device_problems"] for p in rank]
    assert not problems, "\n".join(sorted(set(problems)))


def tp_rows(key: str) -> tuple[str, int, int, int] | None:
    """("output_layer.weight", lo, hi, TP rank) of a shard's key "output_layer.weight[lo:hi]@tp<r>" (global rows)."""
    if not key.startswith("output_layer.weight["):
        return None
    rows, tp = key[len("output_layer.weight["):].split("]@tp")
    lo, hi = map(int, rows.split(":"))
    return "output_layer.weight", lo, hi, int(tp)


def tp_want(got: dict, want: dict, spec) -> dict:
    """The unsplit TP run's values in the split run's keys: each shard's rows cut from its TP rank's slice of the
    head (TP rank r holds global rows [r V/tp, (r+1) V/tp))."""
    per_tp = spec.vocab // H.tp_size(spec)
    out = {k: v for k, v in want.items() if not k.startswith("output_layer.weight@")}
    for k in got:
        parsed = tp_rows(k)
        if parsed is not None:
            name, lo, hi, r = parsed
            out[k] = want[f"{name}@tp{r}"][lo - r * per_tp:hi - r * per_tp]
    return out


@needs_vocab_shards
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c["name"] for c in TP_SPLITS])
def test_split_head_under_tensor_parallelism_matches_megatrons_schedule(case, splits):
    """TP2 x PP2 (plain, and with --sequence-parallel): each TP rank's shards hold rows of its TP slice, reduce their
    statistics over the TP group, and the owner hands over its hidden states (its block of the sequence under SP).
    Against Megatron's own 1F1B on the unsplit model at TP2 x PP2, same seeds: the losses of 3 steps, every
    main_grad of every TP rank after step 0's reduction before the optimizer (each shard's rows against the same
    rows of its TP rank's head slice; relative 1e-3, the same gradients x1.01 fail) and the weights after 3 steps."""
    spec = next(c for c in TP_SPLITS if c["name"] == case)
    got, want = splits[case], splits[spec["ref"]]
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6, msg=f"{case}: losses")
    shard_keys = sorted(k for k in got["grads"] if tp_rows(k))
    # every shard device on every TP rank: 2 devices x 2 TP ranks, rows inside their TP rank's slice
    assert len(shard_keys) == 2 * len(spec["plan"]["splits"][0]["devices"]), shard_keys
    want_grads = tp_want(got["grads"], want["grads"], spec["spec"])
    assert set(want_grads) == set(got["grads"]), sorted(set(want_grads) ^ set(got["grads"]))
    assert any(k.endswith("@tp1") for k in want_grads) and any(k.endswith("@tp0") for k in want_grads)
    bad = H.grad_mismatches(got["grads"], want_grads)
    assert not bad, f"{case}: " + "; ".join(bad[:5])
    scaled = {k: v * 1.01 for k, v in got["grads"].items()}
    assert len(H.grad_mismatches(scaled, want_grads)) == len(want_grads)
    want_w = tp_want(got["weights"], want["weights"], spec["spec"])
    assert set(want_w) == set(got["weights"]), sorted(set(want_w) ^ set(got["weights"]))
    for name, w in want_w.items():  # Adam's tolerance of the fp32 cases above
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=2e-4, msg=f"{case}: weight {name}")
    if spec.get("device_check"):
        problems = [p for rank in got["device_problems"] for p in rank]
        assert not problems, "\n".join(sorted(set(problems)))


def _config(**over):
    return SimpleNamespace(**{"mtp_num_layers": None, "tensor_model_parallel_size": 1, **over})


def test_split_plans_a_megatron_run_cannot_run_are_refused_by_plan_field():
    """Owner without a shard, MTP, a split embedding with MTP or tensor parallelism, no shards: one line naming
    `splits` (a split embedding itself runs: split_embedding.py); tensor parallelism passes for the head."""
    from octopipe_plugin.adapters.megatron.stages import check_split_plan

    owner_out = replace(PP2, splits=(SplitLayer(layer=HEAD, devices=(0,), shares=(1.0,)),))
    cases = [(owner_out, _config(), "must include device 1, the LM head's owner"),
             (PP2, _config(mtp_num_layers=1), "--mtp-num-layers 1"),
             (replace(PP2, splits=(SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5)),)),
              _config(mtp_num_layers=1), "with a split embedding is not supported (MTP"),
             (replace(PP2, splits=(SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5)),)),
              _config(tensor_model_parallel_size=2), "tensor parallelism (size 2) with a split embedding")]
    for plan, config, words in cases:
        with pytest.raises(OctoPipeError) as err:
            check_split_plan(plan, 1, object(), config, False)
        msg = str(err.value)
        assert "splits[0]" in msg and words in msg and "\n" not in msg, msg
    with pytest.raises(OctoPipeError, match="runs shard actions and needs its shards"):
        check_split_plan(PP2, 1, None, _config(), False)
    assert check_split_plan(PP2, 1, object(), _config(tensor_model_parallel_size=2, sequence_parallel=True), False)
    assert check_split_plan(EMB_PP2, 0, object(), _config(), False) is False  # runs; no head split


def test_start_up_refuses_split_heads_a_megatron_run_cannot_run():
    """At start-up, on every rank, before any model is built: a HybridModel and MTP are refused in one line naming
    `splits`, and a split head tied to a split embedding; the untied GPT passes, also at TP 2 with sequence
    parallelism, and the tied one (Megatron's default: the shards are tied to the embedding)."""
    from octopipe_plugin.adapters.megatron.startup import _refuse_splits

    untied = dict(untie_embeddings_and_output_weights=True, mtp_num_layers=None, tensor_model_parallel_size=1,
                  hybrid_layer_pattern=None, hybrid_override_pattern=None)
    tied = {**untied, "untie_embeddings_and_output_weights": False}
    _refuse_splits(SimpleNamespace(**untied), PP2)
    _refuse_splits(SimpleNamespace(**{**untied, "tensor_model_parallel_size": 2, "sequence_parallel": True}), PP2)
    _refuse_splits(SimpleNamespace(**tied), PP2)
    _refuse_splits(SimpleNamespace(**tied), replace(PP2, splits=()))  # no split: nothing to refuse
    both = replace(PP2, splits=(*PP2.splits, SplitLayer(layer=0, devices=(0, 1), shares=(0.5, 0.5))))
    with pytest.raises(OctoPipeError, match=r"^--pipeline-schedule octopipe: plan splits\[\d\]"):
        _refuse_splits(SimpleNamespace(**tied), both)  # a split embedding (and, tied, the head tied to it)
    cases = [({"hybrid_layer_pattern": "M*M*M*M*"}, "HybridModel"),
             ({"mtp_num_layers": 1}, "--mtp-num-layers 1")]
    for over, words in cases:
        with pytest.raises(OctoPipeError) as err:
            _refuse_splits(SimpleNamespace(**{**untied, **over}), PP2)
        msg = str(err.value)
        assert msg.startswith("--pipeline-schedule octopipe: plan splits") and words in msg and "\n" not in msg, msg
    _refuse_splits(SimpleNamespace(**untied), EMB_PP2)  # an untied split embedding runs
    with pytest.raises(OctoPipeError, match=r"plan splits\[0\] \(layer 0\): a split embedding tied to the LM head"):
        _refuse_splits(SimpleNamespace(**{**untied, "untie_embeddings_and_output_weights": False}), EMB_PP2)


class _Model(torch.nn.Module):
    """A chunk with GPTModel's call signature (the recorder binds the call to it to find input_ids)."""

    embedding = None

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
        return input_ids


def test_stage0_forward_steps_are_read_ahead_and_replayed():
    """split_embedding.read_model_calls: the forward step runs once per micro-batch against a recorder (token ids
    kept sequence-major, the loss_func kept); replay makes the kept call; a forward step that calls the model twice
    or changes its output is refused by name."""
    from octopipe_plugin.adapters.megatron.split_embedding import read_model_calls, replay

    data = [torch.arange(6).view(2, 3) + 10 * k for k in range(2)]
    model = _Model()

    def step(it, m):
        tokens = next(it)
        return m(tokens, None, labels=None), ("loss", int(tokens[0, 0]))

    calls = read_model_calls(step, lambda mb: iter([data[mb]]), model, 2, torch.device("cpu"))
    assert [c.loss_func for c in calls] == [("loss", 0), ("loss", 10)]
    assert torch.equal(calls[1].tokens, data[1].t()) and calls[1].tokens.dtype == torch.int64
    out, loss_func = replay(calls[1])(None, model)
    assert torch.equal(out, data[1]) and loss_func == ("loss", 10)

    def twice(it, m):
        tokens = next(it)
        m(tokens, None)
        return m(tokens, None), None

    def changed(it, m):
        return [m(next(it), None)], None

    for bad, words in ((twice, "called the model 2 times"), (changed, "returned something other than")):
        with pytest.raises(OctoPipeError, match=words):
            read_model_calls(bad, lambda mb: iter([data[mb]]), model, 1, torch.device("cpu"))
