"""Periodic steady state: grow a schedule built for few micro-batches to many by repeating its steady state.

Between warm-up and cool-down, a pipeline schedule repeats: on every device, the action L
places later is the same action q micro-batches later (L = q times the device's actions per
micro-batch). `extend_schedule` finds, on each device, the longest stretch where that holds,
inserts as many further periods as the larger count needs and shifts the cool-down behind
them; warm-up stays as it was. Every device must show the same period q, and each new row
must hold every one of its (stage, kind) pairs exactly once per micro-batch, else None. The
result is only a candidate order: the caller simulates it (deadlock, step time, memory).

Rows are handled as integer arrays (stage, kind code, micro-batch), never as Action objects,
until the final rows are built from one shared Action per (stage, kind, micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..actions import CODE, KINDS, Action
from .listsched import Policy


def encode(row) -> np.ndarray:
    """A device's actions as an (n, 3) int64 array of stage, kind code and micro-batch."""
    code = CODE
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

    __slots__ = ("encoded", "_table", "_rows")

    def __init__(self, encoded, table: ActionTable | None = None):
        self.encoded = tuple(encoded)
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


def periodic_end(enc: np.ndarray, q: int, length: int) -> int | None:
    """Where the last full period of the longest periodic stretch ends (its cool-down starts), or None.

    Periodic at j means row[j + length] is row[j] with the micro-batch raised by q; the
    stretch must cover at least two periods for the repeat to be observed, not assumed.
    """
    n = len(enc)
    if length <= 0 or n < 2 * length:
        return None
    a, b = enc[length:], enc[:-length]
    ok = (a[:, 0] == b[:, 0]) & (a[:, 1] == b[:, 1]) & (a[:, 2] == b[:, 2] + q)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], ok.view(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]
    if not len(starts):
        return None
    runs = ends - starts
    best = int(np.flatnonzero(runs == runs.max())[-1])  # the latest of the longest: nearest the cool-down
    if runs[best] < length:
        return None
    return int(ends[best]) + length


def extend_row(enc: np.ndarray, end: int, length: int, q: int, extra: int) -> np.ndarray:
    """The row with `extra` more periods (each `length` actions, q micro-batches) inserted at `end`."""
    if extra == 0:
        return enc
    period = enc[end - length:end]
    shift = np.zeros((extra, 1, 3), dtype=enc.dtype)
    shift[:, 0, 2] = q * np.arange(1, extra + 1)
    blocks = (period[None, :, :] + shift).reshape(-1, 3)
    tail = enc[end:].copy()
    tail[:, 2] += q * extra
    return np.concatenate((enc[:end], blocks, tail))


def complete(enc: np.ndarray, pairs: np.ndarray, m: int) -> bool:
    """Whether the row runs each of its (stage, kind) pairs exactly once for every micro-batch 0..m-1."""
    if len(enc) != len(pairs) * m:
        return False
    mb = enc[:, 2]
    if len(enc) and (mb.min() < 0 or mb.max() >= m):
        return False
    key = (enc[:, 0] * 4 + enc[:, 1]) * m + mb
    pair_key = np.unique(pairs[:, 0] * 4 + pairs[:, 1])
    if not np.isin(enc[:, 0] * 4 + enc[:, 1], pair_key).all():
        return False
    return len(np.unique(key)) == len(enc)


def candidate_periods(m: int, target_m: int) -> list[int]:
    """Periods q worth trying: q divides the added micro-batches and fits three times in the short count."""
    gap = target_m - m
    return [q for q in range(1, max(1, m // 3) + 1) if gap % q == 0]


def extend_schedule(schedule, m: int, target_m: int, table: ActionTable | None = None):
    """Per-device rows for `target_m` micro-batches grown from `schedule` (built for m), or None if not periodic."""
    if target_m == m:
        return schedule
    if target_m < m:
        return None
    enc = getattr(schedule, "encoded", None) or [encode(row) for row in schedule]
    per_mb = []
    for e in enc:
        if len(e) % m:
            return None
        per_mb.append(len(e) // m)
    pairs = [np.unique(e[:, :2], axis=0) if len(e) else np.zeros((0, 2), np.int64) for e in enc]
    for q in candidate_periods(m, target_m):
        extra = (target_m - m) // q
        rows = []
        for e, k, pr in zip(enc, per_mb, pairs):
            if k == 0:
                rows.append(e)
                continue
            end = periodic_end(e, q, k * q)
            if end is None:
                break
            new = extend_row(e, end, k * q, q, extra)
            if not complete(new, pr, target_m):
                break
            rows.append(new)
        else:
            return EncodedSchedule(rows, table)
    return None


def scale_policy(policy: Policy, m: int, target_m: int) -> Policy:
    """The policy for target_m micro-batches: limits that meant 'all m' (depth, deferred W) grow with the count."""
    if target_m == m:
        return policy
    depth = tuple(target_m if d >= m else d for d in policy.depth)
    w_limit = tuple(w * target_m // m if w >= m else w for w in policy.w_limit)
    return replace(policy, depth=depth, w_limit=w_limit)
