"""Event-driven simulation of a plan under the reference semantics of docs/formats.md, plus switches.

Each device runs its list in order; a device blocked on a missing input parks on that
input's key and is woken when the producer ends, so every action is visited a bounded
number of times (the tuner calls this thousands of times). The schedule is first compiled
into plain integer tuples so the hot loop touches no enums, dataclasses or dicts of objects.

Switches (all off = docs/formats.md exactly):
- contention: one transfer at a time per (src, dst) link direction, in the sender's production
  order (the per-pair message order of schedules/messages.py).
- overlap=False: a device cannot compute while it moves data. The sender is busy for the
  transfer right after the producing action; the receiver is busy for the transfer time right
  before the consuming action, which cannot start before the data has arrived.
- launch_ms: a fixed cost added to every cross-device message (in flight).
  The overheads' busy-sender delivery delay is in flight too (costs.hop_times).
- overheads: the executor's measured host costs per action kind and per message on the sender and
  the receiver (formats/overheads.py), charged on the devices' timelines by simulator/overheads.py;
  its `launch_ms` and the option's are one figure (the option's is folded into it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import DeadlockError
from ..actions import CODE, KINDS, RULES, Action, Flow, Kind, pair_positions, senders
from .costs import MemoryCosts, StageCosts, hop_times, kind_durations, memory_costs, stage_costs
from .memory import activation_changes, choice_events, peak_live, timed_peak
from .pairs import pair_ms, stage_phases
from .overheads import delivery_of, overhead_ms
from ..formats.overheads import Overheads
from ..formats.memory import OFFLOAD, OFFLOAD_W
from .result import SimResult, Transfer, stuck_grid as _stuck_grid


@dataclass(frozen=True, kw_only=True, slots=True)
class SimOptions:
    """Refinements over the reference semantics; all off reproduces docs/formats.md exactly."""

    contention: bool = False  # one transfer at a time per (src, dst) link direction
    overlap: bool = True  # False: each device spends every send and receive on its own timeline
    launch_ms: float = 0.0  # fixed cost added to every cross-device message
    # measured host costs (formats/overheads.py); None charges none. launch_ms is folded in: after
    # construction `launch_ms == overheads.launch_ms` whenever overheads is set
    overheads: Overheads | None = None

    def __post_init__(self):
        ov = self.overheads
        if ov is None or self.launch_ms == ov.launch_ms:
            return
        if ov.launch_ms and self.launch_ms:
            raise ValueError(f"SimOptions: launch_ms={self.launch_ms} and overheads.launch_ms={ov.launch_ms}: give "
                             f"the per-message launch cost once")
        if self.launch_ms:
            object.__setattr__(self, "overheads", replace(ov, launch_ms=self.launch_ms))
        else:
            object.__setattr__(self, "launch_ms", ov.launch_ms)


# The kind table compiled for the hot loop, by kind code (actions.CODE).
_NK = len(KINDS)
# What a parked device waits for, as a slot of the key `index * _SLOTS + slot`: slot c < _NK is the
# device's own action of kind code c (the table's `after`); then the activation and the gradient.
_ACT, _GRAD = _NK, _NK + 1
_SLOTS = _NK + 2
_IN_SLOT = {None: -1, Flow.ACT: _ACT, Flow.GRAD: _GRAD}
_AFTER = tuple(-1 if RULES[k].after is None else CODE[RULES[k].after] for k in KINDS)
_RECV = tuple(_IN_SLOT[RULES[k].receives] for k in KINDS)
# kinds some other kind waits for: only their end times are kept
_TRACK = tuple(any(r.after is k for r in RULES.values()) for k in KINDS)


def _compile(schedule, nm: int, sc: StageCosts, dev_of: list[int], hop, extra=None, pairs=(), phases=None):
    """Each device's actions as two parallel lists: stage * m + mb, and what the table says of its (kind, stage).

    The second is one shared tuple per (kind, stage): (kind code, duration, after, input slot,
    tracked, device its output goes to or -1, index step to that output, hop time, output slot,
    partner). Also each device's activation changes in its own order (for the peak). A schedule kept
    as (stage, kind code, micro-batch) integer arrays (`schedule.encoded`) is read as such.

    An overlapped pair (`pairs`) becomes its first half carrying the pair's duration and, as partner,
    (index, after, input slot) of the second half, whose inputs it waits for too; and its second half
    with duration 0, so both end together (simulator/pairs.py prices the overlap from `phases`).
    """
    dur = kind_durations(sc, extra)
    change = activation_changes(sc.activation)
    ns = len(dev_of)
    pre = {}
    for k in KINDS:
        c, flow = CODE[k], RULES[k].sends
        per_stage = []
        for s in range(ns):
            t = s + flow.step if flow is not None else -1
            if 0 <= t < ns:
                out = (dev_of[t], flow.step * nm, hop[min(s, t)], _IN_SLOT[flow])
            else:
                out = (-1, 0, None, -1)
            per_stage.append((c, dur[k][s], _AFTER[c], _RECV[c], _TRACK[c]) + out + (None,))
        pre[k] = per_stage
    encoded = getattr(schedule, "encoded", None)
    if encoded is not None:
        idxs, rules, deltas = _compile_encoded(encoded, nm, [pre[k] for k in KINDS], [change[k] for k in KINDS])
    else:
        idxs = [[a.stage * nm + a.microbatch for a in row] for row in schedule]
        rules = [[pre[a.kind][a.stage] for a in row] for row in schedule]
        deltas = [[change[a.kind][a.stage] for a in row] for row in schedule]
    if pairs:
        _fold_pairs(schedule, pairs, rules, dur, phases)
    return idxs, rules, deltas


def _fold_pairs(schedule, pairs, rules, dur, phases) -> None:
    """Rewrite each pair's two entries in `rules` (see `_compile`): its duration on the first, none on the second."""
    for d, (row, starts) in enumerate(zip(schedule, pair_positions(schedule, pairs))):
        for p in starts:
            first, second = row[p], row[p + 1]
            ms = pair_ms(phases, first, second, dur[first.kind][first.stage], dur[second.kind][second.stage])
            a, b = rules[d][p], rules[d][p + 1]
            rules[d][p] = (a[0], ms) + a[2:9] + ((second.stage, b[2], b[3]),)
            rules[d][p + 1] = (b[0], 0.0) + b[2:]


