"""Evened layouts: stage boundaries whose busiest device holds the least of the layers that stay whole.

With the LM head split, its shards fill whatever room the devices leave (tuner/split.py `_balance`),
so the boundaries of the rest should first bring its busiest device down. Whole layers of unequal
size can hide that from one-layer moves: a vision encoder's small layers in one stage, followed by
decoder layers one per stage, leave one device with a decoder layer more than the others, and
evening that out takes a chain of moves that each first raise some device's load (the vision layers
spread over several devices, so that every device holds as many decoder layers). `evened_layout`
walks one-layer cut moves, each step the best move to boundaries it has not passed yet (so it goes
on through worse ones instead of cycling), and keeps the best boundaries it passes: a heuristic
(on small chains checked against every boundary choice it lands within a few percent of the optimum,
and the simulator judges what it gives); `evened_plans` list-schedules that layout afresh,
since the tuned orders were made for the old stage sizes.

Measured on vlm (ViT-L encoder + Llama-3-8B, h100x8, M = 16, 30 s): the tuned layout's busiest
device held 46.5 ms of the rest per micro-batch against a mean of 38.7, the evened one 41.3 with the
encoder over three devices: 752.6 -> 699.6 ms.
"""

from __future__ import annotations

from .evaluate import Evaluator
from .layout import Layout
from .seeds import seeded_plans

EVEN_STEPS = 400  # cut moves of the walk (vlm, 8 devices x 4 stages: better boundaries from step 150, its best by 300)
KEEP = 2  # list-scheduled orders of the evened layout taken on to the shard insertion, fastest first


def evened_layout(costs, layout: Layout) -> Layout | None:
    """`layout` (same devices and stage order, no stage left empty) with the least load on its busiest device
    for layer costs `costs` (ms per micro-batch), ties towards even loads; None where it finds no lower one."""
    n, ns = len(costs), layout.num_stages
    bounds = [a for a, _ in layout.bounds] + [layout.bounds[-1][1]]
    dev = list(layout.devices)
    loads = [0.0] * (max(dev) + 1)
    for s, d in enumerate(dev):
        loads[d] += sum(costs[bounds[s]:bounds[s + 1]])
    cuts = [c for c in range(1, ns) if dev[c - 1] != dev[c]]
    if not cuts or bounds[-1] != n:
        return None

    def key(lds):
        return round(max(lds), 9), round(sum(x * x for x in lds), 6)

    start = best_key = key(loads)
    best_bounds = list(bounds)
    seen = {tuple(bounds)}  # boundaries passed: never again, so the walk does not cycle
    for step in range(EVEN_STEPS):
        top = sorted(range(len(loads)), key=loads.__getitem__, reverse=True)[:3]
        total_sq = sum(x * x for x in loads)
        choice = None
        for c in cuts:
            a, b = dev[c - 1], dev[c]
            for delta in (-1, 1):
                cut = bounds[c] + delta
                if not bounds[c - 1] < cut < bounds[c + 1]:
                    continue
                # -1: stage c-1 (device a) gives its last layer to stage c (device b); +1 the other way round
                moved = costs[cut] if delta < 0 else -costs[bounds[c]]
                la, lb = loads[a] - moved, loads[b] + moved
                others = next((loads[d] for d in top if d not in (a, b)), 0.0)
                k = (round(max(la, lb, others), 9),
                     round(total_sq - loads[a] ** 2 - loads[b] ** 2 + la * la + lb * lb, 6))
                if choice is not None and k >= choice[0]:
                    continue
                bounds[c] = cut
                fresh = tuple(bounds) not in seen
                bounds[c] = cut - delta
                if fresh:
                    choice = (k, c, delta, la, lb)
        if choice is None:
            break
        k, c, delta, la, lb = choice
        loads[dev[c - 1]], loads[dev[c]] = la, lb
        bounds[c] += delta
        seen.add(tuple(bounds))
        if k < best_key:
            best_key, best_bounds = k, list(bounds)
    if best_key[0] >= start[0] - 1e-9:
        return None
    return Layout(bounds=tuple(zip(best_bounds, best_bounds[1:])), devices=layout.devices)


def evened_plans(model, cluster, num_microbatches: int, plan, costs, options=None, constraints=None) -> list:
    """Plans of `plan`'s evened layout (for layer costs `costs`: the head's work left to its shards) on `model`,
    fitting `cluster` and keeping to `constraints`, list-scheduled under the seed policies, the KEEP fastest
    first; none where evening lowers no load."""
    lay = evened_layout(costs, Layout.of_stages(plan.stages))
    if lay is None:
        return []
    ev = Evaluator(model, cluster, num_microbatches, options=options)
    if not ev.static_fits(lay):
        return []
    return seeded_plans(ev, lay, cluster.num_devices, num_microbatches, constraints, keep=KEEP)
