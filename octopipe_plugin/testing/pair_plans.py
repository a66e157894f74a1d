"""Plans with overlapped pairs for tests: pair adjacent actions, or move a backward next to a forward to pair them.

A pair (docs/formats.md, "Overlapped pairs") is an F followed on its device by a B or I of
another micro-batch (the kind table's `pairs_with`, `actions.pair_problem`). Pairing can make a
deadlock-free plan hang (the pair waits for both inputs before either half starts), which the
simulator refuses by name (DeadlockError): `greedy_pairs` keeps only pairs the simulator accepts,
`random_pairs` and `move_pairs` leave that to the caller.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ..actions import pair_problem
from ..errors import DeadlockError
from ..executor.validate import check_runnable


def pair_candidates(plan, used=frozenset()) -> list[tuple[int, int]]:
    """(device, position) of every adjacent (F, B/I of another micro-batch) neither of whose actions is in `used`."""
    out = []
    for d, row in enumerate(plan.schedule):
        for i in range(len(row) - 1):
            a, b = row[i], row[i + 1]
            if a not in used and b not in used and pair_problem(a, b) is None:
                out.append((d, i))
    return out


def _used(pairs) -> set:
    return {a for p in pairs for a in p}


def random_pairs(plan, rng: random.Random, prob: float = 0.5):
    """`plan` with each adjacent candidate (left to right) paired with probability `prob` (no deadlock check)."""
    pairs = list(plan.pairs)
    used = _used(pairs)
    for d, i in pair_candidates(plan, used):
        row = plan.schedule[d]
        if row[i] in used or row[i + 1] in used or rng.random() >= prob:
            continue
        pairs.append((row[i], row[i + 1]))
        used |= {row[i], row[i + 1]}
    return replace(plan, pairs=tuple(sorted(pairs)))


def move_pairs(plan, rng: random.Random, count: int = 1):
    """`plan` with `count` times a B or I moved from later in its device's list to right after an F of another
    micro-batch, the two paired (the order may no longer be runnable: the caller checks)."""
    rows = [list(r) for r in plan.schedule]
    pairs = list(plan.pairs)
    for _ in range(count):
        used = _used(pairs)
        options = [(d, i, j) for d, row in enumerate(rows) for i, a in enumerate(row) if a not in used
                   for j in range(i + 2, len(row)) if row[j] not in used and pair_problem(a, row[j]) is None]
        # (neither end is paired already, so no existing pair's halves are parted)
        if not options:
            break
        d, i, j = options[rng.randrange(len(options))]
        b = rows[d].pop(j)
        rows[d].insert(i + 1, b)
        pairs.append((rows[d][i], b))
    return replace(plan, schedule=tuple(tuple(r) for r in rows), pairs=tuple(sorted(pairs)))


def greedy_pairs(plan, limit: int | None = None, rng: random.Random | None = None):
    """`plan` with adjacent candidates paired one at a time (in order, or shuffled by `rng`), each kept only when
    the plan stays runnable (executor.validate.check_runnable); at most `limit` new pairs."""
    out = plan
    cands = pair_candidates(plan, _used(plan.pairs))
    if rng is not None:
        rng.shuffle(cands)
    added = 0
    for d, i in cands:
        if limit is not None and added >= limit:
            break
        row = out.schedule[d]
        used = _used(out.pairs)
        if row[i] in used or row[i + 1] in used:
            continue
        trial = replace(out, pairs=tuple(sorted(out.pairs + ((row[i], row[i + 1]),))))
        try:
            check_runnable(trial)
        except DeadlockError:
            continue
        out, added = trial, added + 1
    return out
