"""validate_plan checks the phases of the kind table: all of them, or only those asked for (forward-only plans)."""

from __future__ import annotations

import pytest

from octopipe_plugin.actions import B, F
from octopipe_plugin.errors import DeadlockError, PlanError
from octopipe_plugin.executor.validate import check_runnable
from octopipe_plugin.formats import Plan, Stage, validate_plan


def _plan(schedule, devices=(0, 1)) -> Plan:
    stages = tuple(Stage(start=s, end=s + 1, device=d) for s, d in enumerate(devices))
    return Plan(model="m", num_devices=max(devices) + 1, num_microbatches=2, stages=stages, schedule=schedule)


FORWARD_ONLY = _plan(((F(0, 0), F(0, 1)), (F(1, 0), F(1, 1))))


def test_forward_only_plan_is_complete_for_the_forward_phase_only():
    validate_plan(FORWARD_ONLY, phases=("forward",))
    check_runnable(FORWARD_ONLY, phases=("forward",))
    with pytest.raises(PlanError, match="needs 0B0 or both 0I0 and 0W0"):
        validate_plan(FORWARD_ONLY)


def test_forward_only_check_refuses_backward_actions_and_unknown_phases():
    full = _plan(((F(0, 0), F(0, 1), B(0, 0), B(0, 1)), (F(1, 0), B(1, 0), F(1, 1), B(1, 1))))
    validate_plan(full)
    with pytest.raises(PlanError, match="0B0 is a backward action; this plan runs only forward"):
        validate_plan(full, phases=("forward",))
    with pytest.raises(PlanError, match="unknown phase"):
        validate_plan(full, phases=("recompute",))


def test_forward_only_order_that_deadlocks_is_refused():
    # one device holds both stages and lists stage 1's forward before the stage 0 forward it needs
    stuck = _plan(((F(1, 0), F(0, 0), F(0, 1), F(1, 1)),), devices=(0, 0))
    with pytest.raises(DeadlockError):
        check_runnable(stuck, phases=("forward",))
