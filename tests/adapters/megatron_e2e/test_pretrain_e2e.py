"""End to end through megatron.training.pretrain: examples/megatron/train_gpt.py launched by cpu_run.py.

2 gloo ranks (pipeline size 2), a tiny GPT with tied embeddings and MoE layers (aux loss), 4
micro-batches per step, evaluation every 3 iterations on 2 micro-batches (--eval-global-batch-size:
another count than training's, run by a forward-only plan), a save at iteration 3. Megatron's own
logged losses are the oracle, read from its log lines:

- Megatron's own schedule on the layout "Et|t|t|tL" (the same layers per stage, same seeds: the
  same initial weights) against an irregular OctoPipe plan with split backward on those stages:
  every iteration's training loss and every validation loss equal;
- the OctoPipe run resumed at iteration 3 from its own checkpoint, and a V-shape plan resumed at
  iteration 3 from the checkpoint *Megatron's own schedule wrote* (Megatron seeds weights per
  pipeline rank, so a V-shape from scratch has no twin), against Megatron's own run resumed
  from that checkpoint: equal losses; and the resumed runs end where the uninterrupted ones do.

Launches are shared between checks (one module-scoped fixture runs them once); Megatron's uninterrupted run
is conftest.py's tied_megatron, the same launch test_pretrain_split_e2e.py's tied runs compare against (on the
probe script train_gpt_grads.py, which only reads the first step's gradients).
"""

from __future__ import annotations

import random
import shutil

import pytest

from e2e_runs import MEGATRON_LAYOUT, RESUME, TIED_ARGS, launch, loss_table
from octopipe_plugin.testing.plans import make_plan, sample_schedule
from octopipe_plugin.formats import write_plan

pytestmark = [pytest.mark.framework, pytest.mark.distributed]

M = 4  # TIED_ARGS: --global-batch-size 4 of micro-batch size 1
BOUNDS = [(0, 2), (2, 3), (3, 4), (4, 6)]  # graph layers: embedding, 4 decoder layers, LM head
# MEGATRON_LAYOUT "Et|t|t|tL": the same stages, looped (stage i on rank i % 2)
ARGS = TIED_ARGS  # M micro-batches per step, 2 for evaluation


def _plan(devices, seed, path):
    plan = make_plan(stage_devices=devices, bounds=BOUNDS, num_devices=2, num_microbatches=M,
                     schedule=sample_schedule(devices, 2, M, random.Random(seed)), model="train_gpt")
    assert any(a.kind.value == "W" for row in plan.schedule for a in row)  # split backward
    write_plan(plan, path)
    return str(path)


def _launch(log, *extra: str) -> dict:
    """One 2-rank launch of train_gpt.py with the scenario's arguments."""
    return launch(log, *ARGS, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tied_megatron):
    d = tmp_path_factory.mktemp("e2e")
    looped = _plan([0, 1, 0, 1], 11, d / "looped.json")
    vshape = _plan([0, 1, 1, 0], 12, d / "vshape.json")
    megatron_ck = tied_megatron["checkpoint"]  # Megatron's own run saved it at iteration 3
    out = {}
    out["megatron"] = tied_megatron
    out["octopipe"] = _launch(d / "octopipe.log", "--pipeline-schedule", "octopipe", "--octopipe-plan", looped,
                              "--save", str(d / "ck_octopipe"))
    out["megatron_resumed"] = _launch(d / "megatron_resumed.log", "--pipeline-model-parallel-layout",
                                      MEGATRON_LAYOUT, "--load", str(megatron_ck), *RESUME)
    out["octopipe_resumed"] = _launch(d / "octopipe_resumed.log", "--pipeline-schedule", "octopipe",
                                      "--octopipe-plan", looped, "--load", str(d / "ck_octopipe"), *RESUME)
    out["vshape_resumed"] = _launch(d / "vshape_resumed.log", "--pipeline-schedule", "octopipe",
                                    "--octopipe-plan", vshape, "--load", str(megatron_ck), *RESUME)
    shutil.rmtree(d / "ck_octopipe", ignore_errors=True)
    print(loss_table(out))
    return out


@pytest.mark.timeout(1500)
def test_octopipe_plan_logs_megatron_losses(runs):
    """An irregular split-backward plan on Megatron's stages: Megatron's logged losses, iteration by iteration."""
    meg, octo = runs["megatron"], runs["octopipe"]
    assert sorted(meg["train"]) == list(range(1, 7)) and sorted(meg["valid"]) == [3, 6]
    assert octo["train"] == meg["train"]
    assert octo["valid"] == meg["valid"]


@pytest.mark.timeout(1500)
def test_resumed_runs_log_megatron_losses(runs):
    """Resumed at iteration 3: the OctoPipe plan from its own checkpoint and a V-shape plan from Megatron's
    give the losses of Megatron's own resumed run, and end where the uninterrupted runs end."""
    want = runs["megatron_resumed"]
    assert sorted(want["train"]) == [4, 5, 6]
    for name in ("octopipe_resumed", "vshape_resumed"):
        assert runs[name]["train"] == want["train"], name
        assert runs[name]["valid"] == want["valid"], name
    assert want["valid"][6] == runs["megatron"]["valid"][6]
    assert runs["octopipe_resumed"]["valid"][6] == runs["octopipe"]["valid"][6]
