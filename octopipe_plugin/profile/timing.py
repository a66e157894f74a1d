"""Timing one call on the device: wall clock on CPU, CUDA events on GPU; medians and spreads of samples."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


# Which figure of a phase's samples a profile charges. "median" (the default) is the typical call; "p25", the
# lower quartile, is for a shared machine: other processes and the hypervisor only ever add time to a sample, so
# the low quantile of interleaved samples estimates the undisturbed call and leaves out the preempted ones, while
# a quartile (unlike the minimum) stays steady over a dozen samples. A run compared with such a profile must
# take its own step times by the same statistic (benchmarks/fidelity.py does). "mean" is for a prediction that sums
# many actions: a step of N actions concentrates around the sum of their means (its quantiles lie within about
# 1/sqrt(N) of the actions' spread of it), so a sum of the actions' lower quartiles falls short of the step's lower
# quartile by about each action's mean less its quartile (tests/profile/test_timing_mean.py shows it).
STATISTICS = ("median", "p25", "mean")


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """Summary of repeated measurements of one phase (milliseconds)."""

    median_ms: float
    p25_ms: float
    p75_ms: float
    samples: int
    mean_ms: float | None = None  # None in records written before the mean was kept

    def at(self, statistic: str) -> float:
        """The figure `statistic` names (STATISTICS): the median, the lower quartile or the mean."""
        if statistic == "median":
            return self.median_ms
        if statistic == "p25":
            return self.p25_ms
        if statistic == "mean":
            if self.mean_ms is None:
                raise ValueError("timing statistic 'mean': this record has no mean (a profile cached before the mean "
                                 "was kept); profile again without the cache (--no-cache)")
            return self.mean_ms
        raise ValueError(f"timing statistic: expected one of {', '.join(STATISTICS)}, got {statistic!r}")

    @property
    def spread(self) -> float:
        """Inter-quartile range over the median (0 for a perfectly steady phase)."""
        return (self.p75_ms - self.p25_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON form."""
        d = {"median_ms": self.median_ms, "p25_ms": self.p25_ms, "p75_ms": self.p75_ms, "samples": self.samples}
        if self.mean_ms is not None:
            d["mean_ms"] = self.mean_ms
        return d

    @staticmethod
    def from_dict(d: dict) -> "Timing":
        """Inverse of to_dict."""
        mean = d.get("mean_ms")
        return Timing(median_ms=float(d["median_ms"]), p25_ms=float(d["p25_ms"]), p75_ms=float(d["p75_ms"]),
                      samples=int(d["samples"]), mean_ms=float(mean) if mean is not None else None)


ZERO = Timing(median_ms=0.0, p25_ms=0.0, p75_ms=0.0, samples=0, mean_ms=0.0)


def summarise(samples: list[float]) -> Timing:
    """Median, quartiles and mean of millisecond samples."""
    if not samples:
        return ZERO
    if len(samples) == 1:
        return Timing(median_ms=samples[0], p25_ms=samples[0], p75_ms=samples[0], samples=1, mean_ms=samples[0])
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return Timing(median_ms=statistics.median(samples), p25_ms=q[0], p75_ms=q[2], samples=len(samples),
                  mean_ms=statistics.fmean(samples))


class Timer:
    """Times callables on one device; `timed(fn)` returns (fn's result, milliseconds)."""

    def __init__(self, device: torch.device, flush_bytes: int = 0):
        self.cuda = device.type == "cuda"
        # written over before each timed call (flush_bytes > 0): the call then finds its weights and inputs out of
        # the caches, as a layer of a stage does after the stage's other layers and micro-batches ran
        self._flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes > 0 else None

    def timed(self, fn: Callable):
        """Run `fn` once and return its result and its device time in ms."""
        if self._flush is not None:
            self._flush.fill_(1)
        if self.cuda:
            # Events measure the kernels' span on the stream, not the host's launch time.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3
