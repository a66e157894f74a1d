"""Bubble-aware greedy list scheduler: builds every device's own action order by event simulation.

The scheduler advances a global clock over device *decisions*: each device, when free,
picks among the actions whose inputs have arrived, following its own policy (warm-up
depth, fused B or split I/W, when to run deferred W work, which chunk first). Because a
decision is taken only once every action that could deliver an input earlier has been
committed, each action starts at max(device free, inputs ready) -- exactly the reference
semantics of docs/formats.md -- so the simulator replays the order to the same times.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..actions import KINDS, RULES, Action, Flow, Kind, PairedSchedule
from ..simulator.costs import kind_durations
from ..simulator.memory import activation_changes, per_microbatch
from .encoded import EncodedSchedule

INF = float("inf")
_PAIR = "pair"  # a decision: (forward stage, backward stage) run as one overlapped pair
_PAIR_CODE = {"off": 0, "ready": 1, "wait": 2}  # Pairing for the compiled loop


class Split(str, enum.Enum):
    """How a device runs its backwards: fused B, split I+W, or split except where nobody waits."""

    FUSED = "fused"
    SPLIT = "split"
    AUTO = "auto"  # I+W where an upstream stage waits for the input-gradient, B on stage 0


class WFill(str, enum.Enum):
    """When a device with nothing ready runs a deferred W: always, or only if it ends before the next input."""

    ALWAYS = "always"
    FIT = "fit"


class Pairing(str, enum.Enum):
    """Whether the list scheduler pairs a backward with a forward: never, with a ready one, or also a due one."""

    OFF = "off"
    READY = "ready"
    WAIT = "wait"


class Order(str, enum.Enum):
    """Which ready chunk goes first: the deepest stage (drain micro-batches) or the shallowest (admit new ones)."""

    DEEP = "deep"
    SHALLOW = "shallow"


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """Per-device scheduling policy; tuples have one entry per device."""

    depth: tuple[int, ...]  # most micro-batches in flight on a device (warm-up depth)
    split: tuple[Split, ...]
    w_limit: tuple[int, ...]  # most deferred W a device may hold before it must run one
    w_fill: WFill = WFill.ALWAYS
    f_order: Order = Order.DEEP
    b_order: Order = Order.DEEP
    # a device about to run a backward while a forward of another micro-batch is ready runs both as an overlapped
    # pair, where the pair hides communication (Job.hidden; tuner/pairing.py); WAIT: also with a forward whose
    # input is due within less than the pair hides, and a ready forward with such a backward (the pair starts
    # once both are in)
    pair: Pairing = Pairing.OFF

    def describe(self) -> str:
        """Compact text of the policy for logs and plan metadata."""
        split = "".join(s.value[0] for s in self.split)
        return (f"depth={list(self.depth)} split={split} wlim={list(self.w_limit)} "
                f"wfill={self.w_fill.value} f={self.f_order.value} b={self.b_order.value}"
                + ("" if self.pair is Pairing.OFF else f" pair={self.pair.value}"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What the scheduler needs of a layout: per-stage costs, devices, hops and memory caps."""

    devices: tuple[int, ...]  # device of each stage
    num_devices: int
    num_microbatches: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    activation: tuple[int, ...]
    hop: tuple[float | None, ...]  # transfer time over the boundary s -> s+1 (None on one device): hop_times
    act_cap: tuple[float, ...]  # activation bytes each device may hold (memory minus static state)
    extra: dict | None = None  # per kind, each stage's host overhead (simulator/overheads.py); None: none
    fused: tuple[float, ...] | None = None  # per stage B's measured time (StageCosts.fused); None: bwd + wgrad
    # what pairing F of stage a with B (I) of stage b saves, {(Kind.B | Kind.I, a, b): ms} for a and b on one device
    # where it is > 0 (simulator/pairs.py `hidden_ms`); None: the model does not communicate, nothing pairs
    hidden: dict | None = None


# Below this many actions the Python scheduler takes milliseconds; above it the compiled one pays for its load.
KERNEL_MIN_ACTIONS = 20_000


