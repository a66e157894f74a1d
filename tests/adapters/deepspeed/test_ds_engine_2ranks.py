"""OctoPipeEngine on 2 gloo ranks against a single-process reference and DeepSpeed's own engine.

One spawn runs every scenario (DeepSpeed's init is paid once); each test checks one of them.
The first deepspeed.init_distributed on a machine compiles a shared-memory op (~90 s, cached).
"""

import json

import pytest
import torch

import ds_harness as H
from octopipe_plugin.formats import read_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

LR, MOMENTUM, CLIP = 0.5, 0.9, 0.05
M = 4
# A V-shape: stages 0 and 3 on rank 0, 1 and 2 on rank 1; non-uniform; random order with split backward.
V_DEVICES, V_BOUNDS = [0, 1, 1, 0], [(0, 1), (1, 5), (5, 6), (6, 9)]
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3,
                                         "warmup_type": "linear"}}
# One stage per rank (DeepSpeed can express the partition, not the order).
FLAT_BOUNDS = [(0, 3), (3, 9)]


def _scenarios(tmp):
    def plan(name, devices, bounds, seed):
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(H.plan_doc(devices, bounds, 2, M, seed)))
        return str(path)

    cfg = lambda path, clip=CLIP, **extra: H.ds_config(m=M, dp=1, lr=LR, momentum=MOMENTUM, clip=clip,  # noqa: E731
                                                         plan_path=path, extra=extra)
    v = plan("v", V_DEVICES, V_BOUNDS, 3)
    flat = plan("flat", [0, 1], FLAT_BOUNDS, 5)
    ck = str(tmp / "ck")
    resume = dict(first_step=H.STEPS, load=dict(dir=ck, tag="v3"))
    return [
        dict(name="v_fp32", config=cfg(v), eval=True, save=dict(dir=ck, tag="v3")),
        dict(name="v_ckpt", config=cfg(v), ckpt_interval=2),
        dict(name="v_mask", config=cfg(v), masked=True, ckpt_interval=2),
        dict(name="flat_octopipe", config=cfg(flat, clip=0.0), resize=H.MBS * 2),
        dict(name="flat_stock", config=cfg(None, clip=0.0), parts=[0, 3, 9], save=dict(dir=ck, tag="stock3")),
        dict(name="flat_octopipe_lr", config=cfg(flat, clip=0.0, scheduler=WARMUP)),
        dict(name="flat_stock_lr", config=cfg(None, clip=0.0, scheduler=WARMUP), parts=[0, 3, 9]),
        dict(name="v_bf16", config=cfg(v, bf16={"enabled": True})),
        dict(name="v_bf16_immediate", config=cfg(v, bf16={"enabled": True, "immediate_grad_update": True})),
        dict(name="resume_other_plan", config=cfg(flat), **resume),
        # DeepSpeed's engine clips on pipeline rank 0's gradients only: resume it unclipped
        dict(name="resume_deepspeed_partition", plain=True, pp=2, **resume,
             config=cfg(None, clip=0.0, octopipe={"enabled": False, "plan": v})),  # a disabled block: stock engine
        dict(name="refuse_unmapped", config=cfg(v), load=dict(dir=ck, tag="stock3"), fatal=False),
        # a plain PipelineModule with a "tune" block: rebuilt at the plan rank 0 tunes, broadcasts and saves
        dict(name="tune_plain", plain=True, pp=2, config=H.ds_config(
            m=M, dp=1, lr=LR, momentum=MOMENTUM, clip=CLIP, extra={"octopipe": {
                "tune": {"cluster": "h100x2", "time_budget_s": 2}, "save_plan": str(tmp / "tuned.json"),
                "timeout_s": 120}})),
        dict(name="refuse_microbatches", config=cfg(v, train_batch_size=H.MBS * 2), fatal=False),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds2")
    H.run_all(_scenarios(tmp), 2, str(tmp))
    return tmp


def _check_against_reference(reports, clip, atol=1e-5, masked=False):
    ref_losses, ref_weights = H.reference_run(dp=1, m=M, lr=LR, momentum=MOMENTUM, clip=clip, masked=masked)
    for rep in reports:  # every rank returns the same mean loss
        assert rep["losses"] == pytest.approx(ref_losses, abs=atol, rel=atol)
    weights = H.merged_weights(reports)
    assert sorted(weights, key=int) == [str(i) for i in range(H.NUM_LAYERS - 1)]
    for idx, sd in ref_weights.items():
        for k, v in sd.items():
            torch.testing.assert_close(weights[idx][k], v, atol=atol, rtol=atol)


@pytest.mark.timeout(600)
def test_v_shape_irregular_order_matches_reference_with_clipping(runs):
    reports = H.load(runs, "v_fp32", 2)
    assert {r["engine"] for r in reports} == {"OctoPipeEngine"}
    _check_against_reference(reports, CLIP)
    # rank 0 holds the first and the last stage: it alone pulls data, M times per step
    assert reports[0]["holds"] == [True, True] and reports[1]["holds"] == [False, False]
    assert reports[0]["calls"] == [M] * H.STEPS and reports[1]["calls"] == [0] * H.STEPS


@pytest.mark.timeout(60)
def test_eval_batch_equals_training_forward_loss(runs):
    reports = H.load(runs, "v_fp32", 2)
    for rep in reports:
        assert rep["eval"] == pytest.approx(rep["losses"], rel=1e-6)


@pytest.mark.timeout(60)
def test_activation_checkpointing_with_split_backward(runs):
    _check_against_reference(H.load(runs, "v_ckpt", 2), CLIP)


@pytest.mark.timeout(60)
def test_hidden_and_mask_boundary(runs):
    # every stage hands on (hidden states, integer mask): the mask crosses ranks without a gradient
    _check_against_reference(H.load(runs, "v_mask", 2), CLIP, masked=True)


def _assert_same_weights(ours, stock):
    """Every layer's weights after the steps equal between the two engines' runs."""
    wa, wb = H.merged_weights(ours), H.merged_weights(stock)
    for idx in wa:
        for k in wa[idx]:
            torch.testing.assert_close(wa[idx][k], wb[idx][k], atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(60)
def test_same_partition_as_deepspeeds_engine(runs):
    ours, stock = H.load(runs, "flat_octopipe", 2), H.load(runs, "flat_stock", 2)
    assert {r["engine"] for r in stock} == {"PipelineEngine"}
    _check_against_reference(ours, 0.0)
    for a, b in zip(ours, stock):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    _assert_same_weights(ours, stock)


@pytest.mark.timeout(60)
def test_lr_scheduler_steps_as_in_deepspeeds_engine(runs):
    ours, stock = H.load(runs, "flat_octopipe_lr", 2), H.load(runs, "flat_stock_lr", 2)
    plain = H.load(runs, "flat_octopipe", 2)
    for a, b, c in zip(ours, stock, plain):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert a["losses"][1:] != pytest.approx(c["losses"][1:], rel=1e-3)  # the warm-up did change the steps
    _assert_same_weights(ours, stock)


@pytest.mark.timeout(60)
def test_bf16_both_gradient_modes(runs):
    plain, immediate = H.load(runs, "v_bf16", 2), H.load(runs, "v_bf16_immediate", 2)
    ref_losses, _ = H.reference_run(dp=1, m=M, lr=LR, momentum=MOMENTUM, clip=CLIP)
    for a, b in zip(plain, immediate):
        assert a["losses"] == b["losses"]  # the same fp32 master gradients either way
        assert a["losses"] == pytest.approx(ref_losses, rel=2e-2)
    wa, wb = H.merged_weights(plain), H.merged_weights(immediate)
    for idx in wa:
        for k in wa[idx]:
            assert torch.equal(wa[idx][k], wb[idx][k])


@pytest.mark.timeout(60)
def test_checkpoint_resumes_under_another_plan_and_deepspeeds_partition(runs):
    for name, engine, clip in (("resume_other_plan", "OctoPipeEngine", CLIP),
                               ("resume_deepspeed_partition", "PipelineEngine", 0.0)):
        ref_losses, ref_weights = H.reference_run(dp=1, m=M, lr=LR, momentum=MOMENTUM,
                                                  clip=[CLIP] * H.STEPS + [clip] * H.STEPS, steps=2 * H.STEPS)
        reports = H.load(runs, name, 2)
        assert {r["engine"] for r in reports} == {engine}
        for rep in reports:  # momentum buffers followed their parameters: the losses go on as without a break
            assert rep["losses"] == pytest.approx(ref_losses[H.STEPS:], rel=1e-5), name
        weights = H.merged_weights(reports)
        for idx, sd in ref_weights.items():
            for k, v in sd.items():
                torch.testing.assert_close(weights[idx][k], v, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(60)
def test_refusals_name_the_reason(runs):
    for r in range(2):
        err = (runs / f"refuse_unmapped-rank{r}.err").read_text()
        assert "does not record which parameters it belongs to" in err and "load_optimizer_states=False" in err
        err = (runs / f"refuse_microbatches-rank{r}.err").read_text()
        assert "$.gradient_accumulation_steps: expected the plan's micro-batch count 4" in err
    for rep in H.load(runs, "flat_octopipe", 2):  # set_train_batch_size to 2 micro-batches: refused, M stays
        assert "set_train_batch_size: field $.gradient_accumulation_steps: expected the plan's micro-batch count 4" \
            in rep["resize_error"]


@pytest.mark.timeout(60)
def test_plain_module_with_tune_block_runs_a_plan_tuned_on_rank0(runs):
    reports = H.load(runs, "tune_plain", 2)
    assert {r["engine"] for r in reports} == {"OctoPipeEngine"}
    _check_against_reference(reports, CLIP)
    plan = read_plan(runs / "tuned.json")
    assert plan.num_devices == 2 and plan.num_microbatches == M and plan.stages[-1].end == H.NUM_LAYERS
