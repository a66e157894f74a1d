"""Simulation of plans with split layers (docs/formats.md, "Split layers"), under the reference semantics.

A split layer's work leaves its owner stage and runs as shard actions (H, J, K of the LM head;
E, G of the embedding) on every shard device, each at its share of the layer's costs. What a
shard action waits for and what it hands on is read from the kind table (`actions.RULES`:
`after`, `takes`, `peer`, `gives`), the stage kinds keep their table rules, and every
cross-device hand-over costs `hop_times` (stage to stage) or the cluster's transfer time of its
bytes plus the launch cost (to and from shards). Plans without splits never come here:
`simulate` runs them through the compiled loop of core.py, unchanged.

Every action is a node with a list of (producer, delay); a device runs its list in order and
parks on the first producer that has not ended, as in core.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..actions import RULES, Action, Kind, pair_positions
from ..errors import DeadlockError, PlanError
from ..formats.model import microbatch_tokens
from ..schedules.split_messages import SIDE_OF
from ..formats.splits import SHARE_TOLERANCE, SplitLayer, check_model_splits, loss_terms_bytes, owner_stage, side_of
from .costs import StageCosts, hop_times, in_flight_ms, kind_durations, memory_costs, stage_costs
from .overheads import delivery_of, overhead_ms, split_message_ms
from .memory import activation_changes, recompute_steps
from .pairs import pair_ms, stage_phases
from .result import SimResult, Transfer, stuck_grid as _stuck_grid

GRAD = "grad"  # key prefix of a stage's input gradient, made by its B or its I (whichever the plan runs)
TOKENS = "tokens"  # key of a split embedding's token ids on a shard device, (TOKENS, device): sent before the step
TOKEN_BYTES_PER_TOKEN = 8  # the token ids travel as int64 (executor/token_exchange.py)
VERDICT_BYTES = 8  # stage 0's refusal length (0: none), broadcast to every rank before the token ids


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitCosts:
    """One split layer's figures: its owner stage, per-shard costs and the bytes its messages carry."""

    split: SplitLayer
    side: str  # "output" (LM head) or "input" (embedding)
    owner: int  # stage that owns the layer
    fwd: float
    bwd: float
    wgrad: float
    state: int
    activation: int
    link_bytes: int  # owner <-> shard messages: the head's input and its gradient / the embedding's output and its gradient
    token_bytes: int = 0  # the embedding: one micro-batch's token ids (int64), sent before the step; 0 for the head

    def duration(self, kind: Kind, device: int) -> float:
        """The shard action's time on `device`: the table's cost fields of the layer times the device's share."""
        share = self.split.share_of(device)
        return share * sum(getattr(self, name) for name in RULES[kind].cost)

    def live(self, kind: Kind, device: int) -> int:
        """Signed change of the device's live bytes when the shard action runs (its share of the activation)."""
        return RULES[kind].activation * int(round(self.split.share_of(device) * self.activation))


def without_split_layers(model, splits):
    """The model with the split layers' costs, state and activation taken out (what their owner stages keep)."""
    if not splits:
        return model
    idx = {sp.layer for sp in splits}
    layers = tuple(l.scaled(0.0, state_bytes=0, activation_bytes=0, phases=())
                   if i in idx else l for i, l in enumerate(model.layers))
    return replace(model, layers=layers)


def link_bytes(model, layer: int) -> int:
    """Bytes between a split layer's owner and its shards: the head's input, or the embedding's output."""
    if layer == 0:
        return model.layers[0].output_bytes
    if model.inputs:
        from ..graph import boundary_bytes  # what crosses the cut before the last layer of a branched model

        return boundary_bytes(model)[layer]
    return model.layers[layer - 1].output_bytes


def message_bytes(c: SplitCosts, what: str) -> int:
    """Bytes of one split message of kind `what` (schedules.split_messages.WHATS; docs/formats.md, "Split layers",
    Messages): the statistics `stats_bytes`; the head's input the hidden states plus their loss terms
    (`formats.splits.loss_terms_bytes`); every other one (partials, the embedding's output gradient) `link_bytes`."""
    if what == "stats":
        return c.split.stats_bytes
    if what == "head-input":
        return c.link_bytes + loss_terms_bytes(c.split)
    return c.link_bytes


