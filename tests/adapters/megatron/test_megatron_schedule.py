"""OctoPipe's forward_backward_func inside Megatron (megatron-core 0.19.2, CPU/gloo, tiny GPT, local spec).

Every case trains three optimizer steps (DDP, distributed Adam, grad clipping, loss scaling
through grad_scale_func) and runs a forward-only evaluation after each where marked. The
oracles: the same model at PP=1 in one process (Megatron's no-pipelining schedule), and
Megatron's own interleaved 1F1B (batch_p2p_comm=False) on the same stages. Parameters are
seeded by global layer name, so every split computes the same function.
"""

import random

import pytest
import torch

import megatron_harness as H
import megatron_scenarios as S
from octopipe_plugin.adapters.megatron.layout import plan_to_layout
from octopipe_plugin.testing.plans import make_plan, placement, sample_schedule
from octopipe_plugin.formats import plan_to_dict
from octopipe_plugin.schedules.registry import build_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

M = 4
DENSE = H.TinyGPT(num_layers=8)
# per-token loss: gradients are divided by the step's token count in finalize, which every rank learns from
# the rank that computed the loss (rank 0 under the V-shape below, not Megatron's last pipeline rank)
TIED = H.TinyGPT(num_layers=8, tied=True, args=("--calculate-per-token-loss",))
BF16 = H.TinyGPT(num_layers=8, bf16=True)
MOE = H.TinyGPT(num_layers=8, moe_layers=(2, 5), args=("--disable-bias-linear",))
MTP = H.TinyGPT(num_layers=8, mtp=1)


def irregular(spec, bounds, devices, num_devices, seed, m=M):
    """A plan with the given non-uniform stages and a random valid order, I/W split at random."""
    plan = make_plan(stage_devices=devices, bounds=bounds, num_devices=num_devices, num_microbatches=m,
                     schedule=sample_schedule(devices, num_devices, m, random.Random(seed)), model="tiny-gpt")
    assert any(a.kind.value == "W" for row in plan.schedule for a in row)
    return plan


# graph layers: 0 = embedding, 1..8 = decoder layers, then MTP, then the LM head
LOOPED = irregular(DENSE, [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)], placement("looped", 8, 4),
                   4, seed=1)
VSHAPE = irregular(TIED, [(0, 1), (1, 3), (3, 4), (4, 5), (5, 7), (7, 8), (8, 9), (9, 10)], placement("v", 8, 4), 4,
                   seed=2)
MOE_PLAN = irregular(MOE, [(0, 3), (3, 5), (5, 8), (8, 10)], [0, 1, 2, 3], 4, seed=3)
MTP_PLAN = irregular(MTP, [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 11)], placement("looped", 8, 4),
                     4, seed=4)
VSHAPE_DENSE = irregular(DENSE, [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)],
                         placement("v", 8, 4), 4, seed=6)
VSHAPE_DP = irregular(TIED, [(0, 3), (3, 6), (6, 8), (8, 10)], placement("v", 4, 2), 2, seed=7)
DP_PLAN = irregular(DENSE, [(0, 3), (3, 4), (4, 8), (8, 10)], [0, 1, 0, 1], 2, seed=5)
# PP 2 x EP 2 (4 ranks, DP 2 carved into EP 2), every decoder layer MoE with the all-to-all dispatcher and
# --overlap-moe-expert-parallel-comm (bf16: megatron-core requires it), two chunks per rank
EP_OVERLAP = H.TinyGPT(num_layers=4, moe_layers=(0, 1, 2, 3), bf16=True,
                       args=("--disable-bias-linear", "--expert-model-parallel-size", "2",
                             "--overlap-moe-expert-parallel-comm"))
COMBINED_PLAN = build_plan(EP_OVERLAP.graph(), "combined-1f1b", 2, M, stages_per_device=2)

REFERENCE = [dict(name="dense", spec=DENSE, pp=1, microbatches=M, eval=True),
             dict(name="tied", spec=TIED, pp=1, microbatches=M, eval=True),
             dict(name="moe", spec=MOE, pp=1, microbatches=M),
             dict(name="mtp", spec=MTP, pp=1, microbatches=M),
             dict(name="dense_2m", spec=DENSE, pp=1, microbatches=2 * M),
             dict(name="tied_2m", spec=TIED, pp=1, microbatches=2 * M),
             dict(name="bf16", spec=BF16, pp=1, microbatches=M)]
