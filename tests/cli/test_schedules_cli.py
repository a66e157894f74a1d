"""`octopipe schedules`: the pairs column, the new built-in, and `--show`, which draws a schedule with its pairs."""

from __future__ import annotations

import json

from octopipe_plugin.actions import parse_paired
from octopipe_plugin.cli import main
from octopipe_plugin.schedules.placement import looped
from octopipe_plugin.schedules.generators import combined_1f1b
from octopipe_plugin.schedules.registry import SCHEDULES


def _run(capsys, *argv, expect: int = 0) -> str:
    rc = main(["schedules", *argv])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if rc == 0 else err


def test_the_table_shows_combined_1f1b_and_which_schedules_pair(capsys):
    out = _run(capsys)
    assert "pairs" in out.splitlines()[0]
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "combined-1f1b" in lines and SCHEDULES["combined-1f1b"].requirements in lines["combined-1f1b"]
    assert lines["dualpipev"].split()[4] == "yes" and lines["combined-1f1b"].split()[4] == "yes"
    assert lines["interleaved-1f1b"].split()[4] == "no"
    rows = {r["name"]: r for r in json.loads(_run(capsys, "--json"))}
    assert rows["combined-1f1b"]["pairs"] and rows["dualpipev"]["pairs"] and not rows["zb-v"]["pairs"]


def test_show_draws_the_pairs(capsys):
    out = _run(capsys, "--show", "dualpipev", "--devices", "2", "--microbatches", "4")
    assert "6 overlapped pair(s)" in out
    dev0 = next(line for line in out.splitlines() if line.startswith("dev0"))
    cells = dev0.split("|", 1)[1].split()
    at = cells.index("0F3+")
    assert cells[at + 1] == "3B1"  # the pair's halves side by side, the first one marked
    out = _run(capsys, "--show", "combined-1f1b", "--devices", "2", "--microbatches", "4", "--stages-per-device", "2",
               "--width", "6")
    assert "8 overlapped pair(s)" in out and "... (+" in out


def test_show_json_is_the_plan_notation(capsys):
    doc = json.loads(_run(capsys, "--show", "combined-1f1b", "--devices", "2", "--microbatches", "4",
                          "--stages-per-device", "2", "--json"))
    assert doc["stages_per_device"] == 2
    schedule, pairs = parse_paired(doc["schedule"])
    want = combined_1f1b(looped(2, 2), 2, 4)
    assert schedule == tuple(want) and pairs == want.pairs


def test_show_refusals(capsys):
    err = _run(capsys, "--show", "combined-1f1b", "--devices", "4", "--microbatches", "2", expect=2)
    assert "at least 4 micro-batches" in err
    err = _run(capsys, "--show", "dualpipev", "--devices", "2", expect=2)
    assert "--microbatches" in err
    err = _run(capsys, "--devices", "2", expect=2)
    assert "--show" in err
