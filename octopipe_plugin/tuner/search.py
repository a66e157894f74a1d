"""The tuner: seeds, then simulate -> find the bottleneck -> move -> keep what is faster and fits.

Determinism: the search draws every choice from `random.Random(seed)` and measures its
budget in *work units* (actions list-scheduled or simulated), never in seconds. With
`iterations` given, the run is exactly that many search steps. With only a time budget,
the budget becomes `time_budget_s * WORK_RATE` work units, which on the reference 2-core
machine takes about the budget; the same seed and budget then give the same plan on any
machine fast enough to do that work within the budget. A wall-clock guard still stops a
slower machine at the budget (logged, since that run may differ); it scales with each
phase's share, so the later phases keep their time.

Phases: a first own plan; the built-ins (ranked on the search count, then taken to the full
count fastest first); the own seeds; the search (at SEARCH_FACTOR micro-batches per device
when the step has more); the search's best taken to the full count; polish. The fastest
fitting full-count plan so far is always in hand (the progress bar shows it, Ctrl-C returns it).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace

from ..errors import OctoPipeError, OutOfMemoryError
from ..formats import Plan
from ..schedules.registry import SCHEDULES
from ..simulator import SimOptions, simulate
from .bounds import Bound, lower_bound
from .constraints import Constraints
from .encoded import ActionTable
from .evaluate import Evaluator, Outcome
from .layout import Layout
from .listsched import Pairing, Policy
from .moves import Context, pick_move
from .periodic import extend_schedule, scale_policy
from .pairing import pair_step, with_adjacent_pairs
from .memory_choices import MemoryLevers, relaxed_candidates, repaired_builtins, trim_step
from .polish import critical_slots, polish_step
from .prune import drop_empty_stages
from .seeds import _build as build_builtin
from .seeds import Baseline, builtin_baselines, minimal_memory_need, seed_layouts, seed_policies

log = logging.getLogger(__name__)

WORK_RATE = 400_000  # work units per second: about half what the reference machine (2 cores) sustains
ELITE = 6  # candidates kept as parents
POLISH_SHARE = 0.15  # share of the budget spent on order moves at the end
STEP_UNITS = 25  # work charged per search step for the move itself (pruned and cached steps cost too)
SEARCH_FACTOR = 4  # above this many micro-batches per device, the search runs at this many (periodic steady state)
FINAL_SHARE = 0.1  # share of the budget kept for taking the search's best to the full count
RESULT_SHARE = 0.03  # kept for checking the returned plan (simulation, validation)


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """What the progress bar shows after each search step."""

    iteration: int
    best_ms: float
    bubble: float
    fraction: float  # of the budget used, 0..1
    phase: str


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """The tuned plan (with `predicted` filled by the simulator) and how it was found."""

    plan: Plan
    step_ms: float
    bubble: float
    peak: tuple[int, ...]
    bound: Bound
    baselines: tuple[Baseline, ...]
    source: str  # "octopipe" or the built-in schedule it could not beat
    iterations: int
    evaluations: int  # candidates judged: simulated, or timed by the compiled list scheduler
    elapsed_s: float
    stopped_by: str
    seeded_s: float  # when a plan at least as good as every fitting built-in was in hand
    constraints: Constraints = Constraints()  # what the plan was made to keep to


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One plan of the search's pool: its step time, layout, schedule spec and simulated outcome."""

    step_ms: float
    layout: Layout
    spec: object  # a list-scheduler Policy, or an explicit per-device order
    outcome: Outcome


