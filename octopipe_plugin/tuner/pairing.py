"""The pairing move: which F and B (or I) run as overlapped pairs on each device.

Pairs only pay where a layer communicates on its own link (`simulator.pairs.communicates`: an
expert-parallel all-to-all); for every other model the tuner never pairs, so its plans stay as
they were. Where they can pay, the seeds' pool is judged again before the search and the search's
pool after it, with the list scheduler pairing (tuner/listsched.py `Pairing`) or, an explicit order,
with each F that its device runs right before a B or I of another micro-batch paired with it
(`adjacent_pairs`), the faster kept (tuner/search.py `_pair_elite`); from then on explicit orders
are judged both ways (the evaluator's `pair_orders`), and the polish takes single pairs out or
pulls an F and a B together where the simulator says it is faster (`pair_step`). A split head's shards
are placed into the plan without its pairs, pairing as they go (`pair_with`, tuner/split_sched.py). A pair waits for
both halves' inputs, so pairing is not free: a pair can hold back its F's output and with it the
next stage; the simulator decides every time.
"""

from __future__ import annotations

from dataclasses import replace

from ..actions import RULES, Kind, pair_problem


def adjacent_pairs(schedule) -> tuple:
    """Every F right before a B/I of another micro-batch on its device, paired (left to right, each action once)."""
    out = []
    for row in schedule:
        i, n = 0, len(row)
        while i < n - 1:
            a, b = row[i], row[i + 1]
            # the kind test first: it is what fails almost always, and pair_problem writes its refusal
            if b.kind in RULES[a.kind].pairs_with and pair_problem(a, b) is None:
                out.append((a, b))
                i += 2
            else:
                i += 1
    return tuple(sorted(out))


def insertion_bases(plan, pairing: bool) -> tuple:
    """(base, pair) of each way the shard inserter (tuner/split_sched.py) is run on `plan`: where pairs pay
    (`pairing`), without its pairs and pairing as it places, with the timing the shards give (a pair made on the
    plan without the shards waits on the head's latency: the owner's F(k+1)+B(k) holds the next micro-batch's
    head behind this one's), and without pairs at all; else as it is and, with pairs, without them."""
    if pairing:  # pairs kept as units lost to both on the zoo's MoE models (deepseek-v3-mini: 481 vs 388 / 376 ms)
        return (unpaired(plan), True), (unpaired(plan), False)
    return ((plan, False), (unpaired(plan), False)) if plan.pairs else ((plan, False),)


def unpaired(plan):
    """The plan without pairs (for moves that reorder actions and would split a pair)."""
    return replace(plan, pairs=()) if plan.pairs else plan


def with_adjacent_pairs(plan):
    """The plan with `adjacent_pairs` of its order (itself when there are none)."""
    pairs = adjacent_pairs(plan.schedule)
    return replace(plan, pairs=pairs) if pairs and pairs != plan.pairs else plan


def pair_step(ev, rng, best):
    """One pairing move on the plan in hand: drop one pair, or pull a B/I two places ahead to pair it with the F
    before it; the better outcome (judged without the evaluator's own pairing), or None."""
    plan = best.plan
    if plan.pairs and rng.random() < 0.5:
        drop = rng.choice(plan.pairs)
        cand = replace(plan, pairs=tuple(p for p in plan.pairs if p != drop))
    else:
        cand = _pulled(plan, rng)
        if cand is None:
            return None
    out = ev.simulated(cand, pair=False)
    if out is not None and out.fits and out.step_ms < best.step_ms - 1e-9:
        return out
    return None


def _pulled(plan, rng):
    """The plan with one F at i and a B/I of another micro-batch at i + 2 made a pair at i, i + 1 (None: no spot)."""
    paired = {a for p in plan.pairs for a in p}
    spots = []
    for d, row in enumerate(plan.schedule):
        for i in range(len(row) - 2):
            a, b = row[i], row[i + 2]
            if a in paired or b in paired or row[i + 1] in paired:
                continue
            if b.kind in RULES[a.kind].pairs_with and pair_problem(a, b) is None:
                spots.append((d, i))
    if not spots:
        return None
    d, i = rng.choice(spots)
    row = list(plan.schedule[d])
    row.insert(i + 1, row.pop(i + 2))
    schedule = tuple(tuple(row) if k == d else r for k, r in enumerate(plan.schedule))
    return replace(plan, schedule=schedule, pairs=tuple(sorted(plan.pairs + ((row[i], row[i + 1]),))))


def pair_with(hidden: dict, chosen, start: float, options):
    """The pair a device about to run stage action `chosen` (F, B or I) at `start` makes with one of `options`
    ((ready time, action, key) of the other actions it could run, inputs known): the partner of the other side
    whose wait past `start` is shorter than what the pair hides (`hidden`: layout.pair_savings), the most saved
    net of the wait first; (pair start, first half, second half, partner key) or None.

    The rule the list scheduler's Pairing.WAIT follows, for a scheduler that places work around a fixed order
    (the shard inserter, tuner/split_sched.py): pairs are chosen with the timing the order really runs at."""
    best = None
    for ready, other, key in options:
        first, second = (chosen, other) if chosen.kind is Kind.F else (other, chosen)
        # the kind test first: it is what fails almost always, and pair_problem writes its refusal
        if second.kind not in RULES[first.kind].pairs_with or pair_problem(first, second) is not None:
            continue
        gain = hidden.get((second.kind, first.stage, second.stage), 0.0) - max(0.0, ready - start)
        if gain > 0.0 and (best is None or gain > best[0]):
            best = (gain, max(start, ready), first, second, key)
    return None if best is None else best[1:]
