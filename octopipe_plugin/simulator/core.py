"""Event-driven simulation of a plan under the reference semantics of FORMATS.md, plus switches.

Each device runs its list in order; a device blocked on a missing input parks on that
input's key and is woken when the producer ends, so every action is visited a bounded
number of times (the tuner calls this thousands of times). The schedule is first compiled
into plain integer tuples so the hot loop touches no enums, dataclasses or dicts of objects.

Switches (all off = FORMATS.md exactly):
- contention: one transfer at a time per (src, dst) link direction, in the sender's production
  order (the per-pair message order of schedules/messages.py).
- overlap=False: a device cannot compute while it moves data. The sender is busy for the
  transfer right after the producing action; the receiver is busy for the transfer time right
  before the consuming action, which cannot start before the data has arrived.
- launch_ms: a fixed cost added to every cross-device message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import DeadlockError
from ..schedules.actions import Action, Kind, render_grid
from .costs import StageCosts, stage_costs


@dataclass(frozen=True, kw_only=True, slots=True)
class SimOptions:
    """Refinements over the reference semantics; all off reproduces FORMATS.md exactly."""

    contention: bool = False  # one transfer at a time per (src, dst) link direction
    overlap: bool = True  # False: each device spends every send and receive on its own timeline
    launch_ms: float = 0.0  # fixed cost added to every cross-device message


class Transfer(NamedTuple):
    """One simulated message between devices, sent when `producer` ended.

    A NamedTuple rather than a frozen dataclass: a detailed 16x64x2 simulation makes about
    4000 of these, and a tuple is built several times faster.
    """

    src: int
    dst: int
    start: float
    end: float
    producer: Action

    @property
    def label(self) -> str:
        """'act 3F12' for an activation, 'grad 4I7' for a gradient."""
        return f"{'act' if self.producer.kind is Kind.F else 'grad'} {self.producer}"


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Timing and memory of a simulated plan."""

    step_time_ms: float
    bubble_ratio: float
    busy_ms: list[float]
    peak_memory_bytes: list[int]
    static_bytes: list[int]
    peak_activation_bytes: list[int]
    # per device: (action, start, end) in run order
    timeline: list[list[tuple[Action, float, float]]]
    transfers: list[Transfer] = field(default_factory=list)
    critical_path: list[tuple[int, Action]] = field(default_factory=list)
    stage_activation: tuple[int, ...] = ()

    @property
    def idle_ms(self) -> list[float]:
        """Per-device idle time within the step."""
        return [self.step_time_ms - b for b in self.busy_ms]

    @property
    def utilisation(self) -> list[float]:
        """Per-device share of the step spent computing."""
        step = self.step_time_ms
        return [b / step if step > 0 else 0.0 for b in self.busy_ms]

    def memory_curve(self, device: int, activation: tuple[int, ...] | None = None) -> list[tuple[float, int]]:
        """(time, bytes) steps of one device's memory: static plus live activations."""
        act = self.stage_activation if activation is None else activation
        cur = self.static_bytes[device]
        pts = [(0.0, cur)]
        for a, start, end in self.timeline[device]:
            if a.kind is Kind.F:
                cur += act[a.stage]
                pts.append((start, cur))
            elif a.kind in (Kind.B, Kind.W):
                cur -= act[a.stage]
                pts.append((end, cur))
        return pts

    def summary(self) -> dict:
        """The `predicted` block of a plan file."""
        return {
            "step_time_ms": round(self.step_time_ms, 6),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
        }


_CODE = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}
# What a parked device waits for: slot of the key `index * 4 + slot`.
_ACT, _OWN_F, _OWN_I, _GRAD = 0, 1, 2, 3


def _compile(schedule, nm: int, sc: StageCosts) -> list[list[tuple[int, int, int, float]]]:
    """Each device's actions as (kind code, stage * m + micro-batch, stage, duration)."""
    dur = (sc.fwd, tuple(b + w for b, w in zip(sc.bwd, sc.wgrad)), sc.bwd, sc.wgrad)
    code = _CODE
    out = []
    for row in schedule:
        rows = []
        for a in row:
            k, s = code[a.kind], a.stage
            rows.append((k, s * nm + a.microbatch, s, dur[k][s]))
        out.append(rows)
    return out