@dataclass(kw_only=True)
class _Budget:
    """Search-step and work accounting of one run (local to `tune`)."""

    ev: Evaluator
    units: float
    iterations: int | None
    deadline: float
    seconds: float = 0.0  # the time budget the deadline ends
    done: int = 0
    stopped_by: str = ""

    def setup_deadline(self) -> float:
        """When setup stops early: the deadline, except with `iterations`, whose runs stay reproducible
        (the CLI's wall-clock guard still holds the budget there)."""
        return self.deadline if self.iterations is None else float("inf")

    def fraction(self) -> float:
        """Share of the budget spent, 0..1 (search steps with `iterations`, else work units)."""
        if self.iterations is not None:
            return min(1.0, self.done / max(1, self.iterations))
        return min(1.0, self.ev.work / self.units)

    def left(self, upto: float = 1.0) -> bool:
        """Whether less than `upto` of the budget is spent and the wall-clock guard has not passed.

        The guard scales with `upto` too, so a slow or loaded machine still leaves each later
        phase (the full-count plans, polish, the final check) its share of the time.
        """
        if time.monotonic() >= self.deadline - (1.0 - upto) * self.seconds:
            self.stopped_by = self.stopped_by or "wall clock"
            return False
        if self.fraction() >= upto:
            self.stopped_by = self.stopped_by or ("iterations" if self.iterations is not None else "work budget")
            return False
        return True


def search_count(num_microbatches: int, num_devices: int) -> int:
    """Micro-batches the search schedules with: the full count up to SEARCH_FACTOR per device, else that many."""
    return min(num_microbatches, SEARCH_FACTOR * num_devices)


@dataclass(kw_only=True)
class _InHand:
    """The best full-count plan found so far (what Ctrl-C returns), and the progress bar's feed."""

    budget: _Budget
    progress: object
    t0: float
    outcome: Outcome | None = None
    source: str = ""
    floor_ms: float = float("inf")  # the fastest fitting built-in seen
    elite: list[Candidate] = field(default_factory=list)  # the search's pool, for Ctrl-C
    history: list = field(default_factory=list)  # (seconds, step ms) of each plan taken in hand
    constraints: Constraints = Constraints()  # what every plan taken in hand keeps to

    def offer(self, out: Outcome | None, source: str, phase: str) -> None:
        """Keep `out` if it is a fitting full plan faster than the one in hand (own plans win ties); report.

        A plan is replayed by the simulator before it is kept, so the plan in hand is always judged.
        """
        if self._better(out, source):
            out = self.budget.ev.judge(out)
            if self._better(out, source):
                self.outcome, self.source = out, source
                self.history.append((time.monotonic() - self.t0, out.step_ms))
        self.report(phase)

    def _better(self, out: Outcome | None, source: str) -> bool:
        if out is None or out.plan is None or not out.fits or not self.constraints.allows_plan(out.plan):
            return False
        cur = self.outcome
        own_tie = source == "octopipe" and self.source != "octopipe"
        return cur is None or out.step_ms < cur.step_ms - 1e-9 or (own_tie and out.step_ms <= cur.step_ms + 1e-9)

    def seeded_s(self) -> float:
        """When a plan at least as fast as every fitting built-in was first in hand."""
        return next((t for t, ms in self.history if ms <= self.floor_ms + 1e-9), time.monotonic() - self.t0)

    def builtin(self, b) -> None:
        """A built-in's full outcome has arrived."""
        o = b.outcome
        if o is not None and o.fits and allowed_builtin(self.constraints, b, self.budget.ev.cluster.num_devices):
            self.floor_ms = min(self.floor_ms, o.step_ms)
        self.offer(o, _label(b), "built-ins")

    def report(self, phase: str) -> None:
        """One progress line: the plan in hand."""
        if self.progress is not None and self.outcome is not None:
            self.progress(Progress(iteration=self.budget.done, best_ms=self.outcome.step_ms,
                                   bubble=self.outcome.bubble, fraction=self.budget.fraction(), phase=phase))


