"""Schedules kept as integer arrays: one (stage, kind code, micro-batch) row per action, per device.

Long candidate schedules (the compiled list scheduler's, periodically grown ones) stay in this
form; the simulator reads it directly and a row becomes Action objects only when something
reads it as actions (writing, drawing, polishing the plan that is kept). Kind codes are the
simulator's: F 0, B 1, I 2, W 3.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..actions import CODE as _CODE, KINDS, Action


def encode(row) -> np.ndarray:
    """A device's actions as an (n, 3) int64 array of stage, kind code and micro-batch."""
    code = _CODE
    flat = [x for a in row for x in (a.stage, code[a.kind], a.microbatch)]
    return np.asarray(flat, dtype=np.int32).reshape(-1, 3)


class ActionTable:
    """One shared Action per (stage, kind, micro-batch), so long schedules hold pointers, not objects."""

    def __init__(self):
        self._cache: dict[tuple[int, int, int], Action] = {}

    def row(self, enc: np.ndarray) -> tuple[Action, ...]:
        """The Actions of an encoded row."""
        cache, out = self._cache, []
        for s, k, mb in enc.tolist():
            key = (s, k, mb)
            a = cache.get(key)
            if a is None:
                a = cache[key] = Action(s, KINDS[k], mb)
            out.append(a)
        return tuple(out)


class EncodedSchedule(Sequence):
    """Per-device rows kept as (stage, kind, micro-batch) arrays; a row becomes Actions only when read.

    The simulator reads `encoded` directly, so a long candidate is judged without an Action
    object per action; only the plan that is kept (written, drawn, polished) is materialised.
    """

    __slots__ = ("encoded", "_table", "_rows", "clock", "pairs")

    def __init__(self, encoded, table: ActionTable | None = None):
        self.encoded = tuple(encoded)
        self.pairs: tuple = ()  # overlapped pairs a pairing policy made (tuner/listsched.py), adjacent in their rows
        # (step ms, per-device peak live activation bytes) when the list scheduler timed this order itself
        self.clock: tuple[float, tuple[int, ...]] | None = None
        self._table = table or ActionTable()
        self._rows: list = [None] * len(self.encoded)

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, d):
        if isinstance(d, slice):
            return tuple(self[i] for i in range(*d.indices(len(self))))
        row = self._rows[d]
        if row is None:
            row = self._rows[d] = self._table.row(self.encoded[d])
        return row

    def __eq__(self, other) -> bool:
        if isinstance(other, EncodedSchedule):
            return len(self) == len(other) and all(
                a.shape == b.shape and bool((a == b).all()) for a, b in zip(self.encoded, other.encoded))
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"EncodedSchedule({[len(e) for e in self.encoded]} actions per device)"


def action_count(schedule) -> int:
    """Number of actions in a schedule, without materialising an encoded one."""
    enc = getattr(schedule, "encoded", None)
    if enc is not None:
        return sum(len(e) for e in enc)
    return sum(len(row) for row in schedule)
