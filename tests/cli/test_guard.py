"""The wall-clock guard of `octopipe plan`: interrupts work past the budget, spares result assembly and other alarms."""

import signal
import time

import pytest

from octopipe_plugin.cli._guard import BudgetSpent, WallClockGuard


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_guard_interrupts_work_past_the_budget():
    guard = WallClockGuard(0.05)
    with pytest.raises(BudgetSpent):
        with guard:
            _busy(5.0)
    assert guard.fired


def test_guard_stays_quiet_within_the_budget_and_restores_an_outer_alarm():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 10.0)
        with WallClockGuard(0.5) as guard:
            pass
        assert not guard.fired
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 10.0  # the outer alarm is armed again
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


def _result():  # named like the tuner's result assembly, in a module named like the tuner's search
    _busy(0.3)
    return "kept"


def test_guard_spares_the_tuners_result_assembly(monkeypatch):
    monkeypatch.setitem(globals(), "__name__", "octopipe_plugin.tuner.search")
    with WallClockGuard(0.05) as guard:
        assert _result() == "kept"
    assert not guard.fired
