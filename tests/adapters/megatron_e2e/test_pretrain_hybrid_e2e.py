"""End to end through megatron.training.pretrain for a hybrid model: examples/megatron/train_hybrid.py on cpu_run.py.

2 gloo ranks (pipeline size 2), a tiny HybridModel of attention and MLP layers ("*-*-*-": Mamba layers
need GPU kernels; HybridModel, select_pipeline_segment and the builder path are the same), tied
embeddings, 4 micro-batches per step, evaluation every 3 iterations on 2 micro-batches, a save at
iteration 3. Megatron's own logged losses are the oracle:

- Megatron's own schedule on the pattern "*|-*|-|*-" (non-uniform stages, looped, same seeds: the
  same initial weights) against an irregular split-backward OctoPipe plan on those stages: every
  iteration's training loss and every validation loss equal;
- a V-shape plan (stages 0 and 3 on rank 0: the embedding, the LM head and the loss there) resumed at
  iteration 3 from the checkpoint *Megatron's own schedule wrote* (Megatron seeds weights per pipeline
  rank, so a V-shape from scratch has no twin) against Megatron's own resumed run: equal losses.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from e2e_runs import RESUME, ROOT, launch, loss_table
from octopipe_plugin.formats import write_plan
from octopipe_plugin.testing.plans import make_plan, sample_schedule

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

M = 4
PATTERN = "*-*-*-"  # graph layers: embedding, the 6 pattern layers, LM head
BOUNDS = [(0, 2), (2, 4), (4, 5), (5, 8)]
MEGATRON_PATTERN = "*|-*|-|*-"  # the same stages, looped (stage i on rank i % 2)
ARGS = ["--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", str(M), "--eval-global-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--mock-data", "--position-embedding-type", "rope",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--seed", "1234", "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--eval-interval", "3",
        "--eval-iters", "1", "--train-iters", "6", "--save-interval", "3", "--ckpt-format", "torch_dist",
        "--dist-ckpt-optim-fully-reshardable",
        # need CUDA: Transformer Engine, fused kernels, GPU initialisation
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
        "--use-cpu-initialization",
        # the oracle: no dropout draws (the schedules run forwards in different orders)
        "--hidden-dropout", "0", "--attention-dropout", "0"]
# the line the plugin logs for each HybridModel chunk it builds under a plan (Megatron's own has segment_index)
CHUNK = re.compile(r"octopipe: HybridModel: pp_rank=(\d+), vp_stage=(\d+), plan stage (\d+) of \d+, layers '([^']*)'")


def _plan(devices, seed, path):
    plan = make_plan(stage_devices=devices, bounds=BOUNDS, num_devices=2, num_microbatches=M,
                     schedule=sample_schedule(devices, 2, M, random.Random(seed)), model="train_hybrid")
    assert any(a.kind.value == "W" for row in plan.schedule for a in row)  # split backward
    write_plan(plan, path)
    return str(path)


def _launch(log: Path, pattern: str, *extra: str) -> dict:
    """One cpu_run.py launch of train_hybrid.py: its logged losses and the chunks the plugin built."""
    out = launch(log, "--hybrid-layer-pattern", pattern, *ARGS, *extra,
                 script=ROOT / "examples/megatron/train_hybrid.py", timeout=600)
    out["chunks"] = {(int(r), int(v)): (int(s), seg) for r, v, s, seg in CHUNK.findall(out["log"])}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid_e2e")
    looped = _plan([0, 1, 0, 1], 31, d / "looped.json")
    vshape = _plan([0, 1, 1, 0], 32, d / "vshape.json")
    octopipe = ("--pipeline-schedule", "octopipe", "--octopipe-plan")
    out = {"megatron": _launch(d / "megatron.log", MEGATRON_PATTERN, "--save", str(d / "ck_megatron")),
           "octopipe": _launch(d / "octopipe.log", PATTERN, *octopipe, looped),
           "megatron_resumed": _launch(d / "megatron_resumed.log", MEGATRON_PATTERN, "--load", str(d / "ck_megatron"),
                                       *RESUME),
           "vshape_resumed": _launch(d / "vshape_resumed.log", PATTERN, *octopipe, vshape, "--load",
                                     str(d / "ck_megatron"), *RESUME)}
    shutil.rmtree(d / "ck_megatron", ignore_errors=True)
    print(loss_table(out))
    return out


@pytest.mark.timeout(1500)
def test_hybrid_plan_logs_megatron_losses(runs):
    """An irregular split-backward plan on Megatron's hybrid stages: Megatron's logged losses, iteration by iteration."""
    meg, octo = runs["megatron"], runs["octopipe"]
    assert sorted(meg["train"]) == list(range(1, 7)) and sorted(meg["valid"]) == [3, 6]
    assert octo["train"] == meg["train"]
    assert octo["valid"] == meg["valid"]


@pytest.mark.timeout(1500)
def test_hybrid_v_shape_resumed_from_megatrons_checkpoint_logs_megatrons_losses(runs):
    """A V-shape plan resumed at iteration 3 from Megatron's own checkpoint gives Megatron's resumed losses."""
    # the V-shape's chunks were built: rank 0 holds stages 0 and 3 (the embedding, the loss), rank 1 stages 1, 2
    assert runs["vshape_resumed"]["chunks"] == {(0, 0): (0, "*"), (0, 1): (3, "*-"), (1, 0): (1, "-*"),
                                                (1, 1): (2, "-")}
    want = runs["megatron_resumed"]
    assert sorted(want["train"]) == [4, 5, 6]
    assert runs["vshape_resumed"]["train"] == want["train"]
    assert runs["vshape_resumed"]["valid"] == want["valid"]
    assert want["valid"][6] == runs["megatron"]["valid"][6]
