"""The pretrain() end-to-end tests' shared reference launch: Megatron's own run of one configuration, launched once
for every file that compares against it."""

from __future__ import annotations

import shutil

import pytest
import torch

from e2e_runs import MEGATRON_LAYOUT, PROBE, TIED_ARGS, launch


@pytest.fixture(scope="session")
def tied_megatron(tmp_path_factory):
    """Megatron's own schedule on "Et|t|t|tL", embeddings tied (Megatron's default), TIED_ARGS, saving at iteration
    3, on the probe script: its logged losses, its first step's reduced main_grads ("grads") and its checkpoint
    directory ("checkpoint"). The oracle of test_pretrain_e2e.py (losses, the checkpoint its resumed runs load) and
    of test_pretrain_split_e2e.py's tied runs (losses, gradients): one launch instead of two identical ones."""
    d = tmp_path_factory.mktemp("e2e_tied_megatron")
    out = launch(d / "megatron.log", *TIED_ARGS, "--pipeline-model-parallel-layout", MEGATRON_LAYOUT,
                 "--save", str(d / "ck_megatron"), script=PROBE, env={"OCTOPIPE_E2E_GRADS": str(d / "grads.pt")})
    yield {**out, "grads": torch.load(d / "grads.pt"), "checkpoint": d / "ck_megatron"}
    shutil.rmtree(d / "ck_megatron", ignore_errors=True)
