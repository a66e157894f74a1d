"""End to end through megatron.training.pretrain with overlapped pairs: examples/megatron/train_gpt.py on 4 gloo
ranks (PP 2 x EP 2, bf16, MoE layers on the all-to-all dispatcher, --overlap-moe-expert-parallel-comm).

Megatron's own combined 1F1B on the layout "Et|t|t|tL" is the oracle (its logged training and validation losses);
OctoPipe's `combined-1f1b` plan on the same stages, whose merged steps are Plan.pairs run by megatron-core's
combined step (adapters/megatron/pairs.py), logs the same losses and saves at iterations 2 and 4. The same plan
resumed from its own iteration-2 checkpoint continues exactly as the uninterrupted run: the same iteration-3 and
validation losses, and an iteration-4 checkpoint equal tensor for tensor (weights, fp32 main weights, Adam state).

The MoE layers are decoder layers 1 and 2 (`--moe-layer-freq [0,1,1,0]`), one on each pipeline rank, not the other
e2e tests' [0,1,0,1] (both on rank 1): megatron-core 0.19.2 cannot load a torch_dist checkpoint written under
--bf16/--fp16 without the distributed optimizer when a pipeline rank holds no expert parameters. Megatron's own
run fails the same way, "Cannot merge two lists with different lengths (0 and 4, encountered at level
('optimizer', 1, 'fp32_from_fp16_params', 0))", and nothing on that path depends on the device. The optimizer
aligns param groups across ranks, so such a rank's expert optimizer has one group with no parameters
(core/optimizer/__init__.py:359-374); Float16OptimizerWithFloat16Params.sharded_state_dict writes its fp32 copies
as one list per group (core/optimizer/optimizer.py:1162); the empty `[]` stays in the non-tensor "common" part
(core/dist_checkpointing/dict_utils.py:55-62); only global rank 0's common part is saved
(core/dist_checkpointing/serialization.py:439-445); and the ranks with experts merge their loaded 4-tensor lists
into rank 0's empty one at load (serialization.py:190, dict_utils.py:230). Not OctoPipe's: a plan that leaves a
rank without MoE layers meets the same (docs/megatron-schedule.md, "Overlapped pairs").
"""

from __future__ import annotations

import shutil

import pytest
import torch

from e2e_runs import MEGATRON_LAYOUT, MODEL, SPLIT_BOUNDS, launch, loss_table
from octopipe_plugin.formats import Layer, Model, write_plan
from octopipe_plugin.schedules.registry import build_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

# graph layers: embedding, 4 decoder layers (MoE on 1 and 2: one per pipeline rank, see above), LM head
KINDS = ["embedding", "dense", "moe", "moe", "dense", "lm_head"]
ARGS = [*MODEL, "--global-batch-size", "8",  # 4 micro-batches per step on each of the 2 data-parallel replicas
        # one MoE layer per pipeline rank, overriding MODEL's [0,1,0,1] (the last one given wins): megatron-core's
        # own checkpoint limit above (not a CPU one), so that Megatron's run and this plan's can resume
        "--moe-layer-freq", "[0,1,1,0]",
        "--expert-model-parallel-size", "2", "--bf16", "--overlap-moe-expert-parallel-comm",
        "--train-iters", "4", "--eval-interval", "2", "--save-interval", "2"]


def _tensors(checkpoint) -> dict:
    """Every tensor of a torch_dist checkpoint directory (one iteration), by its global key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = checkpoint.parent / f"{checkpoint.parent.name}_{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    return {k: v for k, v in torch.load(whole, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e_pairs")
    graph = Model(name="train_gpt", layers=tuple(
        Layer(name=f"l{i}", kind=k, fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1, activation_bytes=1,
              output_bytes=1) for i, k in enumerate(KINDS)))
    plan = build_plan(graph, "combined-1f1b", 2, 4, boundaries=SPLIT_BOUNDS, stages_per_device=2)
    assert plan.pairs
    write_plan(plan, d / "plan.json")
    octo = ["--pipeline-schedule", "octopipe", "--octopipe-plan", str(d / "plan.json")]
    out = {"megatron": launch(d / "megatron.log", *ARGS, "--pipeline-model-parallel-layout", MEGATRON_LAYOUT,
                              nproc=4),
           "octopipe": launch(d / "octopipe.log", *ARGS, *octo, "--save", str(d / "ck"), nproc=4)}
    out["saved"] = sorted(p.name for p in (d / "ck").iterdir())
    # resumed at iteration 2 from its own checkpoint (the shimmed CUDA RNG state saved on CPU is empty: no RNG
    # loaded; no dropout, seeded mock data), saving again at 4
    out["resumed"] = launch(d / "resumed.log", *ARGS, *octo, "--load", str(d / "ck"), "--ckpt-step", "2",
                            "--no-load-rng", "--save", str(d / "ck_resumed"), nproc=4)
    out["at4"] = {name: _tensors(d / name / "iter_0000004") for name in ("ck", "ck_resumed")}
    print(loss_table({k: out[k] for k in ("megatron", "octopipe", "resumed")}, iterations=4))
    yield out
    for name in ("ck", "ck_resumed"):
        shutil.rmtree(d / name, ignore_errors=True)
        (d / f"{name}_iter_0000004.pt").unlink(missing_ok=True)


@pytest.mark.timeout(600)
def test_paired_plan_logs_megatron_combined_1f1b_losses_and_saves(runs):
    table = loss_table({k: runs[k] for k in ("megatron", "octopipe")}, iterations=4)
    want = runs["megatron"]
    assert sorted(want["train"]) == [1, 2, 3, 4] and want["valid"], table
    assert runs["octopipe"]["train"] == want["train"] and runs["octopipe"]["valid"] == want["valid"], table
    assert "run half after half" not in runs["octopipe"]["log"], "the plan's pairs did not run as pairs"
    assert "iter_0000002" in runs["saved"] and "iter_0000004" in runs["saved"], runs["saved"]


@pytest.mark.timeout(600)
def test_paired_plan_resumes_from_its_own_checkpoint(runs):
    """Resumed at iteration 2: the uninterrupted run's iteration-3 loss and validation loss at 4, and at
    iteration 4 the same checkpoint, every tensor equal."""
    full, resumed = runs["octopipe"], runs["resumed"]
    table = loss_table({"octopipe": full, "resumed": resumed}, iterations=4)
    assert "run half after half" not in resumed["log"], "the resumed plan's pairs did not run as pairs"
    assert sorted(resumed["train"]) == [3, 4] and resumed["train"][3] == full["train"][3], table
    # Megatron's training_log does not reset its sums after a run's first logged iteration
    # (megatron/training/training.py:2594, should_reset = not is_first_iteration), so a run's second logged
    # loss is the mean of its first two: the resumed run's "4" is the mean of iterations 3 and 4 (as a fresh
    # run's "2" is of 1 and 2), to the log's 7 digits
    assert abs(resumed["train"][4] - (full["train"][3] + full["train"][4]) / 2) <= 2e-6, table
    assert resumed["valid"] == {4: full["valid"][4]}, table
    ours, theirs = runs["at4"]["ck_resumed"], runs["at4"]["ck"]
    assert ours.keys() == theirs.keys() and len(ours) > 100
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not differ, f"iteration-4 checkpoints differ in {differ}"
