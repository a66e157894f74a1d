"""Rising layouts: the stages that communicate most placed where overlapped pairs hide their communication.

In a pipeline's warm-up a stage runs the forwards of the micro-batches in flight before any of
their backwards comes back, so it has no backward to pair its forwards with; the late stages run
the steady state, where each forward meets a backward of an earlier micro-batch, and pair (a pair
hides one half's all-to-all behind the other half's compute, simulator/pairs.py). A partition
balanced on time (all-to-all included) puts its larger stages first, where they pair least. The
rising layout keeps the tuned plan's stage sizes (layers per stage) and devices and hands the sizes
of its inner stages out in ascending order along the pipeline (the first stage, with the embedding,
and the last, with the head, keep theirs), so the stages with more MoE layers sit where pairs form;
its orders are list-scheduled afresh with pairing, since the tuned orders were made for the old
sizes. Only for models that communicate (`communicates`): elsewhere no pair hides anything.

Measured on deepseek-v3-mini at EP 8 on h100x16 (M = 32, the head and embedding split after it):
the split plan from the tuned layout 378.1 ms in a node and 531.0 ms over 2 nodes, from its rising
layout 360.1 and 515.1 ms (benchmarks/moe_overlap.py).
"""

from __future__ import annotations

from .evaluate import Evaluator
from .layout import Layout
from .listsched import Pairing
from .seeds import seeded_plans

KEEP = 2  # list-scheduled orders of the rising layout taken on to the shard insertion, fastest first


def rising_layout(plan) -> Layout | None:
    """`plan`'s layout with its inner stages' layer counts in ascending order; None where that changes nothing."""
    sizes = [st.end - st.start for st in plan.stages]
    if len(sizes) < 4:
        return None
    inner = sorted(sizes[1:-1])
    if inner == sizes[1:-1]:
        return None
    bounds, start = [], 0
    for n in [sizes[0]] + inner + [sizes[-1]]:
        bounds.append((start, start + n))
        start += n
    return Layout(bounds=tuple(bounds), devices=tuple(st.device for st in plan.stages))


def rising_plans(model, cluster, num_microbatches: int, plan, options=None, constraints=None) -> list:
    """Plans of `plan`'s rising layout on `model` (fitting `cluster`, keeping to `constraints`), list-scheduled
    under the seed policies with pairing, the KEEP fastest first; none where pairs hide nothing or the layout
    would not change."""
    lay = rising_layout(plan)
    if lay is None:
        return []
    ev = Evaluator(model, cluster, num_microbatches, options=options)
    if not ev.pairing or not ev.static_fits(lay):
        return []
    return seeded_plans(ev, lay, cluster.num_devices, num_microbatches, constraints,
                        pairings=(Pairing.READY, Pairing.WAIT), keep=KEEP)