def tune(model, cluster, num_microbatches: int, *, time_budget_s: float = 60.0, seed: int = 0,
         iterations: int | None = None, progress=None, options: SimOptions | None = None,
         constraints: Constraints | None = None, memory: MemoryLevers | None = None) -> TuneResult:
    """Search partition, placement and per-device schedule for the fastest plan that fits memory.

    `options` are the simulator switches plans are judged by (the list scheduler plans with the same).
    Plans fit `cluster.usable_memory_bytes` (device memory less the cluster's headroom) and keep to
    `constraints` (placement, stages per device, split backward): seeds, moves and built-ins that
    break them are never taken, and the returned plan is checked once more.

    Anytime: the fastest fitting built-in is in hand first and every later plan only replaces
    it when faster; Ctrl-C (KeyboardInterrupt) ends the search and returns the plan in hand.
    With more than SEARCH_FACTOR micro-batches per device the search runs at that many and its
    best candidates are taken to the full count at the end (tuner/periodic.py).
    `memory` (tuner/memory_choices.py) lets the tuner buy a faster schedule with per-layer recompute or offload
    where memory binds (default none: plans without memory choices).
    """
    t0 = time.monotonic()
    nd = cluster.num_devices
    ev = Evaluator(model, cluster, num_microbatches, options=options, levers=memory or MemoryLevers())
    evs = ev.at(search_count(num_microbatches, nd))
    budget = _Budget(ev=ev, units=max(1.0, time_budget_s * WORK_RATE), iterations=iterations,
                     deadline=t0 + time_budget_s, seconds=time_budget_s)
    cons = constraints or Constraints()
    hand = _InHand(budget=budget, progress=progress, t0=t0, constraints=cons)
    rng = random.Random(seed)
    baselines: list = []
    try:
        layouts = [lay for _, lay in seed_layouts(model, nd) if evs.static_fits(lay)
                   and cons.allows_devices(lay.devices, nd)]
        layouts.sort(key=evs.work_floor)
        first = _first_plan(ev, evs, layouts, hand)
        baselines = builtin_baselines(ev, model, nd, num_microbatches, search_ev=evs, on_result=hand.builtin,
                                      deadline=budget.setup_deadline())
        allowed = [b for b in baselines if allowed_builtin(cons, b, nd)]
        fitting = [b.search for b in allowed if b.search is not None and b.search.fits]
        floor = min(fitting, key=lambda o: o.step_ms) if fitting else None
        seeds = first + _own_seeds(evs, layouts, nd, budget, floor, hand) + _builtin_elite(allowed)
        memory_seeds = _memory_seeds(ev, evs, layouts, hand, allowed, seeds)
        # the search's pool takes them only where nothing without choices fits: the search then runs as without
        # levers, and a repaired plan it meets joins when it beats the best
        hand.elite = _elite(seeds or memory_seeds)
        if evs.pairing:  # the seeds' pool paired before the search too: its moves then start from the paired plans
            _pair_elite(ev, evs, hand)
        _search(evs, rng, budget, Context.of(model, nd, evs.m), hand)
        if evs.pairing:
            _pair_elite(ev, evs, hand)
    except KeyboardInterrupt:
        _interrupted(budget, hand, baselines)
    try:
        if evs is not ev and hand.elite:
            _promote(ev, evs, budget, hand)
        if hand.outcome is not None and budget.stopped_by != "interrupted":
            _polish(ev, rng, hand, budget)
    except KeyboardInterrupt:
        _interrupted(budget, hand, baselines)
    if hand.outcome is None:
        raise OutOfMemoryError(_oom_message(ev, model, cluster, num_microbatches, baselines, cons))
    if budget.stopped_by == "wall clock":
        log.warning("tuner stopped by the wall clock before its work budget: the result may vary between runs")
    return _result(ev, hand.outcome, hand.source, baselines, budget, t0, hand.seeded_s(), cons)


def allowed_builtin(constraints: Constraints, b, num_devices: int) -> bool:
    """Whether a built-in run (a Baseline) keeps to the constraints (judged by its name and v: its plan may be gone)."""
    return not constraints.active or not constraints.excludes_builtin(SCHEDULES[b.name], num_devices,
                                                                      b.stages_per_device)


def _interrupted(budget, hand, baselines) -> None:
    """Ctrl-C: stop searching and keep the plan in hand; with nothing in hand yet, stop altogether."""
    budget.stopped_by = "interrupted"
    if hand.outcome is None:
        raise KeyboardInterrupt
    log.warning("tuner interrupted: returning the best plan found so far (%.1f ms)", hand.outcome.step_ms)


def _label(b) -> str:
    """How the result names a built-in it could not beat."""
    return f"{b.name} ({b.split} split, v={b.stages_per_device})"


