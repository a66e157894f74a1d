"""Putting a split layer's shard actions into a plan's per-device orders, into the bubbles.

The stage actions keep the order the tuner found for the model without the split layer's work;
every shard device also runs the layer's shard actions (H, J, K of the head; E, G of the
embedding), in micro-batch order per kind. Decisions are committed in time order, as in
listsched.py: a free device runs, of the actions whose inputs have arrived, the one its
`ShardPolicy` ranks first (else it waits for the earliest). H and J gate the owner stage's
backward of their micro-batch, so they usually go first; K, like W, fills gaps, unless more than
`k_limit` of them (each holding its logits) are pending. The simulator judges the result.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from ..actions import RULES, Action, Kind, pair_positions, shard_kinds
from ..formats import Plan
from ..simulator.costs import stage_costs
from ..simulator.pairs import pair_ms, stage_phases
from ..simulator.split import GRAD, SplitGraph, shard_state, split_costs, without_split_layers  # the judge's own rules
from .layout import pair_savings
from .pairing import pair_with

BASE = "base"  # the next stage action of the device's own order


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPolicy:
    """How a device ranks ready actions: shard passes before or after its own stage actions; deferred K held."""

    shard_first: bool = True
    k_limit: int = 2  # pending head weight-gradients (J run, K not) before K goes first
    window: int = 1  # a device may run any of the next `window` actions of its own order whose inputs are in
    defer_w: bool = False  # its own W (within the window) after every ready F/B/I and H/J: W fills the gaps

    def describe(self) -> str:
        """Compact text for plan metadata."""
        return f"shard-first={self.shard_first} klim={self.k_limit} window={self.window}" + \
            (" defer-w" if self.defer_w else "")


def insert_shards(model, cluster, plan: Plan, policy: ShardPolicy, launch_ms: float = 0.0,
                  delivery=None, pair: bool = False) -> Plan | None:
    """`plan` (with its `splits` set, its schedule holding stage actions only) with every shard action placed.

    `launch_ms` and `delivery` (the busy sender's delay, simulator/overheads.py `delivery_of`) price hand-overs.
    `pair`: a stage action also takes a partner of the other side as an overlapped pair where the pair hides
    more than the wait for it (tuner/pairing.py `pair_with`), chosen with the shards' timing; only where the
    model communicates."""
    sc = stage_costs(without_split_layers(model, plan.splits), plan.stages)
    splits = split_costs(model, plan)
    g = SplitGraph(cluster, plan, sc, splits, launch_ms, delivery=delivery)
    static = [a + b for a, b in zip(sc.device_state(plan.stages, plan.num_devices),
                                    shard_state(model, splits, plan.num_devices))]
    room = [cluster.usable_memory_bytes - b for b in static]
    rest = without_split_layers(model, plan.splits)
    phases = stage_phases(rest, plan.stages) if plan.pairs or pair else None
    hidden = pair_savings(rest, plan.stages) if pair and phases is not None else None
    return _Inserter(g, plan, policy, room, phases, hidden).run()


class _Inserter:
    """State of one insertion run."""

    def __init__(self, g: SplitGraph, plan: Plan, policy: ShardPolicy, room: list[int], phases=None, hidden=None):
        self.g, self.plan, self.pol = g, plan, policy
        self.phases, self.hidden = phases, hidden  # hidden: pairs chosen here (`insert_shards` pair)
        self.pairs: list = []  # made here, beside the base's
        # the base order's overlapped pairs, kept as units (simulator/pairs.py): position of the first half -> the
        # pair's time; the second half is placed with its first, never on its own
        starts = pair_positions(plan.schedule, plan.pairs)
        self.pair_at = [{i: pair_ms(phases, row[i], row[i + 1], g.duration(row[i], d), g.duration(row[i + 1], d))
                         for i in starts[d]} for d, row in enumerate(plan.schedule)]
        self.room = room  # per device, the bytes live activations may take
        self.live = [0] * plan.num_devices
        nd, m = plan.num_devices, plan.num_microbatches
        self.nd, self.m = nd, m
        self.base = [list(row) for row in plan.schedule]
        self.bpos = [0] * nd  # first action of the device's own order not yet run
        self.ran = [[False] * len(row) for row in self.base]
        # per device, per shard kind, the next micro-batch to run
        self.kinds = [tuple(k for c in g.by_side.values() if d in c.split.devices for k in shard_kinds(c.side))
                      for d in range(nd)]
        self.owner = {k: c.owner for c in g.by_side.values() for k in shard_kinds(c.side)}
        self.spos = [{k: 0 for k in self.kinds[d]} for d in range(nd)]
        self.done: dict = dict(g.preset)  # the token ids of a split embedding, sent before the step
        self.free = list(g.ready)
        self.out = [[] for _ in range(nd)]
        self.version = [0] * nd
        self.decision = [None] * nd
        self.heap: list = []
        self.pending_k = [0] * nd
        self.deps: dict = {}  # (device, action) -> its (producer key, delay) list, built once
        self.known: dict = {}  # (device, action) -> when its inputs are all in, once they are
        self.lv: dict = {}  # (device, action) -> its change of the device's live bytes, built once
        self.consumers = self._consumers()

    def _consumers(self) -> dict:
        """Devices to re-decide when an action ends: its own and every device some action waits for it on."""
        out: dict = {}
        for d in range(self.nd):
            acts = list(self.base[d]) + [Action(self.owner[k], k, mb) for k in self.kinds[d] for mb in range(self.m)]
            for a in acts:
                self.lv[(d, a)] = self.g.live(a, d)
                deps = self.deps[(d, a)] = self.g.deps(a, d)
                for dep, _ in deps:
                    out.setdefault(dep, set()).add(d)
        return out

    def run(self) -> Plan | None:
        """Commit decisions in time order; None if some device could not finish (should not happen)."""
        for d in range(self.nd):
            self._redecide(d)
        while self.heap:
            t, d, ver = heapq.heappop(self.heap)
            if ver != self.version[d]:
                continue
            self._commit(d, t, self.decision[d][1])
        total = sum(len(r) for r in self.base) + sum(len(k) * self.m for k in self.kinds)
        if sum(len(r) for r in self.out) != total:
            return None
        pairs = tuple(sorted(self.plan.pairs + tuple(self.pairs))) if self.pairs else self.plan.pairs
        return replace(self.plan, schedule=tuple(tuple(r) for r in self.out), pairs=pairs)

    def _fits(self, a: Action, d: int) -> bool:
        """Whether running `a` keeps device d within its memory (actions that free or keep always do)."""
        c = self.lv[(d, a)]
        return c <= 0 or self.live[d] + c <= self.room[d]

    def _candidates(self, d: int) -> list[tuple[int, float, Action]]:
        """(rank, ready time, action) of every action device d could run next whose inputs are known and that fit."""
        out = []
        row, ran, i, seen = self.base[d], self.ran[d], self.bpos[d], 0
        pair_at = self.pair_at[d]
        while i < len(row) and seen < self.pol.window:
            if not ran[i] and (i - 1) not in pair_at:  # a pair's second half goes with its first
                seen += 1
                r = self._ready(row[i], d)
                if r is not None and i in pair_at:  # a pair: both halves' inputs in, both fit
                    r2 = self._ready(row[i + 1], d)
                    r = None if r2 is None or not self._fits(row[i + 1], d) else max(r, r2)
                if r is not None and self._fits(row[i], d):  # earlier in the order ranks first
                    rank = 2.5 if self.pol.defer_w and row[i].kind is Kind.W else (1 if self.pol.shard_first else 0)
                    out.append((rank + seen * 1e-3, r, (row[i], i)))
            i += 1
        for k, mb in self.spos[d].items():
            if mb >= self.m:
                continue
            a = Action(self.owner[k], k, mb)
            r = self._ready(a, d)
            if r is None or not self._fits(a, d):
                continue
            if k is Kind.K or k is Kind.G:
                rank = -1 if self.pending_k[d] > self.pol.k_limit else 3
            else:
                rank = 0 if self.pol.shard_first else 1
                rank += 0.5 if k in (Kind.H, Kind.E) else 0.0  # J before H: it releases the owner's backward
            out.append((rank, r, (a, -1)))
        return out

    def _ready(self, a: Action, d: int) -> float | None:
        """When every input of `a` on d has arrived; None while some producer has not run (kept once known)."""
        got = self.known.get((d, a))
        if got is not None:
            return got
        t, done = 0.0, self.done
        for dep, delay in self.deps[(d, a)]:
            e = done.get(dep)
            if e is None:
                return None
            t = max(t, e + delay)
        self.known[(d, a)] = t
        return t

    def _redecide(self, d: int) -> None:
        cands = self._candidates(d)
        self.version[d] += 1
        if not cands:
            self.decision[d] = None
            return
        free = self.free[d]
        now = [c for c in cands if c[1] <= free]
        if now:
            rank, _, a = min(now, key=lambda c: (c[0], c[2][0].microbatch))
            start = free
        else:
            rank, r, a = min(cands, key=lambda c: (c[1], c[0]))
            start = r
        if self.hidden is not None and a[1] >= 0 and a[1] not in self.pair_at[d]:
            got = pair_with(self.hidden, a[0], start, [(r, c[0], c) for _, r, c in cands
                                                        if c[1] >= 0 and c[1] != a[1] and c[1] not in self.pair_at[d]])
            if got is not None:
                start, a = got[0], (a[0], a[1], got[3])
        self.decision[d] = (start, a)
        heapq.heappush(self.heap, (start, d, self.version[d]))

    def _commit(self, d: int, t: float, choice) -> None:
        a, i = choice[:2]
        if len(choice) == 3:  # a pair chosen here: its forward first, both ending after the pair's time
            (first, fi), (second, si) = sorted((choice[:2], choice[2]), key=lambda c: c[0].kind is not Kind.F)
            end = t + pair_ms(self.phases, first, second, self.g.duration(first, d), self.g.duration(second, d))
            woken = self._place(d, first, fi, end) | self._place(d, second, si, end)
            self.pairs.append((first, second))
        elif RULES[a.kind].side is None and i in self.pair_at[d]:  # a pair: both halves end after its time
            end = t + self.pair_at[d][i]
            woken = self._place(d, a, i, end) | self._place(d, self.base[d][i + 1], i + 1, end)
        else:
            woken = self._place(d, a, i, t + self.g.duration(a, d))
        for w in woken:
            self._redecide(w)

    def _place(self, d: int, a: Action, i: int, end: float) -> set:
        """Append `a` (base position i, or -1 for a shard action) ending at `end`; the devices to re-decide."""
        self.free[d] = end
        self.out[d].append(a)
        self.live[d] += self.lv[(d, a)]
        rule = RULES[a.kind]
        if rule.side is None:
            ran = self.ran[d]
            ran[i] = True
            while self.bpos[d] < len(ran) and ran[self.bpos[d]]:
                self.bpos[d] += 1
        else:
            self.spos[d][a.kind] += 1
            if a.kind is Kind.J:
                self.pending_k[d] += 1
            elif a.kind is Kind.K:
                self.pending_k[d] -= 1
        keys = [self.g.key(a, d)]
        if rule.sends is not None and rule.sends.step < 0:
            keys.append((GRAD, a.stage, a.microbatch))
        woken = {d}
        for k in keys:
            self.done[k] = end
            woken |= self.consumers.get(k, set())
        return woken
