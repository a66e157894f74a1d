"""The modelled accelerator of sleeping stand-ins: when each action starts and ends on the host clock.

Shared by stand-ins that run outside the executor's own SleepStages (the Megatron stand-in
chunks of examples/megatron/benchmark.py, driven by Megatron's schedule and by OctoPipe's), so
both schedules are timed by one rule, the simulator's: an action starts when its device is
free and its input has landed (send time + transfer time), and lasts its cost.
"""

from __future__ import annotations

import time

CLOCKS = ("device", "wall", "off")


def sleep_until(deadline: float) -> None:
    """Sleep until the host clock reads `deadline` (seconds since the epoch)."""
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


class DeviceClock:
    """One device's queue: 'device' runs actions back to back while the host dispatches ahead (asynchronous
    kernels), 'wall' charges every host delay (each action sleeps its cost from when the host reaches it),
    'off' sleeps nothing (warm-up steps)."""

    def __init__(self, mode: str = "device"):
        if mode not in CLOCKS:
            raise ValueError(f"clock {mode!r}: expected one of {CLOCKS}")
        self.mode = mode
        self.free = 0.0  # when the device finishes its last action
        self.busy_s = 0.0

    def start(self, t0: float) -> None:
        """Start the device at the shared start instant."""
        self.free = t0
        self.busy_s = 0.0

    def work(self, ms: float, ready_at: float = 0.0) -> float:
        """Run one action of `ms` that may not start before `ready_at`; returns its end time."""
        if self.mode == "off":
            return time.time()
        if self.mode == "wall":
            sleep_until(ready_at)
            start = time.time()
            sleep_until(start + ms / 1000.0)
            end = time.time()
            self.busy_s += end - start
            return end
        start = max(self.free, ready_at)
        sleep_until(start + ms / 1000.0)
        end = max(start + ms / 1000.0, time.time())  # a host later than the deadline delays the device
        self.free = end
        self.busy_s += ms / 1000.0
        return end
