"""The one check of stage layer ranges: consecutive, from layer 0, never reversed, ending at the model's end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class RangeProblem:
    """The first bad stage range: which stage, which end (0 start, 1 end), what was expected and found."""

    stage: int
    index: int
    expected: str
    got: int
    message: str

    @property
    def path(self) -> str:
        """Where the value sits in a plan document, e.g. `$.stages[2].layers[0]`."""
        return f"$.stages[{self.stage}].layers[{self.index}]"


def stage_range_problem(ranges: Sequence[tuple[int, int]], num_layers: int | None = None) -> RangeProblem | None:
    """The first problem of half-open `(start, end)` ranges in stage order, or None when they tile the layers.

    Ranges must start at 0, each start where the previous ended, never end before they start,
    and (when `num_layers` is given) end at the model's layer count. Empty ranges are allowed.
    """
    prev_end = 0
    for s, (start, end) in enumerate(ranges):
        if s == 0 and start != 0:
            return RangeProblem(stage=0, index=0, got=start,
                                expected="0 (stages must cover the layers from the first)",
                                message=f"stage 0 starts at layer {start}: stages must cover the layers from 0")
        if start != prev_end:
            return RangeProblem(stage=s, index=0, got=start,
                                expected=f"{prev_end} (the end of stage {s - 1}: ranges are consecutive)",
                                message=f"stage {s} starts at layer {start}, stage {s - 1} ends at {prev_end}: "
                                        f"stage ranges must be consecutive")
        if end < start:
            return RangeProblem(stage=s, index=1, got=end, expected=f">= {start} (the stage's start)",
                                message=f"stage {s} ends at layer {end} before it starts at {start}: "
                                        f"expected end >= start")
        prev_end = end
    if not ranges:
        return RangeProblem(stage=0, index=0, got=0, expected="at least one stage",
                            message="a plan needs at least one stage")
    if num_layers is not None and prev_end != num_layers:
        last = len(ranges) - 1
        return RangeProblem(stage=last, index=1, got=prev_end, expected=f"{num_layers} (the model's layer count)",
                            message=f"stages cover layers [0, {prev_end}) but the model has {num_layers}")
    return None
