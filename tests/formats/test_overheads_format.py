"""octopipe-overheads/1: round trip, and bad input refused in one line naming the file, field and what was expected."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.actions import Kind
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats.overheads import (MessageCost, Overheads, overheads_from_dict, overheads_to_dict,
                                               read_overheads, write_overheads)

GOOD = {"format": "octopipe-overheads/1", "device": "cpu x1 threads", "backend": "gloo",
        "action_us": {"F": 120.0, "B": 150, "I": 110.0, "W": 60.0},
        "send_us": {"fixed": 30.0, "per_mb": 4.0}, "recv_us": {"fixed": 40.0, "per_mb": 0.0}}


def test_round_trip(tmp_path):
    ov = overheads_from_dict(GOOD)
    assert ov.action(Kind.F) == pytest.approx(0.12) and ov.action(Kind.H) == 0.0
    assert ov.send == MessageCost(fixed_ms=0.03, per_mb_ms=0.004)
    assert ov.recv.ms(2e6) == pytest.approx(0.04)
    path = tmp_path / "ov.json"
    write_overheads(ov, path)
    assert read_overheads(path) == ov
    assert overheads_to_dict(ov)["action_us"]["B"] == 150.0
    assert Overheads().is_zero and not ov.is_zero


def test_delivery_is_optional_and_round_trips(tmp_path):
    # a file written before the busy-sender figure existed still reads: no delivery delay charged
    assert overheads_from_dict(GOOD).delivery == MessageCost()
    ov = overheads_from_dict({**GOOD, "delivery_us": {"fixed": 900.0, "per_mb": 50.0}})
    assert ov.delivery == MessageCost(fixed_ms=0.9, per_mb_ms=0.05) and ov.delivery.ms(2e6) == pytest.approx(1.0)
    path = tmp_path / "ov.json"
    write_overheads(ov, path)
    assert read_overheads(path) == ov
    assert not Overheads(delivery=MessageCost(fixed_ms=0.1)).is_zero


def test_gather_round_is_optional_round_trips_and_scales(tmp_path):
    # a file written before the all-gather figure existed still reads: no round charged
    assert overheads_from_dict(GOOD).gather_round == MessageCost()
    ov = overheads_from_dict({**GOOD, "gather_round_us": {"fixed": 300.0, "per_mb": 20.0}})
    assert ov.gather_round == MessageCost(fixed_ms=0.3, per_mb_ms=0.02)
    path = tmp_path / "ov.json"
    write_overheads(ov, path)
    assert read_overheads(path) == ov
    assert ov.scaled(8.0).gather_round == MessageCost(fixed_ms=2.4, per_mb_ms=0.16)
    assert not Overheads(gather_round=MessageCost(fixed_ms=0.1)).is_zero


@pytest.mark.parametrize("change,field,expected", [
    ({"format": "octopipe-cluster/1"}, "$.format", "'octopipe-overheads/1'"),
    ({"action_us": {"X": 1.0}}, "$.action_us.X", "an action kind"),
    ({"action_us": {"F": -1.0}}, "$.action_us.F", "a finite number in [0.0, 1e+06]"),
    ({"send_us": {"per_mb": 1.0}}, "$.send_us.fixed", "a number (field is missing)"),
    ({"recv_us": {"fixed": "fast"}}, "$.recv_us.fixed", "a number"),
    ({"action_us": [1, 2]}, "$.action_us", "an object"),
    ({"delivery_us": {"per_mb": 1.0}}, "$.delivery_us.fixed", "a number (field is missing)"),
    ({"delivery_us": {"fixed": -5.0}}, "$.delivery_us.fixed", "a finite number in [0.0, 1e+06]"),
    ({"delivery_us": 3.0}, "$.delivery_us", "an object"),
])
def test_bad_input_one_line(tmp_path, change, field, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(FormatError) as err:
        read_overheads(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and field in text and expected in text


def test_cluster_file_given_as_overheads_says_where_it_goes(tmp_path):
    with pytest.raises(FormatError, match="pass it to --cluster"):
        overheads_from_dict({**GOOD, "format": "octopipe-cluster/1"}, "x.json")


def test_scaled_multiplies_every_host_cost_and_keeps_the_rest():
    ov = overheads_from_dict({**GOOD, "launch_us": 10.0, "delivery_us": {"fixed": 5.0, "per_mb": 1.0}})
    big = ov.scaled(8.0)
    assert big.action(Kind.B) == pytest.approx(8 * 0.15) and big.send.ms(1e6) == pytest.approx(8 * 0.034)
    assert big.recv.ms(0) == pytest.approx(8 * 0.04) and big.launch_ms == pytest.approx(0.08)
    assert big.delivery.ms(1e6) == pytest.approx(8 * 0.006) and big.device == ov.device
    assert ov.scaled(1.0) == ov
    bare = ov.scaled(2.0, per_mb=False)
    assert bare.send == MessageCost(fixed_ms=0.06) and bare.delivery == MessageCost(fixed_ms=0.01)