def _first_plan(ev, evs, layouts, hand) -> list[Candidate]:
    """An own plan within seconds, before the built-ins: the seed layout with the lowest work floor
    under its first two seed policies, taken to the full count; returns the fitting search candidates."""
    if not layouts:
        return []
    lay, nd = layouts[0], ev.cluster.num_devices
    found = []
    for pol in seed_policies(lay, nd, evs.m, split_backward=hand.constraints.split_backward)[:2]:
        out = evs.scheduled(lay, pol)
        if out is not None and out.fits and out.plan is not None:
            found.append(Candidate(step_ms=out.step_ms, layout=lay, spec=pol, outcome=out))
    if found:
        best = min(found, key=lambda c: c.step_ms)
        hand.offer(best.outcome if evs is ev else _full_of(ev, evs, best, ActionTable()), "octopipe", "first plan")
    return found


def _own_seeds(ev, layouts, nd, budget, floor, hand) -> list[Candidate]:
    """Evaluate own layouts x seed policies, most promising layouts first; the fitting ones, best first."""
    best = floor.step_ms if floor is not None else float("inf")
    found = []
    for i, lay in enumerate(layouts):
        if i > 0 and (ev.work_floor(lay) >= best or not budget.left(0.5)):
            continue
        for pol in seed_policies(lay, nd, ev.m, split_backward=hand.constraints.split_backward):
            if (found or floor is not None) and time.monotonic() >= budget.setup_deadline():
                break  # the time budget holds during setup: keep what is in hand
            out = ev.scheduled(lay, pol)
            if out is not None and out.fits and out.plan is not None:
                found.append(Candidate(step_ms=out.step_ms, layout=lay, spec=pol, outcome=out))
                best = min(best, out.step_ms)
                if ev is budget.ev:
                    hand.offer(out, "octopipe", "seeds")
        hand.report("seeds")
    return found


def _memory_seeds(ev, evs, layouts, hand, baselines, seeds) -> list[Candidate]:
    """Built-ins over memory and seed layouts list-scheduled with more micro-batches in flight than memory holds,
    repaired by memory choices (tuner/memory_choices.py), as explicit-order candidates; none where the levers allow
    no choice."""
    pols = lambda lay: seed_policies(lay, ev.cluster.num_devices, evs.m,  # noqa: E731
                                     split_backward=hand.constraints.split_backward)
    below = min((c.step_ms for c in seeds), default=float("inf"))  # what a seed must beat to be worth its work
    out = []
    for lay, o in repaired_builtins(evs, ev.model, baselines, build_builtin, below) + relaxed_candidates(evs, layouts, pols, below):
        out.append(Candidate(step_ms=o.step_ms, layout=lay, spec=o.plan.schedule, outcome=o))
        if evs is ev:
            hand.offer(o, "octopipe", "memory choices")
    return out


def _builtin_elite(baselines) -> list[Candidate]:
    """The fitting built-in plans as explicit-order candidates, so partition and order moves refine them."""
    out = []
    for b in baselines:
        o = b.search
        if o is not None and o.fits and o.plan is not None:
            out.append(Candidate(step_ms=o.step_ms, layout=Layout.of_stages(o.plan.stages), spec=o.plan.schedule, outcome=o))
    return out


def _elite(items: list[Candidate]) -> list[Candidate]:
    """The ELITE fastest fitting candidates (list-scheduled ones on the scheduler's clock: the simulator
    replays a candidate when it is taken in hand, and the returned plan again)."""
    return _dedupe(sorted(items, key=lambda c: c.step_ms))[:ELITE]


def _dedupe(items: list[Candidate]) -> list[Candidate]:
    """Candidates without repeats; explicit orders by identity (hashing a long order costs as much as judging it)."""
    seen, out = set(), []
    for c in items:
        key = (c.layout, c.spec if isinstance(c.spec, Policy) else id(c.spec))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _search(ev, rng, budget, ctx, hand) -> None:
    """Hill-climb from the elite pool in `hand` with the moves of `moves.MOVES`, updating it."""
    elite = hand.elite
    if not elite:
        return
    stop_at = 1.0 - POLISH_SHARE - (FINAL_SHARE if ev is not budget.ev else 0.0)
    full = ev is budget.ev
    while budget.left(stop_at):
        budget.done += 1
        ev.work += STEP_UNITS
        ev.repair_below = elite[0].step_ms  # memory choices only add time: repair only what could beat the best
        parent = elite[0] if rng.random() < 0.6 else rng.choice(elite)
        cand = _neighbour(rng, ctx, parent.layout, parent.spec)
        if cand is None or not hand.constraints.admits(cand[0], cand[1], ctx.num_devices) or \
                not ev.static_fits(cand[0]) or ev.work_floor(cand[0]) >= elite[0].step_ms - 1e-9:
            hand.report("search")
            continue
        out = ev.run(*cand)
        if out is not None and out.plan is not None and out.fits and out.step_ms <= parent.step_ms:
            elite = _elite(elite + [Candidate(step_ms=out.step_ms, layout=cand[0], spec=cand[1], outcome=out)])
            hand.elite = elite
            if full:
                hand.offer(out, "octopipe", "search")
        hand.report("search")