def build_schedule(job: Job, policy: Policy, compiled: bool | None = None):
    """Per-device action lists for `job` under `policy`; None when the policy starves (memory or depth).

    Large jobs run the numba-compiled event loop (listsched_kernel) when numba is installed; it
    takes the same decisions and returns the rows encoded (tuner/encoded.py). `compiled` forces
    one or the other (tests compare them).
    """
    if compiled is None:
        compiled = 3 * len(job.devices) * job.num_microbatches >= KERNEL_MIN_ACTIONS and _kernel().AVAILABLE
    if compiled:
        return _compiled(job, policy)
    return _Scheduler(job, policy).run()


def schedule_units(job: Job) -> float:
    """Work units charged for scheduling `job` (a simulated action is one unit).

    By size alone, never by which implementation ran, so a seed and a work budget give the same
    plan with or without numba (a machine without it just needs longer for the same work).
    """
    actions = 3 * len(job.devices) * job.num_microbatches
    return actions * (6.0 if actions < KERNEL_MIN_ACTIONS else 0.5)


def _kernel():
    """The compiled event loop's module, imported at the first job that runs it."""
    # not at module level: importing it imports numba (0.6-0.9 s), which every process importing the tuner
    # would pay (each `octopipe` command, each rank of a launch tuning at start-up) for jobs too small to use it
    from . import listsched_kernel

    return listsched_kernel


def hidden_table(job: Job) -> np.ndarray:
    """Job.hidden as a (2, stages, stages) array: [0] F with B, [1] F with I (zero where nothing is hidden)."""
    ns = len(job.devices)
    out = np.zeros((2, ns, ns), np.float64)
    for (kind, a, b), ms in (job.hidden or {}).items():
        out[0 if kind is Kind.B else 1, a, b] = ms
    return out


def _compiled(job: Job, policy: Policy) -> EncodedSchedule | None:
    """The compiled scheduler's rows as an EncodedSchedule."""
    kernel = _kernel()
    f64, i64 = np.float64, np.int64
    kinds = KINDS  # row i of each table is kind code i
    dur, change = kind_durations(job, job.extra), activation_changes(job.activation)
    send = [0 if RULES[k].sends is None else RULES[k].sends.step for k in kinds]
    split_code = {Split.FUSED: kernel.FUSED, Split.SPLIT: kernel.SPLIT, Split.AUTO: kernel.AUTO}
    hop = np.array([0.0 if h is None else h for h in job.hop], f64)
    out, lengths, ok, free, peak, paired = kernel.schedule_kernel(
        job.num_microbatches, np.array(job.devices, i64), np.array([dur[k] for k in kinds], f64),
        np.array([change[k] for k in kinds], i64), np.array(per_microbatch(job.activation), i64),
        np.array(send, i64), hop, np.array(job.act_cap, f64),
        np.array(policy.depth, i64), np.array([split_code[s] for s in policy.split], i64),
        np.array(policy.w_limit, i64), policy.w_fill is WFill.ALWAYS, policy.f_order is Order.DEEP,
        policy.b_order is Order.DEEP, _PAIR_CODE[policy.pair] if job.hidden is not None else 0, hidden_table(job))
    if not ok:
        return None
    rows = EncodedSchedule([out[d, :lengths[d]].copy() for d in range(job.num_devices)])
    pairs = []
    for d in range(job.num_devices):
        for p in np.nonzero(paired[d, :lengths[d]])[0].tolist():
            (s1, k1, m1), (s2, k2, m2) = out[d, p].tolist(), out[d, p + 1].tolist()
            pairs.append((Action(s1, KINDS[k1], m1), Action(s2, KINDS[k2], m2)))
    rows.pairs = tuple(sorted(pairs))
    rows.clock = (float(free.max()) if len(free) else 0.0, tuple(int(x) for x in peak))
    return rows