def _compile_encoded(encoded, nm: int, pre: list, change: list):
    """`_compile` for rows kept as (n, 3) integer arrays of stage, kind code (actions.CODE) and micro-batch."""
    idxs, rules, deltas = [], [], []
    for e in encoded:
        stages, codes, mbs = e[:, 0].tolist(), e[:, 1].tolist(), e[:, 2].tolist()
        idxs.append([s * nm + mb for s, mb in zip(stages, mbs)])
        rules.append([pre[c][s] for c, s in zip(codes, stages)])
        deltas.append([change[c][s] for c, s in zip(codes, stages)])
    return idxs, rules, deltas


def simulate(model, cluster, plan, options: SimOptions | None = None, *, costs: StageCosts | None = None,
             detail: bool = True) -> SimResult:
    """Simulate `plan`; raises DeadlockError when some device can never proceed.

    `detail=False` skips the timeline, transfers and critical path (for search loops).
    """
    opts = options or SimOptions()
    # memory choices need the model's layers; a costs-only run (the deadlock check: no model) runs without them
    memory = getattr(plan, "memory", ()) if model is not None else ()
    if memory and getattr(plan, "splits", ()) and any(c.kind in (OFFLOAD, OFFLOAD_W) for _, c in memory):
        from ..errors import PlanError

        # split.py prices recompute (list-order peaks, no host link): offload needs core.py's timed host link
        raise PlanError("plan $.memory: offload choices on a plan with split layers (`splits`) are not simulated; "
                        "fix: drop the offload entries, or `splits`")
    if getattr(plan, "splits", ()):
        from .split import simulate_split  # split layers: their own (slower) loop; plans without keep this one

        return simulate_split(model, cluster, plan, opts, costs=costs, detail=detail)
    sc = costs if costs is not None else stage_costs(model, plan.stages)
    mc = None
    if memory:  # memory choices (docs/formats.md "Memory choices"): their own loop, plans without keep this one
        mc = memory_costs(model, plan, cluster)
        sc = mc.apply(sc)
    nm, nd = plan.num_microbatches, plan.num_devices
    dev_of = [st.device for st in plan.stages]
    hop = hop_times(cluster, dev_of, sc.output, opts.launch_ms, delivery_of(opts.overheads))
    extra = overhead_ms(opts.overheads, dev_of, sc.output)
    pairs = getattr(plan, "pairs", ())
    phases = stage_phases(model, plan.stages) if pairs else None
    idxs, rules, deltas = _compile(plan.schedule, nm, sc, dev_of, hop, extra, pairs, phases)
    run = _Run(nd, len(dev_of) * nm, nm, opts, detail) if mc is None else _MemRun(nd, len(dev_of) * nm, nm, opts,
                                                                                    detail, plan, mc)
    # the action objects are read only to record transfers (detail); an encoded schedule stays encoded
    encoded = getattr(plan.schedule, "encoded", None) is not None
    run.execute(idxs, rules, plan.schedule if detail or not encoded else idxs)
    if any(run.pos[d] < len(idxs[d]) for d in range(nd)):
        _raise_deadlock(plan, run.pos, run.waiting)
    if detail and pairs:  # a pair's second half is shown over the whole pair, as its first
        for d, (row, starts) in enumerate(zip(plan.schedule, pair_positions(plan.schedule, pairs))):
            for p in starts:
                a, start, end = run.timeline[d][p]
                run.timeline[d][p + 1] = (row[p + 1], start, end)
    if mc is not None:
        return _finish(plan, sc, run, run.peaks(), run.host_peaks(), run.copies_detail() if detail else [])
    return _finish(plan, sc, run, [peak_live(dl) for dl in deltas])