def _neighbour(rng, ctx, layout, spec):
    """One move, or now and then a kick of several (to leave a local optimum); None if none applied."""
    kicks = 1 if rng.random() < 0.7 else rng.randint(2, 5)
    cand = None
    for _ in range(kicks):
        nxt = pick_move(rng)(rng, ctx, layout, spec)
        if nxt is not None:
            cand = nxt
            layout, spec = nxt
    return cand


def _pair_elite(ev, evs, hand) -> None:
    """The pairing move on the search's pool (tuner/pairing.py): each elite candidate also with its list scheduler
    pairing (ready, or also due forwards) or, an explicit order, with its adjacent F and B paired; the pool keeps
    the faster (unpaired candidates stay in it while they are among the best). Run on the seeds' pool before the
    search (the seeds' paired plans are where the layouts that pair well start from) and on its pool after."""
    found = []
    for cand in hand.elite:
        if isinstance(cand.spec, Policy):
            for mode in (Pairing.READY, Pairing.WAIT):
                spec = replace(cand.spec, pair=mode)
                out = evs.scheduled(cand.layout, spec)
                if out is not None and out.fits and out.plan is not None:
                    found.append(Candidate(step_ms=out.step_ms, layout=cand.layout, spec=spec, outcome=out))
        elif cand.outcome.plan is not None:
            out = evs.simulated(with_adjacent_pairs(cand.outcome.plan), pair=False)
            if out is not None and out.fits:
                found.append(Candidate(step_ms=out.step_ms, layout=cand.layout, spec=out.plan.schedule, outcome=out))
    hand.elite = _elite(hand.elite + found)
    evs.pair_orders = ev.pair_orders = True  # from here on explicit orders are judged paired too
    if evs is ev and hand.elite:
        hand.offer(hand.elite[0].outcome, "octopipe", "pairs")


def _promote(ev, evs, budget, hand) -> None:
    """Take the search's best candidates to the full count: grown periodically, else list-scheduled afresh.

    The best one goes while the wall clock allows (else the search was for nothing); the others
    while the budget lasts.
    """
    table = ActionTable()
    for i, cand in enumerate(hand.elite):
        if (i > 0 and not budget.left(1.0 - POLISH_SHARE)) or time.monotonic() >= budget.deadline:
            break
        hand.offer(_full_of(ev, evs, cand, table), "octopipe", "full count")


def _full_of(ev, evs, cand: Candidate, table) -> Outcome | None:
    """A search-count candidate at the full count: its order grown periodically, else its policy rescheduled."""
    full = None
    out = cand.outcome
    # a paired order's growth would repeat its actions, not its pairs: a pairing policy schedules afresh
    grown = None if out.plan.pairs and isinstance(cand.spec, Policy) else \
        extend_schedule(out.plan.schedule, evs.m, ev.m, table)
    if grown is not None:
        full = ev.simulated(ev.plan_of(cand.layout, grown, dict(out.plan.meta)))
    if full is None and isinstance(cand.spec, Policy):
        full = ev.schedule_and_simulate(cand.layout, scale_policy(cand.spec, evs.m, ev.m))
    return full


