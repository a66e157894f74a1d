"""The modelled accelerator of sleeping stand-ins: when each action starts and ends on the host clock.

The one timing rule of every stand-in (the dry run's SleepStages, the sleeping layers of
testing/sleep_layer.py inside Megatron chunks and DeepSpeed pipelines), the simulator's:
an action starts when its device is free and its input has landed (send time + transfer
time), and lasts its cost. The host may reach an action late (Python overhead, a blocking
receive): that delays the device only when it exceeds what the queue hides, as with
asynchronous kernels. time.sleep waking late is not the device's delay (a GPU has no
scheduler tick): the next deadline counts from this one's, so the oversleep is taken back
from the next sleep instead of adding up over the hundreds of sleeps of a step.

An overlapped pair (`DeviceClock.overlapped`) is one unit whose own phases the caller sleeps
for real, on two threads (the device's compute and its link): it starts like an action, when the
device is free and its inputs have landed, and lasts what its phases really took, so how much
of one half's communication hides behind the other half's compute is measured, not assumed.

The 'wall' clock measures without that rule: an action sleeps its cost from the moment the
host reaches it, and its input is there when the host has received it, since in wall mode
the stand-ins send payloads of the modelled size over the process group (`wall_numel`) and
stamp no arrival times: the transfer, its contention and every host delay are the measurement.
"""

from __future__ import annotations

import math
import time

CLOCKS = ("device", "wall", "off")
WALL_ELEMENT_BYTES = 8  # wall-mode payloads are float64, as the stand-ins' stamps and headers need


def wall_numel(nbytes: float, at_least: int = 1) -> int:
    """Elements of a float64 wall-mode payload of `nbytes` (the model's bytes across the cut), `at_least` many."""
    return max(int(at_least), math.ceil(nbytes / WALL_ELEMENT_BYTES))


def sleep_until(deadline: float) -> None:
    """Sleep until the host clock reads `deadline` (seconds since the epoch)."""
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


class DeviceClock:
    """One device's queue: 'device' runs actions back to back while the host dispatches ahead (asynchronous
    kernels), 'wall' charges every host delay (each action sleeps its cost from when the host reaches it; the
    input's arrival is when the host received it, `ready_at` is not waited for), 'off' sleeps nothing (warm-up)."""

    def __init__(self, mode: str = "device"):
        if mode not in CLOCKS:
            raise ValueError(f"clock {mode!r}: expected one of {CLOCKS}")
        self.mode = mode
        self.free = 0.0  # when the device finishes its last action
        self.busy_s = 0.0
        self.owed = 0.0  # how far the host trails the device clock because a sleep woke late

    def start(self, t0: float) -> None:
        """Start the device at the shared start instant."""
        self.free = t0
        self.busy_s = 0.0
        self.owed = 0.0

    def work(self, ms: float, ready_at: float = 0.0) -> float:
        """Run one action of `ms` that may not start before `ready_at`; returns its end time."""
        if self.mode == "off":
            return time.time()
        if self.mode == "wall":
            start = time.time()
            sleep_until(start + ms / 1000.0)
            end = time.time()
            self.busy_s += end - start
            return end
        arrived = time.time()
        start = max(self.free, ready_at)
        # a host later than the deadline delays the device, by its own lateness, not by earlier oversleeps
        end = max(start + ms / 1000.0, arrived - self.owed)
        sleep_until(end)
        self.owed = max(0.0, time.time() - end)
        self.free = end
        self.busy_s += ms / 1000.0
        return end

    def overlapped(self, run, ready_at: float = 0.0) -> float:
        """Run one unit that sleeps its own phases (`run()`, an overlapped pair's) once the device is free and
        `ready_at` has passed; it lasts what `run` really took. Returns its end time."""
        if self.mode == "off":
            return time.time()
        if self.mode == "wall":
            start = time.time()
            run()
            end = time.time()
            self.busy_s += end - start
            return end
        start = max(self.free, ready_at)
        sleep_until(start)
        began = time.time()
        run()
        elapsed = time.time() - began
        # the unit lasts its measured span from its modelled start; a host that reached it late trails the device
        # (taken back from the next sleep, as an oversleep is)
        end = start + elapsed
        self.owed = max(0.0, time.time() - end)
        self.free = end
        self.busy_s += elapsed
        return end
