"""Lower bounds on the step time, to judge how far a plan is from optimal and to prune layouts."""

from __future__ import annotations

from dataclasses import dataclass


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
    Layers in `fluid` (split over devices) add to the total work only.
    """
    best = sum(layer.total_ms for layer in model.layers) / num_devices
    totals = sorted((layer.total_ms for i, layer in enumerate(model.layers) if i not in fluid), reverse=True)
    for n_t in range(1, len(totals) + 1):
        k = -(-n_t // num_devices)
        best = max(best, sum(totals[n_t - k:n_t]))
    return num_microbatches * best


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
