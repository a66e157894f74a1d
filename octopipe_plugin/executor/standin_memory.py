"""The dry run's stand-in of a plan's memory choices: activation bytes held, recompute slept, offloads copied.

A rank's stand-in holds each action's activation bytes as a real buffer (scaled down by `byte_scale` so a dry run
of a large model fits this host) and frees them as the plan's choices say (docs/formats.md "Memory choices", the
simulator's reference semantics, simulator/memory.py `choice_events`): F holds its stage's `kept` bytes from its
start; an offloaded stage's bytes are copied out on the rank's host-link thread after F (a sleep of the scaled copy
time; the device buffer is dropped when it ends) and back before the backward (issued when the action before it in
the rank's list starts, run after the copy-out on the one link, in issue order; the backward waits for it); B holds
`remat_b` more from its start and frees all at its end; I holds `remat_i` more, W frees all. The recomputed forwards
are in the stages' I and B durations (simulator/costs.py `MemoryCosts.apply`), so the stand-ins sleep them before
the backward's own time. Every change is recorded at the instant it happened on the device clock (an action's start
or end) or on the link thread (a copy's real end), and the measured peak is the peak of their running sum (frees
first at one instant, as the simulator's).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..actions import Kind
from .clock import sleep_until


@dataclass(frozen=True, kw_only=True, slots=True)
class StandInMemory:
    """Per stage the scaled bytes of the plan's memory choices (simulator MemoryCosts times `byte_scale`) and the
    scaled host-link copy time (ms) of its offloaded bytes."""

    kept: tuple[int, ...]
    remat_b: tuple[int, ...]
    remat_i: tuple[int, ...]
    offload: tuple[int, ...]
    copy_ms: tuple[float, ...]
    byte_scale: float


def standin_memory(mc, byte_scale: float) -> StandInMemory:
    """The stand-ins' figures from a simulator MemoryCosts whose times are already scaled; bytes times `byte_scale`."""
    sc = lambda xs: tuple(int(round(x * byte_scale)) for x in xs)  # noqa: E731
    return StandInMemory(kept=sc(mc.kept), remat_b=sc(mc.remat_b), remat_i=sc(mc.remat_i), offload=sc(mc.offload),
                         copy_ms=tuple(mc.copy_ms), byte_scale=byte_scale)


class HeldMemory:
    """One rank's held activation buffers, its host link and its (time, change) events (module docstring)."""

    def __init__(self, mem: StandInMemory, row):
        self.mem = mem
        # the rank's actions (kind, stage, micro-batch) in order: a backward's copy-in goes when the one before starts
        self.row = [(a.kind, a.stage, a.microbatch) for a in row]
        self.pos = 0
        self.events: list[tuple[float, int]] = []
        self._held: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostlink")
        self._out: dict[tuple[int, int], Future] = {}
        self._in: dict[tuple[int, int], Future] = {}
        self._deferred: dict[tuple[int, int], float] = {}  # copy-ins issued before their copy-out: when
        self.active = False

    def _event(self, t: float, delta: int) -> None:
        if self.active and delta:
            with self._lock:
                self.events.append((t, delta))

    def _hold(self, key, nbytes: int) -> None:
        if nbytes > 0:
            self._held.setdefault(key, []).append(torch.empty(nbytes, dtype=torch.uint8))

    def starting(self, start: float) -> None:
        """The rank's next action starts at `start`: issue the copy-in of the backward after it."""
        nxt = self.pos + 1
        self.pos = nxt
        if nxt < len(self.row):
            kind, s, mb = self.row[nxt]
            if kind in (Kind.B, Kind.I) and self.mem.offload[s]:
                if (s, mb) in self._out:
                    self._in[(s, mb)] = self._link.submit(self._copy_in, s, mb, start)
                else:  # its F is the action starting now: the copy-in queues right after that F's copy-out
                    self._deferred[(s, mb)] = start

    def forward(self, s: int, mb: int, start: float, end: float) -> None:
        """F held its `kept` bytes from `start`; an offloaded stage's copy-out goes to the link at `end`."""
        self._hold(("F", s, mb), self.mem.kept[s] - self.mem.offload[s])
        self._hold(("out", s, mb), self.mem.offload[s])
        self._event(start, self.mem.kept[s])
        if self.mem.offload[s]:
            self._out[(s, mb)] = self._link.submit(self._copy_out, s, mb, end)
            if (s, mb) in self._deferred:
                self._in[(s, mb)] = self._link.submit(self._copy_in, s, mb, self._deferred.pop((s, mb)))

    def _copy_out(self, s: int, mb: int, issued: float) -> float:
        sleep_until(issued)
        sleep_until(time.time() + self._ms(s) / 1000.0)
        end = time.time()
        with self._lock:
            self._held.pop(("out", s, mb), None)  # its bytes are on the host now
        self._event(end, -self.mem.offload[s])
        return end

    def _copy_in(self, s: int, mb: int, issued: float) -> float:
        start = max(issued, time.time())  # the link serves copies in issue order: its copy-out has ended
        sleep_until(start)
        self._hold(("in", s, mb), self.mem.offload[s])
        self._event(start, self.mem.offload[s])
        sleep_until(start + self._ms(s) / 1000.0)
        return time.time()

    def _ms(self, s: int) -> float:
        """A copy's time: none in the warm-up step (nothing is timed there)."""
        return self.mem.copy_ms[s] if self.active else 0.0

    def backward_ready(self, s: int, mb: int) -> float:
        """When a backward's copy-in has ended (0.0: nothing offloaded); waits for it."""
        fut = self._in.pop((s, mb), None)
        if fut is None and self.mem.offload[s]:  # its copy-in was issued by no action before it: now
            fut = self._link.submit(self._copy_in, s, mb, time.time())
        return fut.result() if fut is not None else 0.0

    def backward(self, kind: Kind, s: int, mb: int, start: float, end: float) -> None:
        """B brings `remat_b` back for its span and frees all at `end`; I brings `remat_i` back (freed by W)."""
        if kind is Kind.B:
            self._event(start, self.mem.remat_b[s])
            self._event(end, -(self.mem.kept[s] + self.mem.remat_b[s]))
            self._free(s, mb)
        else:
            self._hold(("I", s, mb), self.mem.remat_i[s])
            self._event(start, self.mem.remat_i[s])

    def weight(self, s: int, mb: int, end: float) -> None:
        """W frees what F kept and I brought back."""
        self._event(end, -(self.mem.kept[s] + self.mem.remat_i[s]))
        self._free(s, mb)

    def _free(self, s: int, mb: int) -> None:
        with self._lock:
            for key in (("F", s, mb), ("out", s, mb), ("in", s, mb), ("I", s, mb)):
                self._held.pop(key, None)
        self._out.pop((s, mb), None)

    def peak(self) -> int:
        """The measured peak of the held bytes (frees first at one instant)."""
        cur = best = 0
        for _, d in sorted(self.events, key=lambda e: (e[0], e[1])):
            cur += d
            best = max(best, cur)
        return best

    def reset(self) -> None:
        """Before the timed step: nothing held, no events, the row from its start."""
        self.pos = 0
        self.events.clear()
        self._held.clear()
        self._out.clear()
        self._in.clear()
        self._deferred.clear()

    def close(self) -> None:
        """Stop the host-link thread."""
        self._link.shutdown(wait=True)
