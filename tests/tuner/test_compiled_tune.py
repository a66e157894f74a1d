"""The tuner takes the same path with the compiled list scheduler as with the Python one."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import validate_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import listsched, listsched_kernel, tune

from tuner_helpers import cluster, hetero_model


@pytest.mark.skipif(not listsched_kernel.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("m", [8, 24])  # 24: the search runs at 16 and grows its best to 24
def test_compiled_and_python_schedulers_give_the_same_plan(monkeypatch, m):
    model, cl = hetero_model(12), cluster(4, memory_gib=40)
    monkeypatch.setattr(listsched, "KERNEL_MIN_ACTIONS", 10**9)
    ref = tune(model, cl, m, iterations=60, seed=5)
    monkeypatch.setattr(listsched, "KERNEL_MIN_ACTIONS", 0)
    got = tune(model, cl, m, iterations=60, seed=5)
    assert got.plan.stages == ref.plan.stages and got.plan.schedule == ref.plan.schedule
    assert got.step_ms == ref.step_ms
    validate_plan(got.plan, model.num_layers)
    assert simulate(model, cl, got.plan).step_time_ms == pytest.approx(got.step_ms, abs=1e-6)
