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

from dataclasses import replace

import numpy as np

from .encoded import ActionTable, EncodedSchedule, encode
from .listsched import Policy


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
