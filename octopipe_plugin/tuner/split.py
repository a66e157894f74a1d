"""The tuner decides on split layers: whether to split the LM head, over which devices, in which shares.

`tune_split` keeps the best plan without splits (today's `tune`) as a candidate and adds split
ones: the tuner's own search on the model without the head's work, or with one shard's worth of
it on the owner stage (so boundaries, placement and orders are chosen for the layers that stay
whole), then the head's shards spread over the devices and placed into the bubbles by
`split_sched.insert_shards`: first in shares that even out each device's work under the lead
policies, then other share sets, then shares moved towards each device's room in the simulated
step (its shard work plus its idle time; a device whose share falls below 0.2% is dropped, so
the search also picks which devices), then the other policies. The insertions of one variant
stop when their work units (`attempt_units`) pass INSERT_SHARE times the variant's budget.
Besides each variant's tuned layout, the shards also go into its rising layout (tuner/rising.py, models
that communicate) and its evened one (tuner/evened.py, whole layers of unequal size), list-scheduled afresh.
Every candidate is judged by the simulator with its communication; one whose messages cost
more than its split saves simply loses to the plan without splits, which is kept.
`constraints.owner_shard` (framework runners) keeps a shard on the owner's device in every one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from ..errors import DeadlockError, OctoPipeError
from ..formats.model import head_inputs, microbatch_tokens
from ..formats.splits import SplitLayer
from ..simulator import SimOptions, simulate
from ..simulator.split import link_bytes, without_split_layers
from ..simulator.costs import stage_costs
from ..simulator.overheads import delivery_of
from ..simulator.pairs import communicates
from .pairing import insertion_bases, unpaired
from .evened import evened_plans
from .rising import rising_plans
from .search import WORK_RATE, tune
from .split_sched import ShardPolicy, insert_shards

log = logging.getLogger(__name__)

STATS_BYTES_PER_TOKEN = 12  # fp32 local max, sum of exponentials and target logit, per token
# The policies, most promising first (the insertions stop when their budget is spent).
# Measured on the zoo (benchmarks/split_layers.py): shard passes first and a look-ahead of a few actions
# win; waiting for the own order (window 1) or running the shards last leave the devices idle. Holding
# the head's K and the stages' W back for the gaps (klim 64, defer-w) fills the drain: 16 devices, 2
# micro-batches per device, gemma3 1.22 -> 1.17 of the no-idle bound.
# (the head's work while the rest is tuned, in shards' worth: 0 none, 1 one shard's pass; embedding split too)
VARIANTS = ((0.0, False), (1.0, False), (1.0, True))
POLICIES = tuple(ShardPolicy(shard_first=True, k_limit=k, window=w, defer_w=dw)
                 for k, w, dw in ((64, 16, True), (64, 4, True), (4, 4, False), (4, 16, False)))
# measured on 2 loaded cores (load average 25-40): an insertion with its simulation takes about linear time in
# the actions it commits, not in actions x devices: 16 devices x 32 micro-batches (~3000 actions) 0.48-0.58 s,
# nemotron-h on 64 x 128 (~45000) 3.4 s; 64 units per action at WORK_RATE (0.5 s and 7 s)
INSERT_UNITS_PER_ACTION = 64
LEAD_POLICIES = 2  # tried first on the work-balancing shares; the others last, on the best shares found
INSERT_SHARE = 3.0  # the insertions of one variant may take this many times the variant's tune budget
# the default search (`octopipe plan`): the plan without splits takes this share of --time-budget, the split
# variants the rest (splits_tried)
PLAIN_SHARE = 0.4
REFINE_ROUNDS = 4  # share refinements from the simulated idle time, after the fixed share sets
REBALANCE_ROUNDS = 3  # boundary re-balancings against the loads with the shards, each judged by the simulator
MOVES_PER_ROUND = 2  # single-layer cut moves judged per round, the most uneven cuts first
MIN_SHARE = 0.002  # a device with less of the head's rows drops out of the split
REFINE_STEP = 0.5  # how far each refinement moves the shares towards the room-proportional ones


@dataclass(frozen=True, kw_only=True)
class SplitTuneResult:
    """The chosen plan (split or not), its figures, and both bests for the comparison table."""

    plan: object
    step_ms: float
    bubble: float
    peak: tuple[int, ...]
    unsplit_ms: float  # the best plan without splits
    unsplit_peak: tuple[int, ...]
    split_ms: float | None  # the best plan with a split (None when none was made or none fits)
    split_bubble: float | None = None
    split_peak: int | None = None  # its fullest device's bytes
    unsplit: object = None  # that TuneResult
    tried: tuple = field(default_factory=tuple)  # (label, step ms or None, fits)

    @property
    def split(self) -> SplitLayer | None:
        """The chosen plan's split head, None when the plan has no split."""
        return next((sp for sp in self.plan.splits if sp.layer > 0), None)

    @property
    def source(self) -> str:
        """The label of the attempt that made the chosen plan ('no split' when it has none)."""
        if not self.plan.splits:
            return "no split"
        fits = [t for t in self.tried if t[1] is not None and t[2] and t[0] != "no split"]
        return min(fits, key=lambda t: t[1])[0] if fits else "split"

    def describe(self) -> str:
        """'no split' or 'head over 16 devices (shares 0.031-0.073), embedding over 8'."""
        sp = self.split
        if sp is None:
            return "no split"
        text = f"head over {len(sp.devices)} devices (shares {min(sp.shares):.3f}-{max(sp.shares):.3f})"
        emb = next((e for e in self.plan.splits if e.layer == 0), None)
        return text + (f", embedding over {len(emb.devices)}" if emb is not None else "")