def _compile_encoded(encoded, nm: int, sc: StageCosts) -> list[list[tuple[int, int, int, float]]]:
    """`_compile` for rows kept as (stage, kind code, micro-batch) integer arrays (kind codes as in _CODE)."""
    import numpy as np  # only long, tuner-grown schedules come encoded

    dur = np.array([sc.fwd, [b + w for b, w in zip(sc.bwd, sc.wgrad)], sc.bwd, sc.wgrad], dtype=float)
    out = []
    for e in encoded:
        s, k = e[:, 0], e[:, 1]
        out.append(list(zip(k.tolist(), (s * nm + e[:, 2]).tolist(), s.tolist(), dur[k, s].tolist())))
    return out


def _hops(cluster, dev_of: list[int], output: tuple[int, ...], launch_ms: float) -> list[float]:
    """Transfer time across each stage boundary s -> s+1; -1 where both stages share a device."""
    out = []
    for s in range(len(dev_of) - 1):
        a, b = dev_of[s], dev_of[s + 1]
        out.append(-1.0 if a == b else cluster.transfer_ms(a, b, output[s]) + launch_ms)
    return out


def simulate(model, cluster, plan, options: SimOptions | None = None, *, costs: StageCosts | None = None,
             detail: bool = True) -> SimResult:
    """Simulate `plan`; raises DeadlockError when some device can never proceed.

    `detail=False` skips the timeline, transfers and critical path (for search loops).
    """
    opts = options or SimOptions()
    sc = costs if costs is not None else stage_costs(model, plan.stages)
    nm, nd = plan.num_microbatches, plan.num_devices
    dev_of = [st.device for st in plan.stages]
    encoded = getattr(plan.schedule, "encoded", None)
    rows = _compile(plan.schedule, nm, sc) if encoded is None else _compile_encoded(encoded, nm, sc)
    hop = _hops(cluster, dev_of, sc.output, opts.launch_ms)
    run = _Run(nd, len(dev_of) * nm, nm, opts, detail)
    # the action objects are read only to record transfers (detail); an encoded schedule stays encoded
    run.execute(rows, dev_of, hop, plan.schedule if detail or encoded is None else rows)
    if any(run.pos[d] < len(rows[d]) for d in range(nd)):
        _raise_deadlock(plan, run.pos, run.waiting)
    return _finish(plan, sc, run, _peak_activation(rows, sc.activation))


def detailed(model, cluster, plan, options: SimOptions | None = None, result: SimResult | None = None) -> SimResult:
    """`result` when it carries a timeline, else a detailed simulation of `plan` (for the pictures)."""
    if result is not None and any(result.timeline):
        return result
    return simulate(model, cluster, plan, options)


