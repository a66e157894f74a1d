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
# take its own step times by the same statistic (benchmarks/fidelity.py does).
STATISTICS = ("median", "p25")


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """Summary of repeated measurements of one phase (milliseconds)."""

    median_ms: float
    p25_ms: float
    p75_ms: float
    samples: int

    def at(self, statistic: str) -> float:
        """The figure `statistic` names (STATISTICS): the median, or the lower quartile."""
        if statistic == "median":
            return self.median_ms
        if statistic == "p25":
            return self.p25_ms
        raise ValueError(f"timing statistic: expected one of {', '.join(STATISTICS)}, got {statistic!r}")

    @property
    def spread(self) -> float:
        """Inter-quartile range over the median (0 for a perfectly steady phase)."""
        return (self.p75_ms - self.p25_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON form."""
        return {"median_ms": self.median_ms, "p25_ms": self.p25_ms, "p75_ms": self.p75_ms, "samples": self.samples}

    @staticmethod
    def from_dict(d: dict) -> "Timing":
        """Inverse of to_dict."""
        return Timing(median_ms=float(d["median_ms"]), p25_ms=float(d["p25_ms"]), p75_ms=float(d["p75_ms"]),
                      samples=int(d["samples"]))


ZERO = Timing(median_ms=0.0, p25_ms=0.0, p75_ms=0.0, samples=0)


def summarise(samples: list[float]) -> Timing:
    """Median and quartiles of millisecond samples."""
    if not samples:
        return ZERO
    if len(samples) == 1:
        return Timing(median_ms=samples[0], p25_ms=samples[0], p75_ms=samples[0], samples=1)
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return Timing(median_ms=statistics.median(samples), p25_ms=q[0], p75_ms=q[2], samples=len(samples))


class Timer:
    """Times callables on one device; `timed(fn)` returns (fn's result, milliseconds)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def timed(self, fn: Callable):
        """Run `fn` once and return its result and its device time in ms."""
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