def gather_ms(cluster, devices, nbytes: int, launch_ms: float = 0.0, delivery=None, overheads=None) -> float:
    """The statistics' all-gather over `devices` (sorted: the group's rank order) once its last member has posted;
    0 over one device. On the links n - 1 rounds (NCCL's ring; gloo's all_to_all puts as many parts on each
    sender's link), each its slowest neighbour hop of one shard's `nbytes` with its in-flight costs. On the host
    (`overheads`, formats.overheads.Overheads): the collective's own cost, measured at two members
    (`gather_round`), plus one send of each further member's part (`send`): gloo's at 2 to 15 ranks on 2 cores,
    scaled by ranks per core, within ~25% of 0.62 ms at 4 ranks and 4.5 ms at 15 (lower quartiles)."""
    ring = sorted(devices)
    if len(ring) < 2:
        return 0.0
    hop = max(cluster.transfer_ms(a, b, nbytes) for a, b in zip(ring, ring[1:] + ring[:1]))
    host = 0.0 if overheads is None else overheads.gather_round.ms(nbytes) + (len(ring) - 2) * overheads.send.ms(nbytes)
    return (len(ring) - 1) * (hop + in_flight_ms(launch_ms, delivery, nbytes)) + host


def split_costs(model, plan) -> list[SplitCosts]:
    """The figures of every split layer of `plan`; unit costs and no bytes without a model (deadlock checks)."""
    out = []
    n = plan.stages[-1].end
    for sp in plan.splits:
        side = side_of(sp, n)
        owner = owner_stage(sp, plan.stages)
        if model is None:
            out.append(SplitCosts(split=sp, side=side, owner=owner, fwd=1.0, bwd=1.0, wgrad=1.0, state=0,
                                  activation=0, link_bytes=0))
            continue
        lay = model.layers[sp.layer]
        tokens = TOKEN_BYTES_PER_TOKEN * microbatch_tokens(model) if side == "input" else 0
        out.append(SplitCosts(split=sp, side=side, owner=owner, fwd=lay.fwd_ms, bwd=lay.bwd_ms, wgrad=lay.wgrad_ms,
                              state=lay.state_bytes, activation=lay.activation_bytes,
                              link_bytes=link_bytes(model, sp.layer), token_bytes=tokens))
    return out


def shard_state(model, splits: list[SplitCosts], num_devices: int) -> list[int]:
    """Per device, the state bytes of the split-layer shards it holds (docs/formats.md, "Split layers", Memory).

    `round(share x state_bytes)` of every split layer; a tied pair of split layers (`Model.tied`) over
    the same devices in the same shares holds one weight per row range: `round(share x max of the two)`.
    """
    out = [0] * num_devices
    once = _tied_once(model, splits)
    for c in splits:
        other = once.get(c.split.layer, 0)
        if other is None:
            continue  # the second of a tied pair: the first counts the shared rows
        state = max(c.state, other)
        for d, share in zip(c.split.devices, c.split.shares):
            out[d] += int(round(share * state))
    return out


def _tied_once(model, splits: list[SplitCosts]) -> dict[int, int | None]:
    """Tied split pairs on the same devices and shares: {first layer: the second's state, second: None}."""
    if model is None or not getattr(model, "tied", ()):
        return {}
    by_layer = {c.split.layer: c for c in splits}
    out = {}
    for a, b in model.tied:
        ca, cb = by_layer.get(a), by_layer.get(b)
        if ca is None or cb is None:
            continue
        sa = dict(zip(ca.split.devices, ca.split.shares))
        sb = dict(zip(cb.split.devices, cb.split.shares))
        if sa.keys() == sb.keys() and all(abs(sa[d] - sb[d]) <= SHARE_TOLERANCE for d in sa):
            out[a], out[b] = cb.state, None
    return out


def check_split_options(options) -> None:
    """Split plans are simulated under the reference semantics plus the launch cost; refuse the other switches."""
    if options.contention or not options.overlap:
        raise PlanError("a plan with split layers is simulated under the reference semantics only "
                        "(fix: drop --contention / --no-overlap, launch_ms is allowed)")


