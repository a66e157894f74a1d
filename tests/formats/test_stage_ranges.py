"""One stage-range rule: the file reader, validate_plan and build_plan's boundaries refuse exactly the same ranges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from octopipe_plugin.actions import B, F
from octopipe_plugin.errors import FormatError, PlanError
from octopipe_plugin.formats import Layer, Model, Plan, Stage, plan_from_dict, plan_to_dict, validate_plan
from octopipe_plugin.formats.ranges import stage_range_problem
from octopipe_plugin.schedules.registry import build_plan


def _tiles(ranges, num_layers) -> bool:
    """Oracle: walking the ranges in order steps through 0..num_layers with no gap, overlap or reversal."""
    pos = 0
    for a, b in ranges:
        if a != pos or b < a:
            return False
        pos = b
    return bool(ranges) and pos == num_layers


def _plan(ranges) -> Plan:
    stages = tuple(Stage(start=a, end=b, device=s) for s, (a, b) in enumerate(ranges))
    return Plan(model="m", num_devices=len(ranges), num_microbatches=1, stages=stages,
                schedule=tuple((F(s, 0), B(s, 0)) for s in range(len(ranges))))


def _model(n: int) -> Model:
    return Model(name="m", layers=tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0,
                                              state_bytes=0, activation_bytes=0, output_bytes=0) for i in range(n)))


@settings(max_examples=150, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
       num_layers=st.integers(1, 6))
def test_every_reader_agrees_with_the_one_rule(ranges, num_layers):
    ok = _tiles(ranges, num_layers)
    assert (stage_range_problem(ranges, num_layers) is None) == ok
    outcomes = []
    try:
        validate_plan(_plan(ranges), num_layers)
        outcomes.append(True)
    except PlanError:
        outcomes.append(False)
    doc = plan_to_dict(_plan(ranges))
    try:
        plan_from_dict(doc, "p.json", num_layers)
        outcomes.append(True)
    except FormatError:
        outcomes.append(False)
    try:
        build_plan(_model(num_layers), "1f1b", len(ranges), 1, boundaries=ranges)
        outcomes.append(True)
    except PlanError:
        outcomes.append(False)
    assert outcomes == [ok, ok, ok]


@pytest.mark.parametrize("ranges, path, expected", [
    ([(1, 3)], "$.stages[0].layers[0]", "0 (stages must cover"),
    ([(0, 2), (3, 4)], "$.stages[1].layers[0]", "2 (the end of stage 0"),
    ([(0, 2), (2, 3)], "$.stages[1].layers[1]", "4 (the model's layer count)"),
])
def test_problem_names_the_field_and_what_was_expected(ranges, path, expected):
    problem = stage_range_problem(ranges, 4)
    assert problem.path == path and problem.expected.startswith(expected)
