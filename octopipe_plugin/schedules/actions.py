"""The action IR: `Action(kind, stage, microbatch)`, written `3F12` as in FORMATS.md."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """F forward, B fused backward, I input-gradient backward, W weight-gradient backward."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the letter is the notation
    W = "W"


_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One compute action of a device: run `kind` of `stage` on `microbatch`."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> "Action":
        """Parse `3F12`; raises ValueError naming the text when it does not parse."""
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"action {text!r} does not parse: expected <stage><F|B|I|W><microbatch>, e.g. '3F12'")
        return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


def F(stage: int, mb: int) -> Action:
    """Shorthand for a forward action."""
    return Action(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:
    """Shorthand for a fused backward action."""
    return Action(stage, Kind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E741, E743
    """Shorthand for an input-gradient backward action."""
    return Action(stage, Kind.I, mb)


def W(stage: int, mb: int) -> Action:
    """Shorthand for a weight-gradient backward action."""
    return Action(stage, Kind.W, mb)


def format_schedule(schedule) -> list[list[str]]:
    """Per-device action lists as strings (the plan file's `schedule`)."""
    return [[str(a) for a in dev] for dev in schedule]


def parse_schedule(rows) -> tuple[tuple[Action, ...], ...]:
    """Per-device lists of action strings to a tuple of Action tuples."""
    return tuple(tuple(Action.parse(a) for a in dev) for dev in rows)


def render_grid(schedule, mark: dict[int, int] | None = None, width: int | None = None) -> str:
    """Draw per-device action lists as a text grid; `mark[d] = i` brackets action i of device d."""
    mark = mark or {}
    cells = [[str(a) for a in dev] for dev in schedule]
    for d, i in mark.items():
        if 0 <= i < len(cells[d]):
            cells[d][i] = f"[{cells[d][i]}]"
    w = max([len(c) for row in cells for c in row] + [3])
    lines = []
    for d, row in enumerate(cells):
        shown = row if width is None else row[:width]
        more = "" if width is None or len(row) <= width else f" ... (+{len(row) - width})"
        lines.append(f"dev{d:<3}| " + " ".join(c.rjust(w) for c in shown) + more)
    return "\n".join(lines)