class SplitGraph:
    """Each device's actions with their (producer key, delay) lists, durations and memory changes."""

    def __init__(self, cluster, plan, sc: StageCosts, splits: list[SplitCosts], launch_ms: float, extra=None,
                 delivery=None, overheads=None, mc=None):
        # delivery: the busy sender's in-flight delay (formats.overheads.MessageCost), charged as hop_times does
        self.plan, self.cluster, self.launch, self.delivery = plan, cluster, launch_ms, delivery
        self.mc = mc  # the plan's recompute choices (simulator.costs.MemoryCosts), None without
        self.dev_of = [st.device for st in plan.stages]
        self.ns = len(self.dev_of)
        self.hop = hop_times(cluster, self.dev_of, sc.output, launch_ms, delivery)
        self.dur = kind_durations(sc, extra)  # extra: the stage actions' host overheads (simulator/overheads.py)
        # a shard action's own host cost (Overheads.action of its kind; it sends no stage message)
        self.shard_host = {k: extra[k][0] for k in extra if RULES[k].side is not None} if extra else {}
        self.change = activation_changes(sc.activation)
        self.by_side = {c.side: c for c in splits}
        # the split messages' host costs on the actions that send and take them (simulator/overheads.py)
        self.host = split_message_ms(overheads, plan,
                                     lambda msg: message_bytes(self.by_side[SIDE_OF[msg.what]], msg.what))
        head = self.by_side.get("output")
        self.gather = (0.0 if head is None else  # the statistics' all-gather, after the last shard's H
                       gather_ms(cluster, head.split.devices, message_bytes(head, "stats"), launch_ms, delivery,
                                 overheads))
        self.ready, self.preset = self._before_step()

    def _before_step(self) -> tuple[list[float], dict]:
        """When each device starts its list, and the token ids' arrival on each embedding shard ((TOKENS, d) -> ms).

        Under a split embedding stage 0's rank reads the step's batches ahead (the read costs nothing here, as
        each F's read does in every plan), broadcasts whether it refused them (VERDICT_BYTES; every rank starts
        its step on that), then sends the m micro-batches' token ids to each other shard device, one blocking
        message after another in `devices` order; its own list starts after the last."""
        nd = self.plan.num_devices
        c = self.by_side.get("input")
        if c is None:
            return [0.0] * nd, {}
        own = self.dev_of[0]
        ready = [self.move(own, d, VERDICT_BYTES) for d in range(nd)]
        nbytes, t, preset = self.plan.num_microbatches * c.token_bytes, 0.0, {}
        for d in c.split.devices:
            if d != own:
                t += self.move(own, d, nbytes)
            preset[(TOKENS, d)] = t if d != own else 0.0
        ready[own] = t
        return ready, preset

    def move(self, src: int, dst: int, nbytes: int) -> float:
        """A hand-over's delay: nothing on one device, else the link time of its bytes plus the in-flight costs."""
        return 0.0 if src == dst else self.cluster.transfer_ms(src, dst, nbytes) + in_flight_ms(
            self.launch, self.delivery, nbytes)

    def key(self, a: Action, d: int):
        """What other actions wait on: (kind, stage, mb), shard actions with their device; B/I also as the gradient."""
        return (a.kind, a.stage, a.microbatch, d) if RULES[a.kind].side is not None else (a.kind, a.stage, a.microbatch)

    def deps(self, a: Action, d: int) -> list[tuple[tuple, float]]:
        """(producer key, delay) of everything `a` on device d waits for."""
        rule = RULES[a.kind]
        if rule.side is not None:
            return self._shard_deps(a, d, rule)
        s, m, out = a.stage, a.microbatch, []
        if rule.after is not None:
            out.append(((rule.after, s, m), 0.0))
        if rule.receives is not None:
            src = s - rule.receives.step
            if 0 <= src < self.ns:
                h = self.hop[min(s, src)]
                key = (Kind.F, src, m) if rule.receives.step > 0 else (GRAD, src, m)
                out.append((key, 0.0 if h is None else h))
            else:
                out += self._from_shards(a, d, rule)
        return out

    def _from_shards(self, a: Action, d: int, rule) -> list:
        """A pipeline end fed by a split layer: stage 0's F sums the embedding partials, the last B/I the head's."""
        side = "input" if rule.receives.step > 0 else "output"
        c = self.by_side.get(side)
        if c is None or a.stage != c.owner:
            return []
        givers = [k for k, r in RULES.items() if r.side == side and r.gives == "owner"]
        nbytes = message_bytes(c, "head-partial" if side == "output" else "embedding-partial")
        return [((k, c.owner, a.microbatch, e), self.move(e, d, nbytes)) for k in givers for e in c.split.devices]

    def _shard_deps(self, a: Action, d: int, rule) -> list:
        c = self.by_side[rule.side]
        m, out = a.microbatch, []
        if rule.after is not None:
            out.append(((rule.after, c.owner, m, d), 0.0))
        elif rule.side == "input":  # E: the micro-batch's token ids, sent by stage 0's rank before the step
            out.append(((TOKENS, d), 0.0))
        own = self.dev_of[c.owner]
        if rule.takes == "owner":
            key = (Kind.F, c.owner, m) if rule.side == "output" else (GRAD, c.owner, m)
            out.append((key, self.move(own, d, message_bytes(c, "head-input" if rule.side == "output"
                                                              else "embedding-grad"))))
        elif rule.takes == "peers":  # one all-gather of every shard's statistics (schedules.split_messages.StatsGather)
            out += [((rule.peer, c.owner, m, e), self.gather) for e in c.split.devices if e != d]
        return out

    def duration(self, a: Action, d: int) -> float:
        """Time of `a` on device d."""
        rule = RULES[a.kind]
        own = (self.dur[a.kind][a.stage] if rule.side is None
               else self.by_side[rule.side].duration(a.kind, d) + self.shard_host.get(a.kind, 0.0))
        return own + self.host.get((d, a), 0.0) if self.host else own

    def live(self, a: Action, d: int) -> int:
        """Change of device d's live activation bytes when `a` runs."""
        rule = RULES[a.kind]
        if rule.side is None:
            return self.change[a.kind][a.stage] if self.mc is None else sum(recompute_steps(a.kind, a.stage, self.mc))
        return self.by_side[rule.side].live(a.kind, d)

    def steps(self, a: Action, d: int) -> tuple[int, ...]:
        """The changes, in order, `a` makes to device d's live bytes (a B under recompute: what it brings back, then
        all freed), their sum `live`."""
        if self.mc is not None and RULES[a.kind].side is None:
            return recompute_steps(a.kind, a.stage, self.mc)
        return (self.live(a, d),)