PIPELINES = [
    dict(name="megatron_interleaved", spec=DENSE, pp=4, microbatches=M, layout=plan_to_layout(LOOPED, DENSE.graph()),
         eval=True, ref="dense"),
    dict(name="octopipe_looped", spec=DENSE, pp=4, microbatches=M, plan=plan_to_dict(LOOPED), eval=True, ref="dense"),
    # also checked: every tensor the plugin makes is placed on the model's device, no tensor is pickled
    dict(name="octopipe_vshape_tied", spec=TIED, pp=4, microbatches=M, plan=plan_to_dict(VSHAPE), eval=True,
         ref="tied", device_check=True),
    dict(name="octopipe_moe", spec=MOE, pp=4, microbatches=M, plan=plan_to_dict(MOE_PLAN), ref="moe"),
    dict(name="octopipe_mtp", spec=MTP, pp=4, microbatches=M, plan=plan_to_dict(MTP_PLAN), ref="mtp"),
    dict(name="octopipe_pp2_dp2", spec=DENSE, pp=2, microbatches=M, plan=plan_to_dict(DP_PLAN), ref="dense_2m"),
    # each chunk's gradient reduce-scatter overlapped: no_sync held until its last B/W, grad_sync right after
    dict(name="octopipe_pp2_dp2_overlap", spec=DENSE, pp=2, microbatches=M, plan=plan_to_dict(DP_PLAN),
         overlap_grad_reduce=True, ref="dense_2m"),
    # V-shape, tied copies on one rank, reductions overlapped: the copies' gradients are summed first
    dict(name="octopipe_vshape_tied_dp2_overlap", spec=TIED, pp=2, microbatches=M, plan=plan_to_dict(VSHAPE_DP),
         overlap_grad_reduce=True, ref="tied_2m"),
    # bf16 (Float16Module): the casts to half precision and back happen at the plan's first and last stage
    dict(name="octopipe_vshape_bf16", spec=BF16, pp=4, microbatches=M, plan=plan_to_dict(VSHAPE_DENSE), ref="bf16"),
    # Megatron's own combined 1F1B, and OctoPipe's plan of the same order with its merged steps as Plan.pairs
    dict(name="megatron_combined_1f1b", spec=EP_OVERLAP, pp=2, microbatches=M,
         layout=plan_to_layout(COMBINED_PLAN, EP_OVERLAP.graph())),
    dict(name="octopipe_pairs_ep2", spec=EP_OVERLAP, pp=2, microbatches=M, plan=plan_to_dict(COMBINED_PLAN)),
    # last: it sets Megatron's global arguments, once per process
    dict(name="megatron_train_step_vshape", spec=DENSE, pp=4, microbatches=M, plan=plan_to_dict(VSHAPE_DENSE),
         train_step=True, ref="dense"),
]


@pytest.fixture(scope="module")
def reference(single_process_references):
    return single_process_references(REFERENCE)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    return S.run_spawned(4, PIPELINES, tmp_path_factory.mktemp("pp") / "pp.pt")


def assert_same_training(got, want, label, half: bool = False):
    """Same per-step losses (and eval losses) and the same weights after three optimizer steps (fp32 tolerances,
    or bf16's: the pipelined run sums in another order, and bf16 keeps 8 bits of mantissa)."""
    lt, wt = (dict(rtol=1e-2, atol=1e-2), dict(rtol=2e-2, atol=1e-2)) if half else \
        (dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=5e-5))
    torch.testing.assert_close(got["losses"], want["losses"], **lt, msg=f"{label}: losses")
    if want["evals"] is not None and got["evals"] is not None:
        torch.testing.assert_close(got["evals"], want["evals"], **lt, msg=f"{label}: eval losses")
    missing = sorted(set(want["weights"]) - set(got["weights"]))
    assert not missing, f"{label}: parameters missing from the pipelined model: {missing}"
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, **wt, msg=f"{label}: weight {name}")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", [c["name"] for c in PIPELINES if "ref" in c])
def test_training_matches_single_process(case, reference, pipelines):
    """Three steps under each pipeline setup give PP=1's losses and weights."""
    spec = next(c for c in PIPELINES if c["name"] == case)
    got = pipelines[case]
    assert_same_training(got, reference[spec["ref"]], case, half=spec["spec"].bf16)
    if spec["spec"].tied:  # the LM head's copy of the tied embedding stayed equal to the embedding
        torch.testing.assert_close(got["weights"]["output_layer.weight"],
                                   got["weights"]["embedding.word_embeddings.weight"], rtol=0, atol=0)