class _Run:
    """Mutable state of one simulation; `execute` is the hot loop."""

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
        # detail: position in its device's list of each F, and of each B or I, by stage * m + mb
        self.f_at = [0] * n if detail else None
        self.b_at = [0] * n if detail else None
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
        if a.kind is Kind.F:
            self.f_at[idx] = p
        elif a.kind is not Kind.W:
            self.b_at[idx] = p

    def execute(self, rows, dev_of: list[int], hop: list[float], schedule) -> None:
        """Run every device as far as its inputs allow; parked devices wake when their input lands."""
        nm, n, ns = self.nm, self.n, len(dev_of)
        act_arr = [0.0] * nm + [-1.0] * (n - nm)  # stage 0 has its inputs at t = 0
        grad_arr = [-1.0] * (n - nm) + [0.0] * nm  # the last stage makes its own gradient
        f_end, i_end = [-1.0] * n, [-1.0] * n
        recv = None if self.opts.overlap else [0.0] * (2 * n)
        free, busy, pos, waiting, timeline = self.free, self.busy, self.pos, self.waiting, self.timeline
        ready = list(range(len(rows)))
        while ready:
            d = ready.pop()
            row, acts, p, t_free, end_p = rows[d], schedule[d], pos[d], free[d], len(rows[d])
            while p < end_p:
                code, idx, s, dur = row[p]
                if code == 0:
                    dep, slot = act_arr[idx], _ACT
                    if dep < 0:
                        waiting[idx * 4] = d
                        break
                    rc = recv[idx] if recv is not None else 0.0
                elif code == 3:
                    dep, slot = i_end[idx], _OWN_I
                    if dep < 0:
                        waiting[idx * 4 + 2] = d
                        break
                    rc = 0.0
                else:
                    t_f, t_g = f_end[idx], grad_arr[idx]
                    if t_f < 0 or t_g < 0:
                        waiting[idx * 4 + (_OWN_F if t_f < 0 else _GRAD)] = d
                        break
                    dep, slot = (t_f, _OWN_F) if t_f >= t_g else (t_g, _GRAD)
                    rc = recv[n + idx] if recv is not None else 0.0
                ready_at = t_free + rc
                start = ready_at if ready_at >= dep else dep
                end = start + dur
                busy[d] += dur
                if timeline is not None:
                    self.record(d, p, acts[p], start, end, -1 if ready_at >= dep and p > 0 else slot)
                t_free = free[d] = end
                if code == 0:
                    f_end[idx] = end
                    w = waiting.pop(idx * 4 + 1, None)
                    if w is not None:
                        ready.append(w)
                    if s + 1 < ns:
                        nxt, h = idx + nm, hop[s]
                        if h < 0:
                            act_arr[nxt] = end
                        else:
                            act_arr[nxt] = self.send(end, d, dev_of[s + 1], h, acts[p])
                            if recv is not None:
                                recv[nxt] = h
                            t_free = free[d]
                        w = waiting.pop(nxt * 4, None)
                        if w is not None:
                            ready.append(w)
                elif code != 3:
                    if code == 2:
                        i_end[idx] = end
                        w = waiting.pop(idx * 4 + 2, None)
                        if w is not None:
                            ready.append(w)
                    if s > 0:
                        prv, h = idx - nm, hop[s - 1]
                        if h < 0:
                            grad_arr[prv] = end
                        else:
                            grad_arr[prv] = self.send(end, d, dev_of[s - 1], h, acts[p])
                            if recv is not None:
                                recv[n + prv] = h
                            t_free = free[d]
                        w = waiting.pop(prv * 4 + 3, None)
                        if w is not None:
                            ready.append(w)
                p += 1
            pos[d] = p


def _finish(plan, sc: StageCosts, run: _Run, peak_act: list[int]) -> SimResult:
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
    )


def _peak_activation(rows, activation: tuple[int, ...]) -> list[int]:
    """Peak live activation bytes per device; a device's own order already sorts its events in time."""
    out = []
    for row in rows:
        cur = peak = 0
        for code, _, s, _ in row:
            if code == 0:
                cur += activation[s]
                if cur > peak:
                    peak = cur
            elif code & 1:  # B, or W (which ends a split backward); I keeps the activation
                cur -= activation[s]
        out.append(peak)
    return out


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
        s, idx = a.stage, a.stage * nm + a.microbatch
        if slot == _ACT:
            if s == 0:
                break
            d, i = dev_of[s - 1], run.f_at[idx - nm]
        elif slot == _OWN_F:
            i = run.f_at[idx]
        elif slot == _OWN_I:
            i = run.b_at[idx]
        elif s + 1 < ns:
            d, i = dev_of[s + 1], run.b_at[idx + nm]
        else:
            break
    path.reverse()
    return path


_WAIT_TEXT = {_ACT: "the activation for {a} (from {p}F{m})", _OWN_F: "its own forward {s}F{m}",
              _OWN_I: "its own input-gradient {s}I{m}", _GRAD: "the output gradient for {a} (from stage {q})"}


def _raise_deadlock(plan, pos, waiting) -> None:
    """Name every stuck device, its action and what it waits for, and draw the grid marked."""
    waits = {d: key % 4 for key, d in waiting.items()}
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


def _stuck_grid(schedule, pos, before: int = 6, after: int = 6) -> str:
    """The schedule as a grid, each device's row cut to a window around where it stopped."""
    rows, mark = [], {}
    for d, row in enumerate(schedule):
        lo = max(0, pos[d] - before)
        cells = [str(a) for a in row[lo:pos[d] + after]]
        if lo > 0:
            cells.insert(0, f"..{lo}")
        if pos[d] + after < len(row):
            cells.append(f"+{len(row) - pos[d] - after}")
        if pos[d] < len(row):
            mark[d] = pos[d] - lo + (lo > 0)
        rows.append(cells)
    return render_grid(rows, mark=mark)
