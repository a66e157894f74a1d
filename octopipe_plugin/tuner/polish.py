"""Order moves on an explicit plan: pull critical-path actions earlier in their device's list.

After the policy search, the last slack sits where one device's own order delays an action
on the critical path. Moving that action ahead of its predecessor (for instance past a
deferred W, or a forward that could wait) shortens the path when the inputs allow; the
simulator decides, and plans that deadlock or overflow memory are dropped.
"""

from __future__ import annotations

from dataclasses import replace

from ..simulator import simulate
from .evaluate import Evaluator, Outcome


def critical_slots(ev: Evaluator, plan) -> list[tuple[int, int]]:
    """(device, position) of critical-path actions that their device's previous action held back."""
    res = simulate(ev.model, ev.cluster, plan, ev.options, detail=True)
    ev.work += 3 * sum(len(r) for r in plan.schedule)
    pos = {a: (d, i) for d, row in enumerate(plan.schedule) for i, a in enumerate(row)}
    out = []
    for d, a in res.critical_path:
        dd, i = pos[a]
        if i > 0:
            out.append((dd, i))
    return out


def move_earlier(plan, device: int, index: int, by: int):
    """The plan with action `index` of `device` moved `by` places earlier, without pairs (a move may split one; the
    evaluator pairs the new order again where pairs pay)."""
    row = list(plan.schedule[device])
    j = max(0, index - by)
    row.insert(j, row.pop(index))
    schedule = tuple(tuple(row) if d == device else r for d, r in enumerate(plan.schedule))
    return replace(plan, schedule=schedule, pairs=())


def polish_step(ev: Evaluator, rng, best: Outcome, slots: list[tuple[int, int]]) -> Outcome | None:
    """Try one order move on a random critical slot; the better plan, or None."""
    if not slots:
        return None
    d, i = rng.choice(slots)
    cand = move_earlier(best.plan, d, i, rng.choice((1, 1, 2, 3)))
    out = ev.simulated(cand)
    if out is not None and out.fits and out.step_ms < best.step_ms - 1e-9:
        return out
    return None
