"""Action notation `3F12`: printing, parsing and refusals."""

import pytest
from hypothesis import given, strategies as st

from octopipe_plugin.actions import Action, Kind, parse_schedule, format_schedule, render_grid


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


def test_kind_table_phases_and_flows():
    """The table's phases: one F, and B or both I and W; F carries activations, B and I gradients."""
    from octopipe_plugin.actions import Flow, forms, receivers, senders

    assert forms() == {"forward": {"forward": (Kind.F,)}, "backward": {"fused": (Kind.B,), "split": (Kind.I, Kind.W)}}
    assert receivers(Flow.ACT) == senders(Flow.ACT) == (Kind.F,)
    assert receivers(Flow.GRAD) == senders(Flow.GRAD) == (Kind.B, Kind.I)


@pytest.mark.parametrize("text, ns, src, dst", [
    ("0F0", 3, None, 1), ("2F0", 3, 1, None), ("1B4", 3, 2, 0), ("2I1", 3, None, 1), ("0I1", 3, 1, None),
    ("1W0", 3, None, None), ("0F0", 1, None, None),
])
def test_input_and_output_stages_follow_the_table(text, ns, src, dst):
    a = Action.parse(text)
    assert (a.input_stage(ns), a.output_stage(ns)) == (src, dst)


def _package_modules_after(statement: str) -> set[str]:
    import subprocess
    import sys
    from pathlib import Path

    # what the interpreter loaded before the statement (the venv's .pth loads octopipe_plugin.compat) is not its
    code = ("import sys\nbefore = {m for m in sys.modules if m.startswith('octopipe_plugin.')}\n"
            f"{statement}\nprint(' '.join(m for m in sys.modules if m.startswith('octopipe_plugin') and m not in before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    return set(out.stdout.split())


def test_actions_is_a_leaf_and_formats_does_not_import_schedules():
    """The plan IR imports nothing of the package; the document readers build on it, not on schedules."""
    assert _package_modules_after("import octopipe_plugin.actions") == {"octopipe_plugin", "octopipe_plugin.actions"}
    loaded = _package_modules_after("import octopipe_plugin.formats")
    assert not any(m.startswith("octopipe_plugin.schedules") for m in loaded), loaded
