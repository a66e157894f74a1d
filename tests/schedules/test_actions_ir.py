"""Action notation `3F12`: printing, parsing and refusals."""

import pytest
from hypothesis import given, strategies as st

from octopipe_plugin.schedules.actions import Action, Kind, parse_schedule, format_schedule, render_grid


@given(st.integers(0, 999), st.sampled_from(list(Kind)), st.integers(0, 9999))
def test_print_parse_round_trip(stage, kind, mb):
    a = Action(stage, kind, mb)
    assert Action.parse(str(a)) == a


def test_notation_matches_formats_md():
    assert str(Action(3, Kind.F, 12)) == "3F12"
    assert Action.parse("0W4") == Action(0, Kind.W, 4)


@pytest.mark.parametrize("bad", ["", "F1", "3X1", "3F", "-1F2", "3f1", "3F1.5", 7])
def test_unparsable_actions_are_refused_with_the_text(bad):
    with pytest.raises(ValueError, match="does not parse"):
        Action.parse(bad)


def test_schedule_round_trip_and_grid_marks_action():
    rows = [["0F0", "0B0"], ["1F0", "1I0", "1W0"]]
    sched = parse_schedule(rows)
    assert format_schedule(sched) == rows
    grid = render_grid(sched, mark={1: 2})
    assert "[1W0]" in grid and grid.count("\n") == 1
