"""The executor pauses Python's cyclic collector during a step's actions (ExecutorOptions.pause_gc)."""

from __future__ import annotations

import gc

import pytest
import torch

from octopipe_plugin.actions import parse_schedule
from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor
from octopipe_plugin.executor.launch import free_port, init_gloo
from octopipe_plugin.testing.plans import make_plan


@pytest.fixture(autouse=True)
def one_rank_group():
    """A gloo group of this process alone (the executor sends nothing on a one-device plan, but binds one)."""
    init_gloo(0, 1, free_port())
    yield
    torch.distributed.destroy_process_group()


class Recorder:
    """One-stage runner that notes whether the collector is on in each action."""

    def __init__(self):
        self.seen = []

    def boundary_meta(self, stage):
        return None

    def forward(self, stage, mb, inputs, *, batch=None, forward_only=False):
        self.seen.append(gc.isenabled())
        return torch.ones((), dtype=torch.float64)

    def backward(self, stage, mb, grad_output):
        self.seen.append(gc.isenabled())
        return None


def one_stage_plan():
    return make_plan(stage_devices=[0], bounds=[(0, 1)], num_devices=1, num_microbatches=2,
                     schedule=parse_schedule([["0F0", "0F1", "0B0", "0B1"]]))


@pytest.mark.parametrize("pause", [True, False])
def test_the_collector_is_off_in_every_action_and_back_on_after_the_step(pause):
    runner = Recorder()
    ex = PipelineExecutor(one_stage_plan(), runner, rank=0, options=ExecutorOptions(pause_gc=pause))
    assert gc.isenabled()
    ex.run_step()
    assert runner.seen == [not pause] * 4 and gc.isenabled()


def test_a_collector_the_user_switched_off_stays_off():
    runner = Recorder()
    ex = PipelineExecutor(one_stage_plan(), runner, rank=0)
    gc.disable()
    try:
        ex.run_step()
        assert runner.seen == [False] * 4 and not gc.isenabled()
    finally:
        gc.enable()