def simulate_split(model, cluster, plan, options, *, costs: StageCosts | None = None, detail: bool = True):
    """Simulate a plan with split layers; raises DeadlockError when some device can never proceed."""
    check_split_options(options)
    if model is not None:
        check_model_splits(model, plan.splits)
    splits = split_costs(model, plan)
    sc = costs if costs is not None else stage_costs(without_split_layers(model, plan.splits), plan.stages)
    mc = None
    if model is not None and getattr(plan, "memory", ()):  # recompute choices (core.py refuses offload here)
        mc = memory_costs(without_split_layers(model, plan.splits), plan, cluster)
        sc = mc.apply(sc)
    g = SplitGraph(cluster, plan, sc, splits, options.launch_ms,
                   overhead_ms(options.overheads, [st.device for st in plan.stages], sc.output),
                   delivery_of(options.overheads), options.overheads, mc=mc)
    nd = plan.num_devices
    rows = [[(a, g.key(a, d), g.deps(a, d), g.duration(a, d)) for a in row] for d, row in enumerate(plan.schedule)]
    if plan.pairs:
        # without a model (the deadlock check's unit costs) a pair hides nothing
        _fold_pairs(rows, plan, None if model is None else
                    stage_phases(without_split_layers(model, plan.splits), plan.stages))
    done: dict = dict(g.preset)
    waiting: dict = {}
    free, busy, pos = list(g.ready), [0.0] * nd, [0] * nd
    timeline = [[] for _ in range(nd)] if detail else None
    bound = [[None] * len(row) for row in rows] if detail else None  # the input that set each start (None: the device)
    transfers = [] if detail else None
    ready = list(range(nd))
    while ready:
        d = ready.pop()
        row, p = rows[d], pos[d]
        while p < len(row):
            a, key, deps, dur = row[p]
            start, blocked, by = free[d], None, None
            for dep, delay in deps:
                t = done.get(dep)
                if t is None:
                    blocked = dep
                    break
                if t + delay > start:
                    start, by = t + delay, dep
            if blocked is not None:
                waiting.setdefault(blocked, []).append(d)
                break
            end = start + dur
            free[d], busy[d] = end, busy[d] + dur
            if timeline is not None:
                timeline[d].append((a, start, end))
                bound[d][p] = by
            woken = [key]
            if RULES[a.kind].sends is not None and RULES[a.kind].sends.step < 0:
                woken.append((GRAD, a.stage, a.microbatch))
            for k in woken:
                done[k] = end
                ready.extend(waiting.pop(k, ()))
            p += 1
        pos[d] = p
    if any(pos[d] < len(rows[d]) for d in range(nd)):
        _raise_deadlock(plan, rows, pos, waiting, _stuck_grid)
    critical = []
    if detail and plan.pairs:  # a pair's second half is shown over the whole pair, as its first
        for d, (row, starts) in enumerate(zip(plan.schedule, pair_positions(plan.schedule, plan.pairs))):
            for p in starts:
                timeline[d][p + 1] = (row[p + 1], timeline[d][p][1], timeline[d][p][2])
    if detail:
        transfers = _transfers(g, rows, done, Transfer)
        critical = _critical_path(rows, timeline, bound)
    static = [a + b for a, b in zip(sc.device_state(plan.stages, nd), shard_state(model, splits, nd))]
    peak_act = []
    for d, row in enumerate(plan.schedule):
        cur = peak = 0
        for a in row:
            for c in g.steps(a, d):
                cur += c
                peak = max(peak, cur)
        peak_act.append(peak)
    step = max(free) if free else 0.0
    bubble = 1.0 - sum(busy) / (step * nd) if step > 0 else 0.0
    return SimResult(step_time_ms=step, bubble_ratio=bubble, busy_ms=busy,
                     peak_memory_bytes=[static[d] + peak_act[d] for d in range(nd)], static_bytes=static,
                     peak_activation_bytes=peak_act, timeline=timeline if detail else [[] for _ in range(nd)],
                     transfers=transfers or [], critical_path=critical, stage_activation=sc.activation,
                     live_changes=[[g.live(a, d) for a, _, _ in row] for d, row in enumerate(timeline)]
                     if detail else None)