@pytest.mark.timeout(420)
def test_irregular_plan_matches_megatron_interleaved(pipelines):
    """The irregular I/W plan on the same non-uniform stages trains exactly as Megatron's interleaved 1F1B."""
    assert_same_training(pipelines["octopipe_looped"], pipelines["megatron_interleaved"], "octopipe vs megatron")
    assert pipelines["megatron_interleaved"]["evals"] is not None


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", [c["name"] for c in PIPELINES if "plan" in c and not c.get("train_step")
                                  and c["name"] != "octopipe_pairs_ep2"])  # B only: megatron's combined step
def test_weight_gemm_runs_once(case, pipelines):
    """With split backward, each Megatron linear runs its input GEMM and its weight GEMM exactly once."""
    got = pipelines[case]
    assert got["linear_calls"] > 0
    assert got["input_gemms"] == got["linear_calls"], case
    assert got["weight_gemms"] == got["linear_calls"], case


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", [c["name"] for c in PIPELINES if not c.get("train_step") and not c["spec"].bf16
                                  and "ref" in c])
def test_first_step_gradients_match_single_process(case, reference, pipelines):
    """One step's main_grad of every parameter after the gradient reduction, before the optimizer (fp32): equal to
    PP=1's within a relative 1e-3 per parameter (bf16 is left to the loss and weight checks: its rounding is
    about as large as the scale errors this check is for)."""
    spec = next(c for c in PIPELINES if c["name"] == case)
    bad = H.grad_mismatches(pipelines[case]["grads"], reference[spec["ref"]]["grads"])
    assert not bad, f"{case}: " + "; ".join(bad[:5])


@pytest.mark.timeout(420)
def test_gradient_check_fails_a_one_percent_scale_error(reference, pipelines):
    """The gradient tolerance catches a 1% scale error: the same gradients x1.01 fail, on every parameter."""
    want = reference["dense"]["grads"]
    got = pipelines["octopipe_looped"]["grads"]
    assert not H.grad_mismatches(got, want)
    scaled = {k: v * 1.01 for k, v in got.items()}
    bad = H.grad_mismatches(scaled, want)
    assert len(bad) == len(want), f"x1.01 passed the check on {len(want) - len(bad)} parameters"


@pytest.mark.timeout(420)
def test_pairs_run_megatrons_combined_step_and_train_as_megatron_combined_1f1b(pipelines):
    """PP 2 x EP 2 under --overlap-moe-expert-parallel-comm: OctoPipe's plan with pairs runs each pair as one of
    megatron-core's combined F+B steps (as many per rank as Megatron's own combined 1F1B merges, and as the plan
    pairs), and every loss, first-step main_grad and weight after three steps equals Megatron's own run (a 1% scale
    error on the gradients fails)."""
    got, want = pipelines["octopipe_pairs_ep2"], pipelines["megatron_combined_1f1b"]
    per_rank = [sum(1 for a, _ in COMBINED_PLAN.pairs if COMBINED_PLAN.stages[a.stage].device == r // 2) * S.STEPS
                for r in range(4)]  # pipeline rank = global rank // 2 (megatron's order: PP outermost)
    assert [c["F+B"] for c in want["combined"]] == per_rank
    assert got["combined"] == want["combined"]
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    bad = H.grad_mismatches(got["grads"], want["grads"], rel=1e-4)
    assert not bad, "; ".join(bad[:5])
    assert len(H.grad_mismatches({k: v * 1.01 for k, v in got["grads"].items()}, want["grads"], rel=1e-4)) == len(
        want["grads"])
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=f"weight {name}")


@pytest.mark.timeout(420)
def test_adapter_places_every_tensor_on_the_model_device(pipelines):
    """Under a V-shape (loss dicts and the token count travel between ranks), training and evaluation steps:
    no tensor made by the plugin without the model's device, no tensor through pickling."""
    problems = [p for rank in pipelines["octopipe_vshape_tied"]["device_problems"] for p in rank]
    assert not problems, "\n".join(sorted(set(problems)))


def test_placement_check_catches_an_unplaced_tensor():
    """The check fails code in the plugin that makes a tensor without a device, or on another device."""
    import os

    import device_check
    import octopipe_plugin

    path = os.path.join(os.path.dirname(octopipe_plugin.__file__), "adapters", "megatron", "made_up.py")
    code = compile("torch.zeros([], dtype=torch.int)\ntorch.zeros([], device='meta')\ntorch.zeros([], device='cpu')",
                   path, "exec")
    with device_check.PlacementCheck("cpu") as mode:
        exec(code, {"torch": torch})
    assert len(mode.problems) == 2, mode.problems
    assert "no device=" in mode.problems[0] and "made on meta" in mode.problems[1]