def detailed(model, cluster, plan, options: SimOptions | None = None, result: SimResult | None = None) -> SimResult:
    """`result` when it carries a timeline, else a detailed simulation of `plan` (for the pictures)."""
    if result is not None and any(result.timeline):
        return result
    return simulate(model, cluster, plan, options)


class _Run:
    """Mutable state of one simulation; `execute` is the hot loop."""

    mem = False  # _MemRun: the loop calls its hooks `_prepare`, `_held` and `_ran`

    def __init__(self, nd: int, n: int, nm: int, opts: SimOptions, detail: bool):
        self.nm, self.opts = nm, opts
        self.free = [0.0] * nd
        self.busy = [0.0] * nd
        self.pos = [0] * nd
        self.waiting: dict[int, int] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.detail = detail
        # detail: per device (action, start, end), and the input slot that bound each start
        # (-1 when the device itself, busy with its previous action, bound it)
        self.timeline = [[] for _ in range(nd)] if detail else None
        self.bound = [[] for _ in range(nd)] if detail else None
        self.transfers: list[Transfer] | None = [] if detail else None
        # detail: position in its device's list of each action, per kind code, by stage * m + mb;
        # and of the action that sent each activation / gradient (F; B or I)
        self.at = [[0] * n for _ in range(_NK)] if detail else None
        self.sent_at = {Flow.ACT: [0] * n, Flow.GRAD: [0] * n} if detail else None
        self.n = n

    def send(self, t_end: float, src: int, dst: int, cost: float, producer: Action) -> float:
        """Time the message produced at `t_end` on src arrives on dst."""
        if self.opts.contention:
            key = (src, dst)
            st = max(t_end, self.link_free.get(key, 0.0))
            self.link_free[key] = st + cost
        else:
            st = t_end
        if not self.opts.overlap and st + cost > self.free[src]:
            self.free[src] = st + cost
        if self.transfers is not None:
            self.transfers.append(Transfer(src, dst, st, st + cost, producer))
        return st + cost

    def record(self, d: int, p: int, a: Action, start: float, end: float, slot: int) -> None:
        """Detail mode: keep the action's times, what bound its start, and where it sits."""
        self.timeline[d].append((a, start, end))
        self.bound[d].append(slot)
        idx = a.stage * self.nm + a.microbatch
        self.at[CODE[a.kind]][idx] = p
        flow = RULES[a.kind].sends
        if flow is not None:
            self.sent_at[flow][idx] = p

    def execute(self, idxs, rules, schedule) -> None:
        """Run every device as far as its inputs allow; parked devices wake when their input lands.

        An action starts once its own prerequisite (the table's `after`) has ended and its input
        (`receives`) has arrived; its end releases what waits on it and sends its output.
        """
        nm, n = self.nm, self.n
        act_arr = [0.0] * nm + [-1.0] * (n - nm)  # stage 0 has its inputs at t = 0
        grad_arr = [-1.0] * (n - nm) + [0.0] * nm  # the last stage makes its own gradient
        arrival = [None] * _NK + [act_arr, grad_arr]  # by slot
        done = [[-1.0] * n if track else None for track in _TRACK]  # end time of each tracked action
        recv = None if self.opts.overlap else [0.0] * (2 * n)
        free, busy, pos, waiting, timeline = self.free, self.busy, self.pos, self.waiting, self.timeline
        mem = self.mem  # memory choices: the host link's copies (_MemRun's hooks), else nothing more per action
        if mem:
            self._prepare(rules)
        ready = list(range(len(idxs)))
        while ready:
            d = ready.pop()
            ids, row, acts, p, t_free = idxs[d], rules[d], schedule[d], pos[d], free[d]
            end_p = len(row)
            while p < end_p:
                idx = ids[p]
                code, dur, after, rin, track, dst, step, h, key, partner = row[p]
                slot = -1
                dep = rc = 0.0
                if partner is not None:  # an overlapped pair: it also waits for its second half's inputs
                    other = ids[p + 1]
                    o_after, o_rin = partner[1], partner[2]
                    if o_after >= 0 and done[o_after][other] < 0:
                        waiting[other * _SLOTS + o_after] = d
                        break
                    if o_rin >= 0 and arrival[o_rin][other] < 0:
                        waiting[other * _SLOTS + o_rin] = d
                        break
                    o_dep = max(done[o_after][other] if o_after >= 0 else 0.0,
                                arrival[o_rin][other] if o_rin >= 0 else 0.0)
                    if o_dep > 0.0:  # bound by the partner's input: its slot past _SLOTS (for the critical path)
                        dep, slot = o_dep, _SLOTS + (o_rin if o_rin >= 0 else o_after)
                if after >= 0:
                    t_after = done[after][idx]
                    if t_after < 0:
                        waiting[idx * _SLOTS + after] = d
                        break
                    if slot < 0 or t_after > dep:
                        dep, slot = t_after, after
                if rin >= 0:
                    t_in = arrival[rin][idx]
                    if t_in < 0:
                        waiting[idx * _SLOTS + rin] = d
                        break
                    if slot < 0 or t_in > dep:
                        dep, slot = t_in, rin
                    if recv is not None:
                        rc = recv[idx if rin == _ACT else n + idx]
                ready_at = t_free + rc
                if mem:
                    ready_at = self._held(d, p, ready_at, partner is not None)
                start = ready_at if ready_at >= dep else dep
                end = start + dur
                busy[d] += dur
                if timeline is not None:
                    self.record(d, p, acts[p], start, end, -1 if ready_at >= dep and p > 0 else slot)
                if mem:
                    self._ran(d, p, rules, ids, start, end)
                t_free = free[d] = end
                if track:
                    done[code][idx] = end
                    w = waiting.pop(idx * _SLOTS + code, None)
                    if w is not None:
                        ready.append(w)
                if dst >= 0:
                    nxt = idx + step
                    if h is None:
                        arrival[key][nxt] = end
                    else:
                        arrival[key][nxt] = self.send(end, d, dst, h, acts[p])
                        if recv is not None:
                            recv[nxt if key == _ACT else n + nxt] = h
                        t_free = free[d]
                    w = waiting.pop(nxt * _SLOTS + key, None)
                    if w is not None:
                        ready.append(w)
                p += 1
            pos[d] = p


