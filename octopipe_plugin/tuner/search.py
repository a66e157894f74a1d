"""The tuner: seeds, then simulate -> find the bottleneck -> move -> keep what is faster and fits.

Determinism: the search draws every choice from `random.Random(seed)` and measures its
budget in *work units* (actions list-scheduled or simulated), never in seconds. With
`iterations` given, the run is exactly that many search steps. With only a time budget,
the budget becomes `time_budget_s * WORK_RATE` work units, which on the reference 2-core
machine takes about the budget; the same seed and budget then give the same plan on any
machine fast enough to do that work within the budget. A wall-clock guard still stops a
slower machine at the budget (logged, since that run may differ).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace

from ..errors import OutOfMemoryError
from ..simulator import simulate
from .bounds import Bound, lower_bound
from .evaluate import Evaluator, Outcome
from .layout import Layout
from .moves import Context, pick_move
from .polish import critical_slots, polish_step
from .prune import drop_empty_stages
from .seeds import Baseline, builtin_baselines, minimal_memory_need, seed_layouts, seed_policies

log = logging.getLogger(__name__)

WORK_RATE = 400_000  # work units per second: about half what the reference machine (2 cores) sustains
ELITE = 6  # candidates kept as parents
POLISH_SHARE = 0.15  # share of the budget spent on order moves at the end
STEP_UNITS = 25  # work charged per search step for the move itself (pruned and cached steps cost too)


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

    plan: object
    step_ms: float
    bubble: float
    peak: tuple[int, ...]
    bound: Bound
    baselines: tuple[Baseline, ...]
    source: str  # "octopipe" or the built-in schedule it could not beat
    iterations: int
    evaluations: int
    elapsed_s: float
    stopped_by: str
    seeded_s: float  # when a plan at least as good as every fitting built-in was in hand


@dataclass(kw_only=True)
class _Budget:
    """Search-step and work accounting of one run (local to `tune`)."""

    ev: Evaluator
    units: float
    iterations: int | None
    deadline: float
    done: int = 0
    stopped_by: str = ""

    def fraction(self) -> float:
        """Share of the budget spent, 0..1 (search steps with `iterations`, else work units)."""
        if self.iterations is not None:
            return min(1.0, self.done / max(1, self.iterations))
        return min(1.0, self.ev.work / self.units)

    def left(self, upto: float = 1.0) -> bool:
        """Whether less than `upto` of the budget is spent and the wall-clock guard has not passed."""
        if time.monotonic() >= self.deadline:
            self.stopped_by = self.stopped_by or "wall clock"
            return False
        if self.fraction() >= upto:
            self.stopped_by = self.stopped_by or ("iterations" if self.iterations is not None else "work budget")
            return False
        return True


def tune(model, cluster, num_microbatches: int, *, time_budget_s: float = 60.0, seed: int = 0,
         iterations: int | None = None, progress=None) -> TuneResult:
    """Search partition, placement and per-device schedule for the fastest plan that fits memory."""
    t0 = time.monotonic()
    ev = Evaluator(model, cluster, num_microbatches)
    budget = _Budget(ev=ev, units=max(1.0, time_budget_s * WORK_RATE), iterations=iterations,
                     deadline=t0 + time_budget_s)
    rng = random.Random(seed)
    baselines = builtin_baselines(ev, model, cluster.num_devices, num_microbatches, deadline=budget.deadline)
    fitting = [b.outcome for b in baselines if b.outcome is not None and b.outcome.fits]
    floor = min(fitting, key=lambda o: o.step_ms) if fitting else None
    seeded_s = time.monotonic() - t0
    elite = _dedupe(sorted(_own_seeds(ev, model, cluster, num_microbatches, budget, floor)
                           + _builtin_elite(baselines), key=lambda t: t[0]))[:ELITE]
    best = _search(ev, rng, elite, budget, Context.of(model, cluster.num_devices, num_microbatches), progress)
    if best is not None:
        best = _polish(ev, rng, best, budget, progress)
    final, source = _choose(best, floor, baselines)
    if final is None:
        raise OutOfMemoryError(_oom_message(ev, model, cluster, num_microbatches, baselines))
    if budget.stopped_by == "wall clock":
        log.warning("tuner stopped by the wall clock before its work budget: the result may vary between runs")
    return _result(ev, final, source, baselines, budget, t0, seeded_s)


def _own_seeds(ev, model, cluster, m, budget, floor) -> list[tuple[float, object, object, Outcome]]:
    """Evaluate own layouts x seed policies, most promising layouts first; the fitting ones, best first."""
    nd = cluster.num_devices
    layouts = [lay for _, lay in seed_layouts(model, nd) if ev.static_fits(lay)]
    layouts.sort(key=ev.work_floor)
    best = floor.step_ms if floor is not None else float("inf")
    found = []
    for i, lay in enumerate(layouts):
        if i > 0 and (ev.work_floor(lay) >= best or not budget.left(0.5)):
            continue
        for pol in seed_policies(lay, nd, m):
            if (found or floor is not None) and time.monotonic() >= budget.deadline:
                break  # the time budget holds during setup: keep what is in hand
            out = ev.scheduled(lay, pol)
            if out is not None and out.fits:
                found.append((out.step_ms, lay, pol, out))
                best = min(best, out.step_ms)
    return found


def _builtin_elite(baselines) -> list:
    """The fitting built-in plans as explicit-order candidates, so partition and order moves refine them."""
    out = []
    for b in baselines:
        o = b.outcome
        if o is not None and o.fits:
            lay = Layout(bounds=tuple((st.start, st.end) for st in o.plan.stages),
                         devices=tuple(st.device for st in o.plan.stages))
            out.append((o.step_ms, lay, o.plan.schedule, o))
    return out


def _dedupe(items):
    seen, out = set(), []
    for it in items:
        key = (it[1], it[2])
        if key not in seen:
            seen.add(key)
            out.append(it)
    return out


def _search(ev, rng, elite, budget, ctx, progress):
    """Hill-climb from an elite pool with the moves of `moves.MOVES`; returns the best outcome."""
    if not elite:
        return None
    stop_at = 1.0 - POLISH_SHARE
    while budget.left(stop_at):
        budget.done += 1
        ev.work += STEP_UNITS
        parent = elite[0] if rng.random() < 0.6 else rng.choice(elite)
        cand = _neighbour(rng, ctx, parent[1], parent[2])
        if cand is None or not ev.static_fits(cand[0]) or ev.work_floor(cand[0]) >= elite[0][0] - 1e-9:
            continue
        out = ev.run(*cand)
        if out is not None and out.fits and out.step_ms <= parent[0]:
            elite = _dedupe(sorted(elite + [(out.step_ms, cand[0], cand[1], out)], key=lambda t: t[0]))[:ELITE]
        if progress is not None:
            progress(Progress(iteration=budget.done, best_ms=elite[0][0], bubble=elite[0][3].bubble,
                              fraction=budget.fraction(), phase="search"))
    return elite[0][3]


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


def _polish(ev, rng, best: Outcome, budget, progress) -> Outcome:
    """Order moves on the critical path of the best plan until the budget ends."""
    slots = critical_slots(ev, best.plan)
    misses = 0
    while budget.left(1.0) and misses < 200:
        budget.done += 1
        ev.work += STEP_UNITS
        better = polish_step(ev, rng, best, slots)
        if better is None:
            misses += 1
        else:
            best, misses = better, 0
            slots = critical_slots(ev, best.plan)
        if progress is not None:
            progress(Progress(iteration=budget.done, best_ms=best.step_ms, bubble=best.bubble,
                              fraction=budget.fraction(), phase="polish"))
    return best


def _choose(best, floor, baselines):
    """The tuned plan, or the best fitting built-in when the search did not beat it."""
    if best is not None and (floor is None or best.step_ms <= floor.step_ms):
        return best, "octopipe"
    if floor is None:
        return None, ""
    b = next(b for b in baselines if b.outcome is floor)
    return floor, f"{b.name} ({b.split} split, v={b.stages_per_device})"


def _result(ev, final: Outcome, source, baselines, budget, t0, seeded_s) -> TuneResult:
    plan, res = _without_empty_stages(ev, final.plan)
    meta = dict(plan.meta)
    meta["tuner"] = {"source": source, "iterations": budget.done, "evaluations": ev.evaluations}
    plan = replace(plan, predicted=res.summary(), meta=meta)
    bound = lower_bound(ev.model, ev.cluster.num_devices, ev.m)
    return TuneResult(plan=plan, step_ms=res.step_time_ms, bubble=res.bubble_ratio,
                      peak=tuple(res.peak_memory_bytes), bound=bound, baselines=tuple(baselines), source=source,
                      iterations=budget.done, evaluations=ev.evaluations, elapsed_s=time.monotonic() - t0,
                      stopped_by=budget.stopped_by or "converged", seeded_s=seeded_s)


def _without_empty_stages(ev, plan):
    """Prefer the plan without empty stages when it is no slower and still fits (it never needs more memory)."""
    res = simulate(ev.model, ev.cluster, plan, detail=False)
    pruned = drop_empty_stages(plan)
    if pruned is plan:
        return plan, res
    res_p = simulate(ev.model, ev.cluster, pruned, detail=False)
    if res_p.step_time_ms <= res.step_time_ms and max(res_p.peak_memory_bytes) <= ev.cluster.memory_bytes:
        return pruned, res_p
    return plan, res


def _oom_message(ev, model, cluster, m, baselines) -> str:
    """Name the smallest per-device memory any plan needed."""
    need = [b.outcome.max_peak for b in baselines if b.outcome is not None]
    need.append(minimal_memory_need(ev, model, cluster.num_devices))
    least = min(need)
    return (f"no plan fits the {cluster.memory_bytes / 2**30:.1f} GiB per device of {cluster.name} for {model.name} "
            f"on {cluster.num_devices} devices with {m} micro-batches; the smallest per-device memory any plan "
            f"needed (one micro-batch in flight included) was {least / 2**30:.2f} GiB. Try: more devices (a larger cluster), full activation recompute "
            f"(`recompute: true` in the architecture, or `octopipe model ... --recompute -o m.json`), tensor "
            f"parallelism (--tp) or a larger --dp to shard the optimizer, or a GPU with more memory")
