"""OctoPipeEngine on 4 gloo ranks: an irregular 5-stage map with several stages on one rank, and
pipeline 2 x data-parallel 2 with ZeRO-1, against the single-process reference and DeepSpeed's own
engine (one stage per rank), without clipping so that a gradient scale error shows in the weights.

The `moe_` scenarios (ds_moe_harness.py): a list with four `deepspeed.moe.layer.MoE` entries at EP 2
(pipeline 2 x expert/data 2), DeepSpeed's own PipelineEngine against OctoPipeEngine on DualPipeV-ordered
V plans with overlapped pairs (F+B, and F+I with split backward), the pairs' MoE layers run phase by
phase with their all-to-alls in flight while the other half computes (adapters/deepspeed/moe_pairs.py):
losses per step and every gradient handed to the optimizer agree at 1e-5 (a 1% scale error fails). With every
MoE entry on one pipeline rank (`moe_one_rank`) the expert groups are still made on every rank
(OctoPipePipelineModule.set_deepspeed_parallelism), so a group made after the step spans the world. The
paired plan's checkpoint resumes under its own plan (the uninterrupted run's steps 3-5) and is refused in one
line under another placement (DeepSpeed writes MoE pipeline checkpoints per pipeline rank)."""

import json
import re

import pytest
import torch

import ds_harness as H
import ds_moe_harness as MH

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

