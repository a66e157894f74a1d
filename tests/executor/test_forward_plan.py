"""Forward-only plans for evaluation batches of any size, on the training plan's stages and placement."""

import random

import pytest

from octopipe_plugin.actions import Kind
from octopipe_plugin.executor.engine import forward_plan
from octopipe_plugin.testing.plans import make_plan, placement, sample_schedule
from octopipe_plugin.executor.validate import check_runnable


@pytest.mark.parametrize("m", [1, 3, 4, 7])
def test_forward_plan_for_any_count_is_runnable(m):
    devices = placement("v", 8, 4)
    plan = make_plan(stage_devices=devices, bounds=[(i, i + 1) for i in range(8)], num_devices=4,
                     num_microbatches=4, schedule=sample_schedule(devices, 4, 4, random.Random(2)))
    fwd = forward_plan(plan, m)
    check_runnable(fwd)  # deadlock-free, every (stage, micro-batch) forward exactly once
    assert fwd.num_microbatches == m and fwd.stages == plan.stages
    assert all(a.kind is Kind.F for row in fwd.schedule for a in row)
    assert sorted((a.stage, a.microbatch) for row in fwd.schedule for a in row) == \
        sorted((s, mb) for s in range(8) for mb in range(m))