def _polish(ev, rng, hand, budget) -> None:
    """Order moves on the critical path of the plan in hand until the budget ends; where pairs pay (the
    evaluator's `pairing`), every other move is a pairing move (tuner/pairing.py)."""
    best = hand.outcome
    if not budget.left(1.0 - RESULT_SHARE):
        return  # the critical path alone is a detailed simulation: none when no polish step can follow
    slots = critical_slots(ev, best.plan)
    misses = 0
    while budget.left(1.0 - RESULT_SHARE) and misses < 200:
        ev.repair_below = best.step_ms
        budget.done += 1
        ev.work += STEP_UNITS
        if ev.levers.auto and best.plan.memory and rng.random() < 0.3:
            better = trim_step(ev, rng, best)
        elif ev.pairing and rng.random() < 0.5:
            better = pair_step(ev, rng, best)
        else:
            better = polish_step(ev, rng, best, slots)
        if better is None:
            misses += 1
        else:
            best, misses = better, 0
            hand.offer(best, "octopipe", "polish")
            slots = critical_slots(ev, best.plan)
        hand.report("polish")


def _result(ev, final: Outcome, source, baselines, budget, t0, seeded_s, constraints: Constraints) -> TuneResult:
    plan, step, bubble, peak = _without_empty_stages(ev, final, constraints)
    broken = constraints.plan_problems(plan)
    if broken:  # every plan in hand was checked: this would be a tuner bug, never a plan to run
        raise OctoPipeError(f"internal error: the tuned plan breaks {constraints.describe()}: {'; '.join(broken)}")
    plan = replace(plan, schedule=tuple(tuple(row) for row in plan.schedule))  # materialise an encoded one
    meta = dict(plan.meta)
    meta["tuner"] = {"source": source, "iterations": budget.done, "evaluations": ev.evaluations}
    predicted = {"step_time_ms": round(step, 6), "bubble_ratio": round(bubble, 6), "peak_memory_bytes": list(peak)}
    plan = replace(plan, predicted=predicted, meta=meta)
    bound = lower_bound(ev.model, ev.cluster.num_devices, ev.m)
    return TuneResult(plan=plan, step_ms=step, bubble=bubble, peak=tuple(peak), bound=bound,
                      baselines=tuple(baselines), source=source, iterations=budget.done,
                      evaluations=ev.evaluations, elapsed_s=time.monotonic() - t0,
                      stopped_by=budget.stopped_by or "converged", seeded_s=seeded_s, constraints=constraints)


def _without_empty_stages(ev, final: Outcome, constraints: Constraints = Constraints()):
    """(plan, step, bubble, peak): the plan without empty stages when no slower and still fitting, else as judged.

    The plan in hand was replayed by the simulator at the full count when it was taken, so its
    figures stand; only a pruned plan is simulated again.
    """
    plan = final.plan
    pruned = drop_empty_stages(plan)
    if pruned is not plan and constraints.allows_plan(pruned):
        res = simulate(ev.model, ev.cluster, pruned, ev.options, detail=False)
        if res.step_time_ms <= final.step_ms and max(res.peak_memory_bytes) <= ev.cluster.usable_memory_bytes:
            return pruned, res.step_time_ms, res.bubble_ratio, res.peak_memory_bytes
    return plan, final.step_ms, final.bubble, final.peak


def _oom_message(ev, model, cluster, m, baselines, constraints: Constraints = Constraints()) -> str:
    """Name the smallest per-device memory any plan needed."""
    need = [b.outcome.max_peak for b in baselines if b.outcome is not None]
    need.append(minimal_memory_need(ev, model, cluster.num_devices))
    least = min(need)
    kept = cluster.memory_headroom_bytes
    room = f"{cluster.memory_bytes / 2**30:.1f} GiB per device of {cluster.name}"
    if kept:
        room += (f" less its {kept / 2**30:.1f} GiB headroom ({cluster.usable_memory_bytes / 2**30:.1f} GiB usable; "
                 f"--memory-headroom lowers it)")
    return (f"no plan fits the {room} for {model.name} "
            f"on {cluster.num_devices} devices with {m} micro-batches; the smallest per-device memory any plan "
            f"needed (one micro-batch in flight included) was {least / 2**30:.2f} GiB. Try: more devices (a larger cluster), full activation recompute "
            f"(`recompute: true` in the architecture, or `octopipe model ... --recompute -o m.json`), tensor "
            f"parallelism (--tp) or a larger --dp to shard the optimizer, or a GPU with more memory"
            + (f"; or loosen the constraints ({constraints.describe()})" if constraints.active else ""))
