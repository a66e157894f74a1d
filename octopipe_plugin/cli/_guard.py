"""A wall-clock guard that holds `octopipe plan` to its --time-budget even where the tuner cannot check it.

The tuner checks its deadline between steps, but one step at a large scale (a first full-size
schedule, a baseline) can outlast the whole budget. At the deadline the guard raises
`BudgetSpent`, a KeyboardInterrupt, which the tuner already answers like Ctrl-C: it stops and
returns the best plan in hand. It never fires while the tuner assembles its result, so a found
plan is not lost to the guard.
"""

from __future__ import annotations

import signal
import threading
import time

# functions of octopipe_plugin.tuner.search that run after the search has ended: not interrupted
_FINISHING = frozenset({"_result", "_without_empty_stages"})


class BudgetSpent(KeyboardInterrupt):
    """The time budget ran out while the tuner was still working."""


class WallClockGuard:
    """Context manager: SIGALRM after `seconds` raises BudgetSpent once (POSIX main thread; else a no-op).

    `fired` tells afterwards whether the budget ran out (the tuner may re-raise a plain KeyboardInterrupt).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.fired = False
        self._old = None

    def _fire(self, signum, frame) -> None:
        f = frame
        while f is not None:
            if f.f_code.co_name in _FINISHING and f.f_globals.get("__name__", "").endswith("tuner.search"):
                return  # the search is over: let the result be assembled
            f = f.f_back
        self.fired = True
        raise BudgetSpent()

    def __enter__(self):
        self.active = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        if self.active:
            # An alarm already set (pytest-timeout, a caller's own) keeps working: when it comes first the
            # guard stands aside, otherwise it is re-armed with what is left of it on exit.
            self._prev, _ = signal.getitimer(signal.ITIMER_REAL)
            if 0 < self._prev <= self.seconds:
                self.active = False
                return self
            self._start = time.monotonic()
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
            if self._prev > 0:
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, self._prev - (time.monotonic() - self._start)))
        return False
