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

from ..actions import Action, pair_problem
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
        # neither end paired already (no pair's halves are parted), and the moved action stays after the action of
        # its own stage and micro-batch it waits for (the kind table's `after`: a B's F)
        options = [(d, i, j) for d, row in enumerate(rows) for i, a in enumerate(row) if a not in used
                   for j in range(i + 2, len(row)) if row[j] not in used and pair_problem(a, row[j]) is None
                   and _after_stays_before(row, j, i + 1)]
        if not options:
            break
        d, i, j = options[rng.randrange(len(options))]
        b = rows[d].pop(j)
        rows[d].insert(i + 1, b)
        pairs.append((rows[d][i], b))
    return replace(plan, schedule=tuple(tuple(r) for r in rows), pairs=tuple(sorted(pairs)))


def _after_stays_before(row, j: int, at: int) -> bool:
    """Whether moving row[j] to position `at` keeps it after its `after` action (when that is on this device)."""
    a = row[j]
    after = a.rule.after
    if after is None:
        return True
    need = Action(a.stage, after, a.microbatch)
    return need not in row[at:j]


def phased_model(num_layers: int, name: str = "moe-toy"):
    """A model of MoE layers whose dispatch and combine all-to-alls are half of each F and a third of each I
    (formats.model.Phase): what pairs can hide."""
    from ..formats import Layer, Model
    from ..formats.model import Phase

    def layer(i: int) -> Layer:
        phases = (Phase(name="attention", resource="compute", fwd_ms=1.0, bwd_ms=2.0),
                  Phase(name="dispatch", resource="comm", fwd_ms=1.0, bwd_ms=1.0),
                  Phase(name="experts", resource="compute", fwd_ms=1.0, bwd_ms=2.0),
                  Phase(name="combine", resource="comm", fwd_ms=1.0, bwd_ms=1.0))
        return Layer(name=f"moe{i}", kind="moe", fwd_ms=4.0, bwd_ms=6.0, wgrad_ms=2.0, state_bytes=1 << 20,
                     activation_bytes=1 << 20, output_bytes=1 << 16, phases=phases)

    return Model(name=name, layers=tuple(layer(i) for i in range(num_layers)))


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
