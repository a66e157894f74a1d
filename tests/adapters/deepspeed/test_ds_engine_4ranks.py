"""OctoPipeEngine on 4 gloo ranks: an irregular 5-stage map with several stages on one rank, and
pipeline 2 x data-parallel 2 with ZeRO-1, against the single-process reference and DeepSpeed's own
engine (one stage per rank), without clipping so that a gradient scale error shows in the weights."""

import json

import pytest
import torch

import ds_harness as H

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
    H.run_all(scenarios, 4, str(tmp))
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