LR, MOMENTUM = 0.5, 0.9
M = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds4")
    irregular = tmp / "irregular.json"  # rank 2 holds stages 1 and 4; non-uniform
    irregular.write_text(json.dumps(H.plan_doc([0, 2, 1, 3, 2], [(0, 2), (2, 3), (3, 6), (6, 7), (7, 9)], 4, M, 11)))
    v2 = tmp / "v2.json"
    v2.write_text(json.dumps(H.plan_doc([0, 1, 1, 0], [(0, 2), (2, 4), (4, 7), (7, 9)], 2, M, 13)))
    cfg = lambda path, dp, **extra: H.ds_config(m=M, dp=dp, lr=LR, momentum=MOMENTUM, clip=0.0,  # noqa: E731
                                                plan_path=str(path) if path else None, extra=extra)
    zero1 = dict(zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    scenarios = [
        dict(name="irregular_pp4", config=cfg(irregular, 1)),
        dict(name="stock_pp4", config=cfg(None, 1), parts=[0, 2, 3, 6, 9]),
        dict(name="pp2_dp2_zero1", config=cfg(v2, 2, **zero1)),
        dict(name="stock_pp2_dp2_zero1", config=cfg(None, 2, **zero1), parts=[0, 4, 9]),
        # fp32 without ZeRO: each stage's DP all-reduce starts at its last backward (and, for the
        # comparison, the same run reducing after the step)
        dict(name="pp2_dp2_overlap", config=cfg(v2, 2)),
        dict(name="pp2_dp2_after", config=cfg(v2, 2, octopipe={"plan": str(v2), "overlap_dp_reduction": False})),
        dict(name="stock_pp2_dp2", config=cfg(None, 2), parts=[0, 4, 9]),
    ]
    ck = dict(dir=str(tmp / "moe_ck"), tag="t3")
    for split in (False, True):  # MoE layers at EP 2: V plans with overlapped pairs (F+B; F+I with I/W)
        path = tmp / f"moe_pairs_{split}.json"
        path.write_text(json.dumps(MH.plan_doc(split=split, m=M)))
        scenarios.append(dict(name=f"moe_pairs{'_split' if split else ''}", moe=True, config=cfg(path, 2),
                              eval=not split, save=None if split else ck))
    # resumed under the plan that saved it: steps 3-5 of the uninterrupted run
    scenarios.append(dict(name="moe_resume", moe=True, config=cfg(tmp / "moe_pairs_False.json", 2), load=ck,
                          first_step=H.STEPS))
    one = tmp / "moe_one_rank.json"  # every MoE entry on pipeline rank 0: rank 1 builds none
    one.write_text(json.dumps(MH.plan_doc(split=False, m=M, one_rank=True)))
    scenarios.append(dict(name="moe_one_rank", moe=True, world_group=True, config=cfg(one, 2), refused_load=ck))
    scenarios.append(dict(name="moe_stock", moe=True, config=cfg(None, 2), parts=MH.STOCK_PARTS, eval=True,
                          steps=2 * H.STEPS))
    H.run_all(scenarios, 4, str(tmp), run=MH.run_any)
    return tmp


def _check(reports, dp, stock):
    ref_losses, ref_weights = H.reference_run(dp=dp, m=M, lr=LR, momentum=MOMENTUM, clip=0.0)
    for rep in reports:
        assert rep["engine"] == "OctoPipeEngine"
        assert rep["losses"] == pytest.approx(ref_losses, rel=1e-5)
    weights = H.merged_weights(reports)  # also: tied and data-parallel copies identical on every rank
    for idx, sd in ref_weights.items():
        for k, v in sd.items():
            torch.testing.assert_close(weights[idx][k], v, atol=1e-5, rtol=1e-5)
    theirs = H.merged_weights(stock)
    assert {r["engine"] for r in stock} == {"PipelineEngine"}
    for idx, sd in weights.items():
        for k, v in sd.items():
            torch.testing.assert_close(v, theirs[idx][k], atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(1200)
def test_irregular_map_several_stages_per_rank(runs):
    reports = H.load(runs, "irregular_pp4", 4)
    _check(reports, 1, H.load(runs, "stock_pp4", 4))
    assert [r["holds"] for r in reports] == [[True, False], [False, False], [False, True], [False, False]]
    assert [r["calls"][0] for r in reports] == [M, 0, M, 0]


@pytest.mark.timeout(60)
def test_pipeline2_x_data2_zero1(runs):
    reports = H.load(runs, "pp2_dp2_zero1", 4)
    _check(reports, 2, H.load(runs, "stock_pp2_dp2_zero1", 4))
    assert sorted((r["stage"], r["dp"]) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.timeout(60)
def test_dp_reduction_started_per_stage_gives_the_stock_gradients(runs):
    overlap, after = H.load(runs, "pp2_dp2_overlap", 4), H.load(runs, "pp2_dp2_after", 4)
    assert all(r["overlap"] for r in overlap) and not any(r["overlap"] for r in after)
    _check(overlap, 2, H.load(runs, "stock_pp2_dp2", 4))
    wa, wb = H.merged_weights(overlap), H.merged_weights(after)
    for idx in wa:  # the same sums of two replicas, however bucketed: bit-identical
        for k in wa[idx]:
            assert torch.equal(wa[idx][k], wb[idx][k]), (idx, k)


def _close(theirs: dict, ours: dict) -> bool:
    return theirs.keys() == ours.keys() and all(torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-7)
                                                for k in theirs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["moe_pairs", "moe_pairs_split"])
def test_moe_pairs_equal_deepspeeds_engine(runs, name):
    stock, ours = H.load(runs, "moe_stock", 4), H.load(runs, name, 4)
    assert {r["engine"] for r in stock} == {"PipelineEngine"} and {r["engine"] for r in ours} == {"OctoPipeEngine"}
    for rep in ours:
        assert rep["losses"] == pytest.approx(stock[0]["losses"][:H.STEPS], rel=1e-5)
        if name == "moe_pairs":  # eval_batch before each step: the plan's forwards alone, MoE.forward whole
            assert len(rep["eval"]) == H.STEPS and rep["eval"] == pytest.approx(stock[0]["eval"][:H.STEPS], rel=1e-5)
    plan = json.loads((runs / f"moe_pairs_{name.endswith('split')}.json").read_text())
    per_device = [sum("+" in a for a in row) for row in plan["schedule"]]
    # each pipeline rank ran its pairs through the phased runtime, and other work computed while exchanges flew
    assert [r["pairs_run"] for r in ours] == [H.STEPS * per_device[r // 2] for r in range(4)]
    assert all(r["hidden"] > 0 for r in ours)
    for step in range(H.STEPS):
        theirs, mine = MH.all_grads(stock, step), MH.all_grads(ours, step)
        assert sum("@ep" in k for k in theirs) == 4 * 2 * 4 * 2  # 4 layers x 2 local experts x 4 tensors x 2 EP ranks
        assert _close(theirs, mine), [k for k in theirs if not torch.allclose(mine[k], theirs[k], rtol=1e-5)]
        assert not _close(theirs, {k: v * 1.01 for k, v in mine.items()})  # the tolerance sees a 1% scale error


@pytest.mark.timeout(60)
def test_moe_on_one_pipeline_rank_numbers_groups_alike_on_every_rank(runs):
    # without the expert groups made on rank 1 too, its later groups are numbered differently: the world group made
    # after the step waits for keys no other rank writes (DistStoreError after its timeout, measured)
    stock, ours = H.load(runs, "moe_stock", 4), H.load(runs, "moe_one_rank", 4)
    assert [r["world_group"] for r in ours] == [4.0] * 4
    assert [r["pairs_run"] for r in ours] == [H.STEPS * 3, H.STEPS * 3, 0, 0]  # rank 0's F+B pairs
    for rep in ours:
        assert rep["losses"] == pytest.approx(stock[0]["losses"][:H.STEPS], rel=1e-5)
    for step in range(H.STEPS):  # the same model on another partition: the same gradients
        assert _close(MH.all_grads(stock, step), MH.all_grads(ours, step))
    # the V plan's MoE checkpoint under this placement: refused, the same line on every rank, nothing loaded
    errors = {r["load_error"] for r in ours}
    assert len(errors) == 1 and None not in errors
    assert re.search(r"moe_ck/t3: a checkpoint of a model with DeepSpeed MoE layers loads only under the stage "
                     r"placement that wrote it .* written with stages \[\(0, 3, 0\), .*this plan has \[\(0, 9, 0\), "
                     r"\(9, 11, 1\)\]; resume under the plan in its octopipe_plan\.json", errors.pop())


@pytest.mark.timeout(60)
def test_moe_paired_plan_resumes_its_own_checkpoint(runs):
    # DeepSpeed writes a MoE pipeline checkpoint per pipeline rank (checkpoint.moe_layout_problem): under the plan that
    # wrote it the run goes on as the uninterrupted one (DeepSpeed's engine's steps 3-5)
    stock, resumed = H.load(runs, "moe_stock", 4), H.load(runs, "moe_resume", 4)
    for rep in resumed:
        assert rep["losses"] == pytest.approx(stock[0]["losses"][H.STEPS:], rel=1e-5)
    for step in range(H.STEPS):
        assert _close(MH.all_grads(stock, H.STEPS + step), MH.all_grads(resumed, step))