def stats_bytes(model) -> int:
    """Bytes of the softmax statistics one head shard sends each other per micro-batch (tokens from the arch):
    per token and per hidden state the head takes (1 + the MTP depths, `formats.model.head_inputs`)."""
    tokens = microbatch_tokens(model)
    if tokens > 0:
        return STATS_BYTES_PER_TOKEN * tokens * head_inputs(model)
    return max(1, link_bytes(model, model.num_layers - 1) // 64)  # unknown width: a generous guess from the input


def splits_tried(model, num_devices: int) -> bool:
    """Whether the default search (`octopipe plan`, no --splits) tries splits: an LM head to split, 2+ devices.

    A floor test (splits only where they lower the whole-layer packing and fill bounds) missed plans whose split
    pays through the pipeline's fill and drain or the head's memory (h100x8, M = 16, 30 s: nemotron-h 1.091 ->
    1.059 of the work bound, a 150k-vocabulary Llama 1.114 -> 1.066), so the simulator judges every model with a
    head, the plan without splits kept as a candidate."""
    return splittable_head(model) is not None and num_devices >= 2


def splittable_head(model) -> int | None:
    """Index of the model's LM head when it can be split (an `lm_head` last layer), else None."""
    if model.num_layers > 1 and model.layers[-1].kind == "lm_head":
        return model.num_layers - 1
    return None


def tune_split(model, cluster, num_microbatches: int, *, time_budget_s: float = 60.0, seed: int = 0,
               iterations: int | None = None, options: SimOptions | None = None, unsplit=None,
               constraints=None, split_budget_s: float | None = None) -> SplitTuneResult:
    """The fastest fitting plan with or without a split LM head; never slower than the best without.

    `unsplit` is a TuneResult of `tune` on the same problem when already at hand (else it is tuned here
    with `time_budget_s`); each split variant's tune of the rest takes `time_budget_s` too, its insertions
    INSERT_SHARE times that. `split_budget_s` instead holds the whole split search
    (every variant's tune and insertions) to that many seconds: the work units divided evenly, and the
    wall clock as a guard (each variant until its share of what is left; Ctrl-C ends it with what it has).
    Plans fit `cluster.usable_memory_bytes` and keep to `constraints` as `tune`'s do.
    """
    opts = options or SimOptions()
    if unsplit is None:
        unsplit = tune(model, cluster, num_microbatches, time_budget_s=time_budget_s, seed=seed,
                       iterations=iterations, options=opts, constraints=constraints)
    vbudget = time_budget_s
    deadline = None
    if split_budget_s is not None:
        vbudget = split_budget_s / (len(VARIANTS) * (1 + INSERT_SHARE))
        deadline = time.monotonic() + split_budget_s
    best = (unsplit.step_ms, unsplit.plan, unsplit.bubble, tuple(unsplit.peak))
    tried = [("no split", unsplit.step_ms, True)]
    head = splittable_head(model)
    split_best = None
    if head is not None and cluster.num_devices > 1 and not opts.contention and opts.overlap:
        for out in _interruptible(_split_candidates(model, cluster, num_microbatches, head, vbudget, seed,
                                                    iterations, opts, constraints, deadline)):
            label, res, plan = out
            fits = res is not None and max(res.peak_memory_bytes) <= cluster.usable_memory_bytes and (
                constraints is None or constraints.allows_plan(plan))
            tried.append((label, None if res is None else res.step_time_ms, fits))
            if not fits:
                continue
            if split_best is None or res.step_time_ms < split_best[0]:
                split_best = (res.step_time_ms, plan, res.bubble_ratio, tuple(res.peak_memory_bytes))
    if split_best is not None and split_best[0] < best[0] - 1e-9:
        best = split_best
    step, plan, bubble, peak = best
    if plan.splits:
        meta = dict(plan.meta)
        meta["tuner"] = {**meta.get("tuner", {}), "split": True, "unsplit_ms": round(unsplit.step_ms, 6)}
        plan = replace(plan, predicted={"step_time_ms": round(step, 6), "bubble_ratio": round(bubble, 6),
                                        "peak_memory_bytes": list(peak)}, meta=meta)
    return SplitTuneResult(plan=plan, step_ms=step, bubble=bubble, peak=peak, unsplit_ms=unsplit.step_ms,
                           unsplit_peak=tuple(unsplit.peak), split_ms=None if split_best is None else split_best[0],
                           split_bubble=None if split_best is None else split_best[2],
                           split_peak=None if split_best is None else max(split_best[3]),
                           unsplit=unsplit, tried=tuple(tried))


def _interruptible(candidates):
    """The candidates until the generator ends or Ctrl-C (or the CLI's wall-clock guard) stops it."""
    try:
        yield from candidates
    except KeyboardInterrupt:
        log.warning("split search stopped (interrupt or time budget): the candidates found so far stand")


def _split_candidates(model, cluster, m, head, budget, seed, iterations, opts, constraints=None, deadline=None):
    """(label, SimResult or None, plan) of each split candidate, from tunes of the model without the head's work.

    Two stand-ins for the head while the rest is tuned: nothing at all, and one shard's pass on the
    owner stage (the latency H and J add between the owner's F and its backward); with the second,
    also the embedding split over stage 0's node (its state leaves stage 0's device, which is
    often the fullest: the room lets the rest run deeper schedules).
    `deadline` (time.monotonic): each variant's insertions stop at its even share of the time left.
    """
    nd = cluster.num_devices
    lay = model.layers[head]
    emb = splittable_embedding(model)
    owner_shard = constraints is not None and constraints.owner_shard
    if owner_shard:  # the plans of the rest have no splits: the inner tunes need not know
        constraints = replace(constraints, owner_shard=False)
    if constraints is not None and not constraints.split_embedding:
        emb = None  # the runner splits the head only: no variant with the embedding split
    variants = [(s, e) for s, e in VARIANTS if emb is not None or not e]
    for k, (stand_in, with_emb) in enumerate(variants):
        if deadline is not None and time.monotonic() >= deadline:
            log.info("split search: the time budget is spent before variant %d of %d", k + 1, len(variants))
            return
        vdeadline = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (len(variants) - k)
        # room the shards take on every device: their share of the state and a few micro-batches' logits
        reserve = (lay.state_bytes + 2 * lay.activation_bytes) // nd
        rest = _with_head_scaled(model, head, stand_in / nd)
        if with_emb:
            reserve += model.layers[emb].state_bytes // min(nd, cluster.devices_per_node)
            rest = _with_layer_scaled(rest, emb, 0.0)
        small = replace(cluster, memory_bytes=max(1, cluster.memory_bytes - reserve))
        try:
            base = tune(rest, small, m, time_budget_s=budget, seed=seed, iterations=iterations, options=opts,
                        constraints=constraints)
        except OctoPipeError as exc:  # no plan of the rest fits: no candidate from it, the unsplit plan stands
            log.info("no split candidate: %s", exc)
            continue
        label = f"stand-in {stand_in:g}/D" + (" +embedding" if with_emb else "")
        units = float("inf") if iterations is not None else budget * WORK_RATE * INSERT_SHARE
        yield from _insertions(model, cluster, head, emb if with_emb else None, base.plan, opts, label, units,
                               owner_shard, vdeadline)
        # where pairs hide communication: the same stage sizes rising along the pipeline (tuner/rising.py)
        if vdeadline is not None and time.monotonic() >= vdeadline:
            continue
        for alt in rising_plans(rest, small, m, base.plan, opts, constraints):
            yield from _insertions(model, cluster, head, emb if with_emb else None, alt, opts, label + " rising",
                                   units, owner_shard, vdeadline)
        # where whole layers of unequal size leave one device a layer more than the others (tuner/evened.py)
        if vdeadline is not None and time.monotonic() >= vdeadline:
            continue
        costs = [0.0 if i == head else layer.total_ms for i, layer in enumerate(rest.layers)]
        for alt in evened_plans(rest, small, m, base.plan, costs, opts, constraints):
            yield from _insertions(model, cluster, head, emb if with_emb else None, alt, opts, label + " evened",
                                   units, owner_shard, vdeadline)


def splittable_embedding(model) -> int | None:
    """0 when the model's first layer is an `embedding` (of an unbranched model), else None."""
    if model.num_layers > 1 and model.layers[0].kind == "embedding" and not model.inputs:
        return 0
    return None


def _with_head_scaled(model, head: int, factor: float):
    """The model with the head's times scaled by `factor` and its state and activation left to the shards."""
    return _with_layer_scaled(model, head, factor)


def _with_layer_scaled(model, index: int, factor: float):
    """The model with one layer's times scaled by `factor` and its state and activation left to the shards."""
    lay = model.layers[index]
    layers = list(model.layers)
    layers[index] = lay.scaled(factor, state_bytes=0, activation_bytes=0)
    return replace(model, layers=tuple(layers))


def _judged(model, cluster, cand, opts):
    """(plan, SimResult) of an insertion: with its pairs (the inserter keeps them as units), or without them where
    they deadlock (a pair waits for both halves' inputs, so one the shards' hand-overs feed can); (None, None) for
    no candidate."""
    if cand is None:
        return None, None
    for c in (cand, unpaired(cand)) if cand.pairs else (cand,):
        try:
            return c, simulate(model, cluster, c, opts, detail=False)
        except DeadlockError:
            continue
    return None, None


def _insertions(model, cluster, head, emb, plan, opts, label0, units: float = float("inf"), owner_shard=False,
                deadline: float | None = None):
    """The head's shards (and the embedding's, when `emb` is given) put into `plan`'s orders, each simulated.

    Attempts, most promising first, while their work (`attempt_units`) stays within `units` and each is
    expected to end before `deadline` (time.monotonic, none by default; an attempt is expected to take as
    long as the one before, the first its work at WORK_RATE); the first always runs unless it would end
    past the deadline. `owner_shard`: the owner's device keeps a shard (at least MIN_SHARE) in every attempt.
    """
    if plan.stages[-1].end != model.num_layers or not plan.stages[-1].start <= head < plan.stages[-1].end:
        return
    nd = cluster.num_devices
    gone = [SplitLayer(layer=head, devices=(0,), shares=(1.0,))]
    extra = ()
    if emb is not None:
        gone.append(SplitLayer(layer=emb, devices=(0,), shares=(1.0,)))
        first = plan.first_device
        node = tuple(d for d in range(nd) if cluster.same_node(d, first))
        extra = (SplitLayer(layer=emb, devices=node, shares=_exact([1.0 / len(node)] * len(node))),)
    rest = without_split_layers(model, tuple(gone))
    work = _device_work(rest, plan)
    stats = stats_bytes(model)
    head_ms = model.layers[head].total_ms
    balanced = _balance(work, head_ms)
    equal = [1.0 / nd] * nd
    best = None  # (step, shares, policy, SimResult, stages) of the fastest fitting insertion so far
    pairing = communicates(model)
    cost = attempt_units(plan, nd)
    spent = 0.0

    took = cost / WORK_RATE  # seconds an attempt takes: the work rate's guess (conservative), then the last one's

    def affordable() -> bool:
        if deadline is not None and time.monotonic() + took > deadline:
            return False
        return spent == 0.0 or spent + cost <= units

    def attempt(label, shares, pol, stages=plan.stages):
        nonlocal best, spent, took
        spent += cost
        t0 = time.monotonic()
        splits = extra + (_split_of(head, shares, stats, stages[-1].device if owner_shard else None),)
        base = replace(plan, stages=stages, splits=splits, meta=_meta(plan, pol))
        cand, res = None, None
        # a base with pairs is also inserted into without them: keeping a pair as a unit can cost the shards a gap
        for b, pair in insertion_bases(base, pairing):
            c, r = _judged(model, cluster, insert_shards(model, cluster, b, pol, opts.launch_ms,
                                                         delivery_of(opts.overheads), pair=pair), opts)
            if r is not None and (res is None or r.step_time_ms < res.step_time_ms):
                cand, res = c, r
        if res is not None and max(res.peak_memory_bytes) <= cluster.usable_memory_bytes and (
                best is None or res.step_time_ms < best[0]):
            best = (res.step_time_ms, list(shares), pol, res, stages)
        took = time.monotonic() - t0
        return f"{label0} {label} {pol.describe()}", res, cand

    def best_stages():
        return plan.stages if best is None else best[4]

    def best_balanced():
        return _balance(_device_work(rest, replace(plan, stages=best_stages())), head_ms)

    def boundaries():
        """Boundaries chosen with the split (hill-climbing from the best insertion so far): each move keeps
        every device's load (its stages' work plus its shard share) where the best put it, so the shares
        follow the moved layers (`_follow`), and is judged by the simulator; a move that pays is kept and
        the moves start again from it, with one share step towards the room on its boundaries."""
        tried = {best_stages()}
        for _ in range(REBALANCE_ROUNDS):
            if best is None:
                return
            base, shares = best[4], best[1]
            old = _device_work(rest, replace(plan, stages=base))
            paid = False
            for label, stages in _boundary_moves(rest, base, shares, head_ms, keep_first=emb is not None):
                if stages in tried:
                    continue
                if not affordable():
                    return
                tried.add(stages)
                before = best[0]
                new = _device_work(rest, replace(plan, stages=stages))
                yield attempt(label, _follow(shares, old, new, head_ms), best[2], stages)
                if best[0] < before:
                    paid = True
                    break
            if not paid:
                return
            if affordable():
                target = _room_shares(best[1], best[3], head_ms * plan.num_microbatches)
                yield attempt("moved room", [(a + b) / 2 for a, b in zip(best[1], target)], best[2], best[4])

    # the lead policy on the work-balancing shares, the shares moved towards each device's room, the
    # boundaries chosen with the split, then the other share sets and policies (measured on the zoo at
    # --budget 2, benchmarks/split_layers.py: the room steps pay most, the other policies seldom)
    if not affordable():  # the deadline comes first: not even the first
        return
    yield attempt("balance work", balanced, POLICIES[0])
    # shares proportional to bubble room: a device's room is its shard work plus its idle time in the
    # simulated step; move part of the way towards the room-proportional shares, keep what is faster,
    # and take smaller steps once a step did not pay
    step = REFINE_STEP
    for k in range(REFINE_ROUNDS):
        if best is None or not affordable():
            break
        before = best[0]
        target = _room_shares(best[1], best[3], head_ms * plan.num_microbatches)
        shares = [(1 - step) * a + step * b for a, b in zip(best[1], target)]
        yield attempt(f"room {k + 1}", shares, best[2], best[4])
        if best[0] >= before:
            step /= 2
    yield from boundaries()
    if affordable():
        yield attempt("half-balance", [(a + b) / 2 for a, b in zip(equal, best_balanced())], POLICIES[0], best_stages())
    for pol in POLICIES[1:]:  # the other policies on the best shares, budget permitting
        if best is not None and affordable():
            yield attempt("best shares", best[1], pol, best[4])
    if best is not None and affordable():
        yield attempt("equal", equal, best[2], best[4])


def _follow(shares, old_work, new_work, head_ms: float) -> list[float]:
    """Shares after a boundary move that keep each device's load: a device that gained stage work gives up
    as much head work, one that lost some takes it (none below 0; renormalised)."""
    raw = [max(0.0, s + (o - n) / head_ms) for s, o, n in zip(shares, old_work, new_work)] if head_ms > 0 \
        else list(shares)
    tot = sum(raw)
    return [x / tot for x in raw] if tot > 0 else list(shares)


def _boundary_moves(rest, stages, shares, head_ms: float, keep_first: bool = False):
    """(label, stages) of the boundary moves worth judging from `stages`, most promising first: the rest's
    layers re-balanced against each device's load with its shard share (`_rebalanced`), then one layer
    across each cut, off the device with the larger load (its stages plus its share) first."""
    moved = _rebalanced(rest, stages, shares, head_ms, keep_first)
    if moved is not None:
        yield "rebalance", moved
    n = len(rest.layers)
    costs = [layer.total_ms for layer in rest.layers]
    bounds = [st.start for st in stages] + [stages[-1].end]
    load = [shares[d] * head_ms if d < len(shares) else 0.0 for d in range(len(shares))]
    for s, st in enumerate(stages):
        load[st.device] += sum(costs[bounds[s]:bounds[s + 1]])
    moves = []
    for c in range(1, len(stages)):
        a, b = stages[c - 1].device, stages[c].device
        if a == b:
            continue
        # the cut moves towards the lighter device's stage: -1 gives stage c-1's last layer to stage c
        delta = -1 if load[a] > load[b] else 1
        moves.append((-abs(load[a] - load[b]), c, delta))
    for _, c, delta in sorted(moves)[:MOVES_PER_ROUND]:
        nb = list(bounds)
        nb[c] += delta
        if not all(nb[i] <= nb[i + 1] for i in range(len(stages))) or (keep_first and nb[1] < 1) or nb[-2] > n - 1:
            continue
        yield f"cut {c} {delta:+d}", tuple(replace(st, start=nb[s], end=nb[s + 1]) for s, st in enumerate(stages))


def _rebalanced(rest, stages, shares, head_ms: float, keep_first: bool = False):
    """Stage boundaries that lower the heaviest device's load (its stages' work in `rest` plus its share of the
    head's `head_ms`), moving one layer at a time across a cut between stages of different devices; the
    same devices and stage order (so the same schedule). None when no move lowers it.

    The last stage keeps at least the head (its last layer), the first stage layer 0 when `keep_first`.
    """
    costs = [layer.total_ms for layer in rest.layers]
    bounds = [st.start for st in stages] + [stages[-1].end]
    dev = [st.device for st in stages]
    nd = max(len(shares), max(dev) + 1)
    extra = [shares[d] * head_ms if d < len(shares) else 0.0 for d in range(nd)]

    def loads(b):
        out = list(extra)
        for s, d in enumerate(dev):
            out[d] += sum(costs[b[s]:b[s + 1]])
        return out

    def key(b):
        ld = sorted(loads(b), reverse=True)
        return ld[:3]  # the heaviest device first, then the next ones (ties broken towards evening out)

    cur = key(bounds)
    moved = False
    for _ in range(len(costs)):  # each round moves one layer; at most one pass of layers
        best = None
        for c in range(1, len(stages)):  # cut c sits between stages c-1 and c
            if dev[c - 1] == dev[c]:
                continue
            for delta in (-1, 1):
                b = list(bounds)
                b[c] += delta
                if not b[c - 1] <= b[c] <= b[c + 1] or (keep_first and b[1] < 1) or b[-2] > len(costs) - 1:
                    continue
                k = key(b)
                if k < cur and (best is None or k < best[0]):
                    best = (k, b)
        if best is None:
            break
        cur, bounds, moved = best[0], best[1], True
    if not moved:
        return None
    return tuple(replace(st, start=bounds[s], end=bounds[s + 1]) for s, st in enumerate(stages))


def attempt_units(plan, num_devices: int) -> float:
    """Work units (tuner/search.py WORK_RATE) of one insertion and its simulation, measured: each of the
    plan's actions and its shard actions is committed once."""
    stage_actions = sum(len(r) for r in plan.schedule)
    shard_actions = 3 * plan.num_microbatches * num_devices
    return INSERT_UNITS_PER_ACTION * (stage_actions + shard_actions)


def _room_shares(shares, res, head_total: float) -> list[float]:
    """Shares proportional to each device's room: its shard work plus its idle time in the step."""
    step = res.step_time_ms
    room = [s * head_total + max(0.0, step - b) for s, b in zip(shares, res.busy_ms)]
    tot = sum(room)
    return [r / tot for r in room] if tot > 0 else list(shares)


def _exact(vals: list[float]) -> tuple[float, ...]:
    """Shares summing to exactly 1 (the last one takes the rounding)."""
    vals = list(vals)
    vals[-1] = 1.0 - sum(vals[:-1])
    return tuple(vals)


def _meta(plan, pol: ShardPolicy) -> dict:
    meta = dict(plan.meta)
    meta["split_policy"] = pol.describe()
    return meta


def _device_work(model, plan) -> list[float]:
    """Per micro-batch compute of every device for the stage actions (the head's work taken out)."""
    sc = stage_costs(model, plan.stages)
    out = [0.0] * plan.num_devices
    for s, st in enumerate(plan.stages):
        out[st.device] += sc.fwd[s] + sc.bwd[s] + sc.wgrad[s]
    return out


def _balance(work: list[float], head: float) -> list[float]:
    """Shares that bring every device's work to the same level (water filling): light devices take more."""
    lo, hi = min(work), max(work) + head
    for _ in range(60):  # bisection on the common level
        mid = (lo + hi) / 2
        if sum(max(0.0, mid - w) for w in work) > head:
            hi = mid
        else:
            lo = mid
    raw = [max(0.0, lo - w) for w in work]
    s = sum(raw)
    return [x / s for x in raw] if s > 0 else [1.0 / len(work)] * len(work)


def _split_of(head: int, shares, stats: int, owner: int | None = None) -> SplitLayer:
    """The split record over the devices with a share worth keeping (at least MIN_SHARE of the rows), and the
    `owner` device (when given) with at least MIN_SHARE."""
    keep = [(d, max(s, MIN_SHARE) if d == owner else s) for d, s in enumerate(shares)
            if s >= MIN_SHARE or d == owner]
    tot = sum(s for _, s in keep)
    devices = tuple(d for d, _ in keep)
    return SplitLayer(layer=head, devices=devices, shares=_exact([s / tot for _, s in keep]), stats_bytes=stats)


def comparison_rows_with_splits(result: SplitTuneResult, cluster=None) -> list:
    """The comparison table (tuner/compare.py) led by the best plan with splits and the best without."""
    from .compare import Row, comparison_rows, per_device

    rows = comparison_rows(result.unsplit, cluster)
    base = rows[0].speedup * result.unsplit_ms if rows[0].speedup else None
    if result.split_ms is None:
        rows[0] = replace(rows[0], label="OctoPipe (no split)", note=(rows[0].note + " no split fits").strip())
        return rows
    best = result.plan if result.plan.splits else None
    note = "chosen" if best is not None else "slower than without splits: not chosen"
    split_row = Row(label="OctoPipe (split layers)", schedule="octopipe", split="tuned",
                    stages_per_device=per_device(result.plan), step_ms=result.split_ms,
                    bubble=result.split_bubble, peak_bytes=result.split_peak, fits=True,
                    speedup=base / result.split_ms if base else None,
                    note=(result.describe() + "; " if best is not None else "") + note)
    return [split_row, replace(rows[0], label="OctoPipe (no split)")] + rows[1:]
