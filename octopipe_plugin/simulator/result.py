"""What a simulation returns (SimResult, Transfer) and the stuck-plan grid, shared by both simulation loops.

A leaf below `core` (plans without splits) and `split` (plans with split layers), so neither
loop imports the other's module for its result types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..actions import RULES, Action, render_grid
from .memory import memory_curve


class Transfer(NamedTuple):
    """One simulated message between devices, sent when `producer` ended.

    A NamedTuple rather than a frozen dataclass: a detailed 16x64x2 simulation makes about
    4000 of these, and a tuple is built several times faster.
    """

    src: int
    dst: int
    start: float
    end: float
    producer: Action

    @property
    def label(self) -> str:
        """'act 3F12' for an activation, 'grad 4I7' for a gradient, 'split 7H3' to or from a split layer's shard."""
        flow = RULES[self.producer.kind].sends
        return f"{flow.value if flow is not None else 'split'} {self.producer}"


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Timing and memory of a simulated plan."""

    step_time_ms: float
    bubble_ratio: float
    busy_ms: list[float]
    peak_memory_bytes: list[int]
    static_bytes: list[int]
    peak_activation_bytes: list[int]
    # per device: (action, start, end) in run order
    timeline: list[list[tuple[Action, float, float]]]
    transfers: list[Transfer] = field(default_factory=list)
    critical_path: list[tuple[int, Action]] = field(default_factory=list)
    stage_activation: tuple[int, ...] = ()
    # split plans: per device, the live-bytes change of each timeline entry (shard actions hold shares)
    live_changes: list[list[int]] | None = None
    # plans with memory choices (Plan.memory): per device the peak bytes its offloaded activations hold on the host,
    # and every host copy (device, "out" / "in", action, start, end) (detail); None / empty without
    host_peak_bytes: list[int] | None = None
    host_copies: list = field(default_factory=list)

    @property
    def idle_ms(self) -> list[float]:
        """Per-device idle time within the step."""
        return [self.step_time_ms - b for b in self.busy_ms]

    @property
    def utilisation(self) -> list[float]:
        """Per-device share of the step spent computing."""
        step = self.step_time_ms
        return [b / step if step > 0 else 0.0 for b in self.busy_ms]

    def memory_curve(self, device: int, activation: tuple[int, ...] | None = None) -> list[tuple[float, int]]:
        """(time, bytes) steps of one device's memory: static plus live activations."""
        act = self.stage_activation if activation is None else activation
        live = self.live_changes[device] if self.live_changes is not None and activation is None else None
        return memory_curve(self.timeline[device], act, self.static_bytes[device], live)

    def summary(self) -> dict:
        """The `predicted` block of a plan file."""
        return {
            "step_time_ms": round(self.step_time_ms, 6),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
        }


def stuck_grid(schedule, pos, before: int = 6, after: int = 6) -> str:
    """The schedule as a grid, each device's row cut to a window around where it stopped."""
    rows, mark = [], {}
    for d, row in enumerate(schedule):
        lo = max(0, pos[d] - before)
        cells = [str(a) for a in row[lo:pos[d] + after]]
        if lo > 0:
            cells.insert(0, f"..{lo}")
        if pos[d] + after < len(row):
            cells.append(f"+{len(row) - pos[d] - after}")
        if pos[d] < len(row):
            mark[d] = pos[d] - lo + (lo > 0)
        rows.append(cells)
    return render_grid(rows, mark=mark)