class _Scheduler:
    """Mutable state of one list-scheduling run (kept local to `build_schedule`)."""

    def __init__(self, job: Job, policy: Policy):
        self.job, self.pol = job, policy
        ns, m, nd = len(job.devices), job.num_microbatches, job.num_devices
        self.ns, self.m, self.nd = ns, m, nd
        self.stages_of = [[s for s in range(ns) if job.devices[s] == d] for d in range(nd)]
        self.low = [st[0] if st else -1 for st in self.stages_of]
        # what each kind costs and does to live memory, from the kind table
        self.dur = kind_durations(job, job.extra)
        self.change = activation_changes(job.activation)
        self.f_grow = self.change[Kind.F]  # what admitting a forward adds (read in the candidate loop)
        self.w_dur = self.dur[Kind.W]  # what filling a gap with a deferred W costs
        held = per_microbatch(job.activation)
        # room kept free when a new micro-batch enters a device, so its later chunks can still run there
        self.headroom = [sum(held[s] for s in st[1:]) for st in self.stages_of]
        self.f_end = [-1.0] * (ns * m)
        self.act_arr = [-1.0] * (ns * m)
        self.grad_arr = [-1.0] * (ns * m)
        for mb in range(m):
            self.act_arr[mb] = 0.0
            self.grad_arr[(ns - 1) * m + mb] = 0.0
        # per kind, from the table: duration and memory change per stage, where its end time is kept
        # (kinds another kind waits `after`; F here) and where its output lands and in which direction
        arrivals = {Flow.ACT: self.act_arr, Flow.GRAD: self.grad_arr}
        ends = {Kind.F: self.f_end}
        self.effects = {
            kind: (self.dur[kind], self.change[kind], ends.get(kind),
                   None if rule.sends is None else arrivals[rule.sends], 0 if rule.sends is None else rule.sends.step)
            for kind, rule in RULES.items()
        }
        self.next_f = [0] * ns
        self.next_b = [0] * ns
        self.free = [0.0] * nd
        self.live = [0] * nd
        self.inflight = [0] * nd
        self.wq = [deque() for _ in range(nd)]
        self.out = [[] for _ in range(nd)]
        self.decision = [None] * nd
        self.version = [0] * nd
        self.heap: list[tuple[float, int, int]] = []
        self.hidden = job.hidden if policy.pair is not Pairing.OFF and job.hidden is not None else None
        self.pairs: list[tuple[Action, Action]] = []

    def run(self):
        """Commit decisions in time order until every action is placed; None if stuck."""
        total = sum(2 * self.m * len(st) for st in self.stages_of)
        done_main = 0
        for d in range(self.nd):
            self._redecide(d)
        heap, version, decision = self.heap, self.version, self.decision
        while heap:
            # the earliest decision, lowest device first on ties; entries superseded by a newer decision are skipped
            t, d, ver = heapq.heappop(heap)
            if ver != version[d]:
                continue
            kind = decision[d][1]
            self._commit(d, t, kind, decision[d][2])
            if kind is not Kind.W:
                done_main += 2 if kind is _PAIR else 1
        if done_main < total or any(self.wq):
            return None
        rows = tuple(tuple(row) for row in self.out)
        return PairedSchedule(rows, self.pairs) if self.pairs else rows

    def _redecide(self, d) -> None:
        """Recompute device d's next decision and queue it (a device waiting for news is not queued)."""
        dec = self.decision[d] = self._decide(d)
        self.version[d] += 1
        if dec[0] < INF:
            heapq.heappush(self.heap, (dec[0], d, self.version[d]))

    def _bwd_candidates(self, d):
        """(ready time, stage) of each stage's next backward whose inputs are known."""
        m, out = self.m, []
        for s in self.stages_of[d]:
            mb = self.next_b[s]
            if mb < m:
                idx = s * m + mb
                fe, g = self.f_end[idx], self.grad_arr[idx]
                if fe >= 0 and g >= 0:
                    out.append((fe if fe > g else g, s))
        return out

    def _fwd_candidates(self, d):
        """(ready time, stage) of each admissible next forward, and whether memory blocked one."""
        m, job, out, blocked = self.m, self.job, [], False
        for s in self.stages_of[d]:
            mb = self.next_f[s]
            if mb < m:
                a = self.act_arr[s * m + mb]
                if a < 0:
                    continue
                entry = s == self.low[d]
                if entry and self.inflight[d] >= self.pol.depth[d]:
                    continue
                if self.live[d] + self.f_grow[s] + (self.headroom[d] if entry else 0) > job.act_cap[d]:
                    blocked = True
                    continue
                out.append((a, s))
        return out, blocked

    def _decide(self, d):
        """(time, kind, stage) of device d's next action, or (inf, None, -1) when it must wait for news."""
        t0 = self.free[d]
        bw = self._bwd_candidates(d)
        fw, blocked = self._fwd_candidates(d)
        wq = self.wq[d]
        if wq and (blocked or len(wq) > self.pol.w_limit[d]):
            return (t0, Kind.W, -1)
        nxt = min([r for r, _ in bw] + [r for r, _ in fw], default=INF)
        if nxt > t0 and wq:
            w_dur = self.w_dur[wq[0][0]]
            if self.pol.w_fill is WFill.ALWAYS or nxt == INF or nxt - t0 >= w_dur:
                return (t0, Kind.W, -1)
        if nxt == INF:
            return (INF, None, -1)
        t = t0 if t0 > nxt else nxt
        deep = self.pol.b_order is Order.DEEP
        ready_b = [s for r, s in bw if r <= t]
        ready_f = [s for r, s in fw if r <= t]
        f_pick = max if self.pol.f_order is Order.DEEP else min
        if ready_b:
            s = max(ready_b) if deep else min(ready_b, key=lambda x: (self.next_b[x], -x))
            if self.hidden is not None:
                # pair it with the forward the policy would run next among those whose input is in, or due within
                # less than what the pair hides (the pair starts once both are in: waiting costs less than it saves)
                bk = self._backward_kind(d, s)
                wait = self.pol.pair is Pairing.WAIT
                due = {f: r for r, f in fw if (r - t < self.hidden.get((bk, f, s), 0.0) if wait else r <= t)
                       and self.hidden.get((bk, f, s), 0.0) > 0.0}
                if due:
                    f = f_pick(due)
                    return (max(t, due[f]), _PAIR, (f, s))
            return (t, Kind.B, s)
        f = f_pick(ready_f)
        if self.hidden is not None and self.pol.pair is Pairing.WAIT:
            # the forward also waits for a backward due within less than the pair hides
            due = [(r, b) for r, b in bw if r - t < self.hidden.get((self._backward_kind(d, b), f, b), 0.0)]
            if due:
                r, b = min(due)
                return (max(t, r), _PAIR, (f, b))
        return (t, Kind.F, f)

    def _backward_kind(self, d, s):
        mode = self.pol.split[d]
        if mode is Split.FUSED or (mode is Split.AUTO and s == 0):
            return Kind.B
        return Kind.I

    def _commit(self, d, t, kind, s):
        if kind is _PAIR:  # an overlapped pair: F then B (I), both ending after the pair's time (simulator/pairs.py)
            sf, sb = s
            bk = self._backward_kind(d, sb)
            end = t + self.dur[Kind.F][sf] + self.dur[bk][sb] - self.hidden[(bk, sf, sb)]
            first, t1 = self._commit_one(d, t, Kind.F, sf, end)
            second, t2 = self._commit_one(d, t, Kind.B, sb, end)
            self.pairs.append((first, second))
            touched = t1 | t2
        else:
            touched = self._commit_one(d, t, kind, s)[1]
        for e in touched:
            self._redecide(e)

    def _commit_one(self, d, t, kind, s, end=None):
        """Place one action at t (ending at `end` when given: a pair's half); (it, the devices its output reaches)."""
        job, m = self.job, self.m
        if kind is Kind.W:
            s, mb = self.wq[d].popleft()
        elif kind is Kind.F:
            mb = self.next_f[s]
            self.next_f[s] += 1
            if s == self.low[d]:
                self.inflight[d] += 1
        else:
            mb = self.next_b[s]
            self.next_b[s] += 1
            kind = self._backward_kind(d, s)
            if kind is Kind.I:
                self.wq[d].append((s, mb))  # its W (which runs after it) is placed later on this device
            if s == self.low[d]:
                self.inflight[d] -= 1
        dur, change, ends, arrival, step = self.effects[kind]
        if end is None:
            end = t + dur[s]
        self.live[d] += change[s]
        idx = s * m + mb
        if ends is not None:
            ends[idx] = end
        touched = {d}
        dst = s + step
        if arrival is not None and 0 <= dst < self.ns:
            h = job.hop[s if step > 0 else dst]
            arrival[idx + step * m] = end if h is None else end + h
            touched.add(job.devices[dst])
        a = Action(s, kind, mb)
        self.out[d].append(a)
        self.free[d] = end
        return a, touched
