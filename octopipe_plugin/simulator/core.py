"""Event-driven simulation of a plan under the reference semantics of FORMATS.md, plus switches.

Each device runs its list in order; a device blocked on a missing input parks on that
input's key and is woken when the producer ends, so every action is visited a bounded
number of times (the tuner calls this thousands of times).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import DeadlockError
from ..schedules.actions import Action, Kind, render_grid
from .costs import StageCosts, stage_costs


@dataclass(frozen=True, kw_only=True, slots=True)
class SimOptions:
    """Refinements over the reference semantics; all off reproduces FORMATS.md exactly."""

    contention: bool = False  # one transfer at a time per (src, dst) link direction
    overlap: bool = True  # False: each device spends every send and receive on its own timeline
    launch_ms: float = 0.0  # fixed cost added to every cross-device message


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One simulated message between devices."""

    src: int
    dst: int
    start: float
    end: float
    label: str


@dataclass(kw_only=True)
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

    @property
    def idle_ms(self) -> list[float]:
        """Per-device idle time within the step."""
        return [self.step_time_ms - b for b in self.busy_ms]

    def memory_curve(self, device: int, activation: tuple[int, ...]) -> list[tuple[float, int]]:
        """(time, bytes) steps of one device's memory: static plus live activations."""
        cur = self.static_bytes[device]
        pts = [(0.0, cur)]
        for a, start, end in self.timeline[device]:
            if a.kind is Kind.F:
                cur += activation[a.stage]
                pts.append((start, cur))
            elif a.kind in (Kind.B, Kind.W):
                cur -= activation[a.stage]
                pts.append((end, cur))
        return pts

    def summary(self) -> dict:
        """The `predicted` block of a plan file."""
        return {
            "step_time_ms": round(self.step_time_ms, 6),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
        }


_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


def simulate(model, cluster, plan, options: SimOptions | None = None, *, costs: StageCosts | None = None,
             detail: bool = True) -> SimResult:
    """Simulate `plan`; raises DeadlockError when some device can never proceed.

    `detail=False` skips the timeline, transfers and critical path (for search loops).
    """
    opts = options or SimOptions()
    sc = costs if costs is not None else stage_costs(model, plan.stages)
    ns, nm, nd = plan.num_stages, plan.num_microbatches, plan.num_devices
    dev_of = [st.device for st in plan.stages]
    durations = {_F: sc.fwd, _I: sc.bwd, _W: sc.wgrad, _B: tuple(b + w for b, w in zip(sc.bwd, sc.wgrad))}
    # transfer cost per stage boundary: act[s] for s -> s+1, grad for s+1 -> s (same size)
    hop = [0.0] * ns
    for s in range(ns - 1):
        a, b = dev_of[s], dev_of[s + 1]
        if a != b:
            hop[s] = cluster.transfer_ms(a, b, sc.output[s]) + opts.launch_ms
    n = ns * nm
    act_arr = [-1.0] * n  # when stage s's F input for mb is on its device
    grad_arr = [-1.0] * n  # when stage s's B/I output-gradient for mb is on its device
    recv_cost = [0.0] * (2 * n) if not opts.overlap else None
    f_end = [-1.0] * n
    i_end = [-1.0] * n
    for mb in range(nm):
        act_arr[mb] = 0.0
        grad_arr[(ns - 1) * nm + mb] = 0.0
    link_free: dict[tuple[int, int], float] = {}
    free = [0.0] * nd
    pos = [0] * nd
    sched = plan.schedule
    lens = [len(r) for r in sched]
    waiting: dict[tuple[int, int], int] = {}  # (slot kind, index) -> device
    ready = deque(range(nd))
    queued = [True] * nd
    busy = [0.0] * nd
    timeline = [[] for _ in range(nd)] if detail else None
    transfers = [] if detail else None
    cause: dict = {} if detail else None
    last_done: dict = {} if detail else None

    def send(t_end: float, src: int, dst: int, cost: float) -> float:
        if opts.contention:
            key = (src, dst)
            st = max(t_end, link_free.get(key, 0.0))
            link_free[key] = st + cost
        else:
            st = t_end
        if not opts.overlap:
            free[src] = max(free[src], st + cost)
        if transfers is not None:
            transfers.append((src, dst, st, st + cost))
        return st + cost

    while ready:
        d = ready.popleft()
        queued[d] = False
        row = sched[d]
        p = pos[d]
        t_free = free[d]
        while p < lens[d]:
            a = row[p]
            s, mb, k = a.stage, a.microbatch, a.kind
            idx = s * nm + mb
            if k is _F:
                t_in = act_arr[idx]
                if t_in < 0:
                    waiting[(0, idx)] = d
                    break
                dep = t_in
                rc = recv_cost[idx] if recv_cost is not None else 0.0
            elif k is _W:
                dep = i_end[idx]
                if dep < 0:
                    waiting[(2, idx)] = d
                    break
                rc = 0.0
            else:
                t_f = f_end[idx]
                if t_f < 0:
                    waiting[(1, idx)] = d
                    break
                t_g = grad_arr[idx]
                if t_g < 0:
                    waiting[(3, idx)] = d
                    break
                dep = t_f if t_f > t_g else t_g
                rc = recv_cost[n + idx] if recv_cost is not None else 0.0
            start = t_free + rc if t_free + rc > dep else dep
            dur = durations[k][s]
            end = start + dur
            busy[d] += dur
            if cause is not None:
                cause[a] = (dep, t_free + rc)
                timeline[d].append((a, start, end))
            t_free = end
            free[d] = end
            if k is _F:
                f_end[idx] = end
                _wake(waiting, (1, idx), ready, queued)
                if s + 1 < ns:
                    nxt = idx + nm
                    h = hop[s]
                    if h or dev_of[s + 1] != d:
                        act_arr[nxt] = send(end, d, dev_of[s + 1], h)
                        if recv_cost is not None:
                            recv_cost[nxt] = h
                        t_free = free[d]
                    else:
                        act_arr[nxt] = end
                    _wake(waiting, (0, nxt), ready, queued)
            elif k is _W:
                pass
            else:
                if k is _I:
                    i_end[idx] = end
                    _wake(waiting, (2, idx), ready, queued)
                if s > 0:
                    prv = idx - nm
                    h = hop[s - 1]
                    if dev_of[s - 1] != d:
                        grad_arr[prv] = send(end, d, dev_of[s - 1], h)
                        if recv_cost is not None:
                            recv_cost[n + prv] = h
                        t_free = free[d]
                    else:
                        grad_arr[prv] = end
                    _wake(waiting, (3, prv), ready, queued)
            p += 1
        pos[d] = p
    if any(pos[d] < lens[d] for d in range(nd)):
        _raise_deadlock(plan, pos, waiting)
    return _finish(plan, sc, free, busy, timeline, transfers, cause, detail)