def _fold_pairs(rows, plan, phases) -> None:
    """An overlapped pair (simulator/pairs.py): its first half waits for both halves' inputs and takes the pair's
    time, its second half none, so both end together (core.py `_fold_pairs` is the same rule for the compiled loop)."""
    for d, (row, starts) in enumerate(zip(plan.schedule, pair_positions(plan.schedule, plan.pairs))):
        for p in starts:
            (a, ka, da, ta), (b, kb, db, tb) = rows[d][p], rows[d][p + 1]
            rows[d][p] = (a, ka, da + db, pair_ms(phases, a, b, ta, tb))
            rows[d][p + 1] = (b, kb, [], 0.0)


def _critical_path(rows, timeline, bound) -> list[tuple[int, Action]]:
    """Walk back from the last action to t = 0 through whichever input or device set each start."""
    ends = [(row[-1][2], d) for d, row in enumerate(timeline) if row]
    if not ends:
        return []
    where = {key: (d, p) for d, row in enumerate(rows) for p, (_, key, _, _) in enumerate(row)}
    _, d = max(ends, key=lambda t: (t[0], -t[1]))  # the lowest device on a tie
    p, path = len(rows[d]) - 1, []
    while True:
        path.append((d, rows[d][p][0]))
        by = bound[d][p]
        if by is not None and by[0] == TOKENS:  # the token ids sent at step start
            break
        if by is None:  # the device's own previous action (or t = 0) set the start
            if p == 0 or timeline[d][p][1] <= 0.0:
                break
            p -= 1
            continue
        if by[0] == GRAD:  # a stage's input gradient: its I, else its B
            by = (Kind.I, by[1], by[2]) if (Kind.I, by[1], by[2]) in where else (Kind.B, by[1], by[2])
        d, p = where[by]
    path.reverse()
    return path


def _transfers(g: SplitGraph, rows, done, transfer_type) -> list:
    """Every cross-device hand-over as a Transfer (for pictures and traces), from the dependency lists."""
    out = []
    where = {key: (d, a) for d, row in enumerate(rows) for a, key, _, _ in row}
    for d, row in enumerate(rows):
        for a, _, deps, _ in row:
            for dep, delay in deps:
                if dep[0] == GRAD:
                    src = where.get((Kind.I, dep[1], dep[2])) or where.get((Kind.B, dep[1], dep[2]))
                else:
                    src = where.get(dep)
                if src is None or src[0] == d or delay <= 0:
                    continue
                t = done[dep]
                out.append(transfer_type(src[0], d, t, t + delay, src[1]))
    return out


def _raise_deadlock(plan, rows, pos, waiting, stuck_grid) -> None:
    """Name every stuck device, its action and what it waits for, and draw the grid marked."""
    waits = {d: key for key, devs in waiting.items() for d in devs}
    stuck = {}
    for d, row in enumerate(rows):
        if pos[d] >= len(row):
            continue
        a = row[pos[d]][0]
        key = waits.get(d)
        stuck[d] = f"device {d} stuck at {a} (action {pos[d]}), waiting for {_name(key)}"
    raise DeadlockError("plan deadlocks:\n  " + "\n  ".join(stuck.values()) + "\n" + stuck_grid(plan.schedule, pos),
                        stuck)


def _name(key) -> str:
    """'1F3', 'the input gradient of stage 2 for micro-batch 3', '5H3 on device 4'."""
    if key is None:
        return "an input that never arrives"
    if key[0] == GRAD:
        return f"the input gradient of stage {key[1]} for micro-batch {key[2]} (its B or I)"
    text = f"{RULES[key[0]].noun} {Action(key[1], key[0], key[2])}"
    return text + (f" on device {key[3]}" if len(key) > 3 else "")


__all__ = ["SplitGraph", "simulate_split", "split_costs", "without_split_layers", "link_bytes", "shard_state",
           "message_bytes"]
