"""Lower bounds on the step time, to judge how far a plan is from optimal and to prune layouts."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import product
from math import prod

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class Bound:
    """The issue's lower bound and its two terms."""

    value_ms: float
    work_ms: float  # M * sum over layers of (f + i + w) / D: perfect balance, no bubble
    layer_ms: float  # M * the heaviest layer's (f + i + w): a layer cannot be split

    def describe(self) -> str:
        """Which term binds."""
        which = "total work / devices" if self.work_ms >= self.layer_ms else "heaviest layer"
        return f"LB {self.value_ms:.2f} ms ({which})"


def lower_bound(model, num_devices: int, num_microbatches: int, fluid=()) -> Bound:
    """LB = max(M * sum(f+i+w) / D, M * max layer (f+i+w)); no plan on D devices can be faster.

    Layers in `fluid` (split layers, divided over devices) count in the work but not as a heaviest layer.
    """
    totals = [layer.total_ms for layer in model.layers]
    work = num_microbatches * sum(totals) / num_devices
    heavy = num_microbatches * max((t for i, t in enumerate(totals) if i not in fluid), default=0.0)
    return Bound(value_ms=max(work, heavy), work_ms=work, layer_ms=heavy)


def packing_bound(model, num_devices: int, num_microbatches: int, fluid=()) -> float:
    """A floor from layer granularity: every plan puts each whole layer on one device.

    For any size threshold t, the n_t layers costing at least t land on D devices, so one
    device holds ceil(n_t / D) of them and runs at least the cheapest ceil(n_t / D) of
    them for every micro-batch. The best threshold gives the bound (>= the issue's LB terms).
    Layers in `fluid` (split over devices) add to the total work only. Where the whole layers have
    few distinct costs (a model of a few layer kinds), the least fullest device of any assignment of
    them to D devices (`whole_layer_makespan`) is taken too: it sees what the thresholds miss, such as
    52 layers of three kinds on 32 devices, where 20 devices hold two and no two fit a device's share.
    """
    best = sum(layer.total_ms for layer in model.layers) / num_devices
    totals = sorted((layer.total_ms for i, layer in enumerate(model.layers) if i not in fluid), reverse=True)
    for n_t in range(1, len(totals) + 1):
        k = -(-n_t // num_devices)
        best = max(best, sum(totals[n_t - k:n_t]))
    exact = whole_layer_makespan(totals, num_devices, at_least=best)
    return num_microbatches * max(best, exact or 0.0)


EXACT_STATES = 4096  # count vectors the exact packing visits at most; more distinct costs keep the threshold bound
# (state, full-device vector) pairs one load check may visit (vectorised: tens of ms); past it the threshold
# bound stands
EXACT_WORK = 2_000_000


def whole_layer_makespan(totals, num_devices: int, at_least: float = 0.0) -> float | None:
    """The least load of the fullest device over every assignment of whole layers (per micro-batch costs
    `totals`) to `num_devices` devices, any placement; None where the distinct costs are too many to search.

    Layers of equal cost are one kind, so an assignment is a count vector per device; a binary search over
    the loads a device can have, each checked by the fewest devices that hold every layer under that load
    (`at_least`: a bound already known; loads below the last one under it are not checked, so a
    result below `at_least` only says the answer is at most that)."""
    least: dict[float, float] = {}  # costs equal to 9 decimals are one kind, priced at its cheapest member's
    number: Counter = Counter()
    for t in totals:
        key = round(t, 9)
        least[key] = min(t, least.get(key, t))
        number[key] += 1
    kinds = sorted(number.items(), reverse=True)
    if not kinds or prod(c + 1 for _, c in kinds) > EXACT_STATES:
        return None
    sizes = np.array([least[s] for s, _ in kinds])  # never above a real cost: the result stays a lower bound
    counts = np.array([c for _, c in kinds])
    vectors = np.array(list(product(*(range(c + 1) for c in counts))), dtype=np.int64).reshape(-1, len(kinds))
    strides = np.array([prod(int(c) + 1 for c in counts[i + 1:]) for i in range(len(kinds))], dtype=np.int64)
    load = vectors @ sizes  # a vector's index in `vectors` is its code, vectors @ strides
    loads = sorted(set(load[1:].tolist()))
    sums = vectors.sum(axis=1)
    levels = [np.nonzero(sums == k)[0] for k in range(1, int(sums[-1]) + 1)]  # a state's remainders hold fewer

    def fits(cap: float) -> bool:
        # what one device can hold under `cap` with no room for another layer (fewer never need more devices)
        room = (vectors == counts) | (load[:, None] + sizes[None, :] > cap + 1e-9)
        full = vectors[(load <= cap + 1e-9) & room.all(axis=1) & (sums > 0)]
        if len(full) == 0:
            return False  # a layer above cap
        if len(full) * len(vectors) > EXACT_WORK:
            raise _TooLarge
        need = np.full(len(vectors), np.inf)  # fewest devices holding every layer of a state
        need[0] = 0.0
        for idx in levels:  # every state of one layer count at once: their remainders are all known
            rest = np.maximum(vectors[idx][:, None, :] - full[None, :, :], 0) @ strides
            got = need[rest]
            got[rest == idx[:, None]] = np.inf  # a device vector sharing no layer with the state takes none
            need[idx] = 1.0 + got.min(axis=1)
        return need[-1] <= num_devices

    # the answer is at least the last load not above `at_least`; loads[-1] (all on one device) always fits
    lo, hi = max(0, bisect_right(loads, at_least + 1e-9) - 1), len(loads) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            ok = fits(loads[mid])
        except _TooLarge:
            return None
        if ok:
            hi = mid
        else:
            lo = mid + 1
    return loads[lo]


class _TooLarge(Exception):
    """A load check would pass EXACT_WORK."""


def fill_bound(model, num_microbatches: int, fluid=()) -> float:
    """A floor from pipeline fill and drain around each layer (transfers counted as free).

    Layer l's device cannot start l's first forward before every earlier layer has run
    micro-batch 0 forward (sum of their F), and after l's last input-gradient the gradient still
    crosses every earlier layer (sum of their I). The device runs F and I of l for all M
    micro-batches in between, and all of f+i+w after the fill. Layers in `fluid` (split over
    devices) hold no device for all M micro-batches: they only lengthen the fill and drain.
    """
    best, f_before, i_before = 0.0, 0.0, 0.0
    m = num_microbatches
    for i, layer in enumerate(model.layers):
        if i not in fluid:
            best = max(best, f_before + m * layer.total_ms,
                       f_before + m * (layer.fwd_ms + layer.bwd_ms) + i_before)
        f_before += layer.fwd_ms
        i_before += layer.bwd_ms
    return best


def refined_bound(model, num_devices: int, num_microbatches: int) -> float:
    """The best of the issue's LB, the packing bound and the fill bound: used to explain gaps."""
    return max(packing_bound(model, num_devices, num_microbatches), fill_bound(model, num_microbatches))