def _wake(waiting: dict, key, ready: deque, queued: list) -> None:
    d = waiting.pop(key, None)
    if d is not None and not queued[d]:
        queued[d] = True
        ready.append(d)


def _finish(plan, sc: StageCosts, free, busy, timeline, transfers, cause, detail) -> SimResult:
    nd = plan.num_devices
    step = max(free) if free else 0.0
    total = sum(busy)
    bubble = 1.0 - total / (step * nd) if step > 0 else 0.0
    static = sc.device_state(plan.stages, nd)
    peak_act = _peak_activation(plan, sc)
    res = SimResult(
        step_time_ms=step,
        bubble_ratio=bubble,
        busy_ms=busy,
        peak_memory_bytes=[static[d] + peak_act[d] for d in range(nd)],
        static_bytes=static,
        peak_activation_bytes=peak_act,
        timeline=timeline or [[] for _ in range(nd)],
    )
    if detail:
        res.transfers = [Transfer(src=s, dst=d, start=a, end=b, label="") for s, d, a, b in transfers]
        res.critical_path = _critical_path(plan, timeline, cause)
    return res


def _peak_activation(plan, sc: StageCosts) -> list[int]:
    """Peak live activation bytes per device; a device's own order already sorts its events in time."""
    act = sc.activation
    out = []
    for d, row in enumerate(plan.schedule):
        split = {(a.stage, a.microbatch) for a in row if a.kind is _W}
        cur = peak = 0
        for a in row:
            k = a.kind
            if k is _F:
                cur += act[a.stage]
                if cur > peak:
                    peak = cur
            elif k is _B or (k is _W and (a.stage, a.microbatch) in split):
                cur -= act[a.stage]
        out.append(peak)
    return out


def _critical_path(plan, timeline, cause) -> list[tuple[int, Action]]:
    """Walk back from the last action through whichever input bound each start."""
    where = {}
    for d, row in enumerate(timeline):
        for i, (a, st, en) in enumerate(row):
            where[a] = (d, i)
    best = None
    for d, row in enumerate(timeline):
        if row and (best is None or row[-1][2] > timeline[best][-1][2]):
            best = d
    path = []
    if best is None:
        return path
    d, i = best, len(timeline[best]) - 1
    nm, ns = plan.num_microbatches, plan.num_stages
    while True:
        a, start, _ = timeline[d][i]
        path.append((d, a))
        dep, dev_ready = cause[a]
        if start <= 0:
            break
        if dev_ready >= dep and i > 0:
            i -= 1
            continue
        prev = _producer(a, where, ns)
        if prev is None:
            if i == 0:
                break
            i -= 1
            continue
        d, i = where[prev]
    path.reverse()
    return path


def _producer(a: Action, where: dict, ns: int) -> Action | None:
    s, mb = a.stage, a.microbatch
    if a.kind is _F:
        return Action(s - 1, _F, mb) if s > 0 else None
    if a.kind is _W:
        return Action(s, _I, mb)
    if s + 1 < ns:
        b = Action(s + 1, _B, mb)
        return b if b in where else Action(s + 1, _I, mb)
    return Action(s, _F, mb)


_WAIT_TEXT = {0: "the activation for {a} (from stage {p}F{m})", 1: "its own forward {s}F{m}",
              2: "its own input-gradient {s}I{m}", 3: "the output gradient for {a} (from stage {q})"}


def _raise_deadlock(plan, pos, waiting) -> None:
    waits = {d: key for key, d in waiting.items()}
    nm = plan.num_microbatches
    stuck = {}
    for d, row in enumerate(plan.schedule):
        if pos[d] >= len(row):
            continue
        a = row[pos[d]]
        slot = waits.get(d, (None, 0))[0]
        text = _WAIT_TEXT.get(slot, "an input that never arrives").format(
            a=a, p=a.stage - 1, m=a.microbatch, s=a.stage, q=a.stage + 1)
        stuck[d] = f"device {d} stuck at {a} (action {pos[d]}), waiting for {text}"
    grid = render_grid(plan.schedule, mark={d: pos[d] for d in stuck}, width=40)
    del nm
    raise DeadlockError("plan deadlocks:\n  " + "\n  ".join(stuck.values()) + "\n" + grid, stuck)