class _MemRun(_Run):
    """A plan with memory choices: `_Run`'s loop with the hooks of each device's host link (docs/formats.md,
    "Memory choices").

    An F of a stage with offloaded layers issues its copy-out when it ends; a B or I of one issues its copy-in
    when the action before it in its device's list (before the pair it is in) starts, not before its copy-out has
    ended (an I and its W likewise for `offload_w` layers), and starts no earlier than the copy-in's end. Each device's host link serves its copies one at a time in
    issue order (a copy-out first on a tie); they overlap compute. Every action's times are kept for the memory
    events (memory.choice_events).
    """

    mem = True

    def __init__(self, nd, n, nm, opts, detail, plan, mc: MemoryCosts):
        super().__init__(nd, n, nm, opts, detail)
        self.plan, self.mc = plan, mc
        self.host_free = [0.0] * nd
        self.out_end = [-1.0] * n
        self.times = [[None] * len(row) for row in plan.schedule]
        # per position (start, end) of the host copy after it (an F's, an I's) and of the one before it (B, I, W)
        self.outs = [[None] * len(row) for row in plan.schedule]
        self.ins = [[None] * len(row) for row in plan.schedule]
        # per position: copy-out ms (F of an offloading stage, I of an offload_w one), copy-in ms (its B or I, its
        # W); 0 where none
        w = mc.copy_w_ms or (0.0,) * len(mc.copy_ms)
        self.cout = [[mc.copy_ms[a.stage] if a.kind is Kind.F else w[a.stage] if a.kind is Kind.I else 0.0
                      for a in row] for row in plan.schedule]
        self.cin = [[mc.copy_ms[a.stage] if a.kind in (Kind.B, Kind.I) else w[a.stage] if a.kind is Kind.W
                     else 0.0 for a in row] for row in plan.schedule]
        self.in_end = [[0.0] * len(row) for row in plan.schedule]

    def _copy(self, d: int, issue: float, ms: float) -> tuple[float, float]:
        st = max(issue, self.host_free[d])
        self.host_free[d] = st + ms
        return st, st + ms

    def _issue(self, d: int, p: int, rules, ids, start: float, end: float) -> None:
        """After action p of device d ran in [start, end]: its copy-out, and the copy-ins of the next unit."""
        row = rules[d]
        outs = []
        if self.cout[d][p]:
            outs.append((end, 0, p, ids[p]))
        if p > 0 and row[p - 1][9] is not None:  # a pair's second half: the pair's start issued the next unit's
            nxt = []
        else:
            first = p + 2 if row[p][9] is not None else p + 1  # after a pair: the unit after its second half
            nxt = [first] if first < len(row) else []
            if nxt and row[first][9] is not None:  # the next unit is a pair: both halves' copy-ins
                nxt.append(first + 1)
        ins = [q for q in nxt if self.cin[d][q]]
        # a copy-in of the micro-batch this F copies out waits for that copy-out; the others go in issue order
        after_out = [q for q in ins if outs and ids[q] == ids[p]]
        queue = outs + [(max(start, self.out_end[ids[q]]), 1, q, ids[q]) for q in ins if q not in after_out]
        queue = sorted(queue) + [(0.0, 1, q, ids[q]) for q in after_out]
        for issue, way, q, idx in queue:
            if way == 0:
                self.outs[d][q] = self._copy(d, issue, self.cout[d][q])
                self.out_end[idx] = self.outs[d][q][1]
            else:  # out_end holds the micro-batch's latest copy-out: F's for its B or I, I's for its W
                self.ins[d][q] = self._copy(d, max(issue, self.out_end[idx]), self.cin[d][q])
                self.in_end[d][q] = self.ins[d][q][1]

    def _prepare(self, rules) -> None:
        self._rules_partner = [[r[9] is not None for r in row] for row in rules]

    def _held(self, d: int, p: int, ready_at: float, paired: bool) -> float:
        """A copy-in still running holds the backward (and the pair it is in) back: the device's own wait."""
        in_end = self.in_end[d]
        copy_in = max(in_end[p], in_end[p + 1] if paired else 0.0)
        return copy_in if copy_in > ready_at else ready_at

    def _ran(self, d: int, p: int, rules, ids, start: float, end: float) -> None:
        self.times[d][p] = (start, end)
        self._issue(d, p, rules, ids, start, end)

    def _unit_times(self, d: int) -> list:
        """Each action's (start, end), a pair's second half over the whole pair (as it shows and holds memory)."""
        times = list(self.times[d])
        for p, r in enumerate(self._rules_partner[d]):
            if r:
                times[p + 1] = times[p]
        return times

    def peaks(self) -> list[int]:
        """Per device, the peak live activation of its timed memory events."""
        return [timed_peak(choice_events(row, self._unit_times(d), self.mc, self.outs[d], self.ins[d])[0])
                for d, row in enumerate(self.plan.schedule)]

    def host_peaks(self) -> list[int]:
        """Per device, the peak of the host memory its offloaded activations hold."""
        return [timed_peak(choice_events(row, self._unit_times(d), self.mc, self.outs[d], self.ins[d])[1])
                for d, row in enumerate(self.plan.schedule)]

    def copies_detail(self) -> list:
        """(device, 'out' / 'in', action, start, end) of every host copy."""
        out = []
        for d, row in enumerate(self.plan.schedule):
            for a, co, ci in zip(row, self.outs[d], self.ins[d]):
                out += [(d, way, a, cp[0], cp[1]) for way, cp in (("in", ci), ("out", co)) if cp is not None]
        return out


def _finish(plan, sc: StageCosts, run: _Run, peak_act: list[int], host_peak=None, host_copies=()) -> SimResult:
    nd = plan.num_devices
    step = max(run.free) if run.free else 0.0
    total = sum(run.busy)
    bubble = 1.0 - total / (step * nd) if step > 0 else 0.0
    static = sc.device_state(plan.stages, nd)
    return SimResult(
        step_time_ms=step,
        bubble_ratio=bubble,
        busy_ms=run.busy,
        peak_memory_bytes=[static[d] + peak_act[d] for d in range(nd)],
        static_bytes=static,
        peak_activation_bytes=peak_act,
        timeline=run.timeline if run.detail else [[] for _ in range(nd)],
        transfers=run.transfers if run.detail else [],
        critical_path=_critical_path(plan, run) if run.detail else [],
        stage_activation=sc.activation,
        host_peak_bytes=host_peak,
        host_copies=list(host_copies),
    )


def _critical_path(plan, run: _Run) -> list[tuple[int, Action]]:
    """Walk back from the last action to t = 0 through whichever input or device bound each start."""
    sched, times, nm, ns = plan.schedule, run.timeline, plan.num_microbatches, plan.num_stages
    dev_of = [st.device for st in plan.stages]
    ends = [(row[-1][2], d) for d, row in enumerate(times) if row]
    if not ends:
        return []
    _, d = max(ends)
    i = len(times[d]) - 1
    path = []
    while True:
        a = sched[d][i]
        path.append((d, a))
        slot = run.bound[d][i]
        if slot == -1:
            if i == 0:
                break
            i -= 1
            continue
        if slot >= _SLOTS:  # a pair's start, bound by its second half's input
            a, slot = sched[d][i + 1], slot - _SLOTS
        s, idx = a.stage, a.stage * nm + a.microbatch
        if slot < _NK:  # its own earlier action, on this device
            i = run.at[slot][idx]
            continue
        flow = Flow.ACT if slot == _ACT else Flow.GRAD
        src = s - flow.step
        if not 0 <= src < ns:
            break
        d, i = dev_of[src], run.sent_at[flow][idx - flow.step * nm]
    path.reverse()
    return path


_WAIT_TEXT = {
    **{CODE[k]: f"its own {RULES[k].noun} {{s}}{k.value}{{m}}" for k in KINDS},
    _ACT: "the activation for {a} (from {p}" + "/".join(k.value for k in senders(Flow.ACT)) + "{m})",
    _GRAD: "the output gradient for {a} (from stage {q})",
}


def _raise_deadlock(plan, pos, waiting) -> None:
    """Name every stuck device, its action and what it waits for, and draw the grid marked."""
    waits = {d: key % _SLOTS for key, d in waiting.items()}
    stuck = {}
    for d, row in enumerate(plan.schedule):
        if pos[d] >= len(row):
            continue
        a = row[pos[d]]
        text = _WAIT_TEXT.get(waits.get(d), "an input that never arrives").format(
            a=a, p=a.stage - 1, m=a.microbatch, s=a.stage, q=a.stage + 1)
        stuck[d] = f"device {d} stuck at {a} (action {pos[d]}), waiting for {text}"
    grid = _stuck_grid(plan.schedule, pos)
    raise DeadlockError("plan deadlocks:\n  " + "\n  ".join(stuck.values()) + "\n" + grid, stuck)
