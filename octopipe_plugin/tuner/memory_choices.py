"""The tuner's memory-choice move: per-layer recompute, selective recompute and offload bought where memory binds.

A candidate plan over usable memory (a schedule with more micro-batches in flight, ZB-V, deeper interleaving,
DualPipeV) is repaired before it is dropped (`repair`, called by the evaluator): per device over memory, the layers
of its stages take the choices that free the most bytes for the least time (docs/formats.md "Memory choices";
each choice's bytes and time from `simulator/costs.py` `layer_memory`), greedily by marginal cost per byte at the
peak, then the simulator judges; each round adds choices for what is still over. Three mixes are tried (recompute
only, offload only, both) as the user's `MemoryLevers` allow, and the fastest fitting plan kept. The list scheduler
caps in-flight activations by memory, so `relaxed_candidates` also schedules the seed layouts under looser caps and
repairs those, and `trim_step` (the polish) drops or swaps single choices where the plan still fits.

`MemoryLevers` is what the user allows: `recompute` none | auto | full (every layer recomputed), `offload` none |
auto. The library's default is none (a caller opts in: plans of today stay as they are); `octopipe plan` defaults
to auto. A plan nothing forces over memory is judged exactly as without levers (no choice, no work charged).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import OctoPipeError, PlanError
from ..formats.memory import CONTAINS, OFFLOAD, OFFLOAD_W, RECOMPUTE, SELECTIVE, MemoryChoice

RECOMPUTE_MODES = ("none", "auto", "full")
OFFLOAD_MODES = ("none", "auto")
ROUNDS = 5  # repair rounds per mix: each adds choices for what the simulator still finds over memory
OFFLOAD_WEIGHT = 0.3  # a copy overlaps compute: the mixed repair counts this share of its time as cost


@dataclass(frozen=True, slots=True)
class MemoryLevers:
    """Which memory choices the tuner may make: recompute none | auto | full, offload none | auto."""

    recompute: str = "none"
    offload: str = "none"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_MODES:
            raise OctoPipeError(f"--recompute {self.recompute!r}: expected one of {', '.join(RECOMPUTE_MODES)}")
        if self.offload not in OFFLOAD_MODES:
            raise OctoPipeError(f"--offload {self.offload!r}: expected one of {', '.join(OFFLOAD_MODES)}")

    @property
    def auto(self) -> bool:
        """Whether the tuner may add choices to a plan over memory."""
        return self.recompute == "auto" or self.offload == "auto"

    @property
    def full(self) -> bool:
        """Whether every layer is recomputed (`--recompute full`)."""
        return self.recompute == "full"

    def describe(self) -> str:
        """The levers as the options that set them."""
        return f"--recompute {self.recompute} --offload {self.offload}"


NONE = MemoryLevers()
AUTO = MemoryLevers("auto", "auto")


def full_recompute(model, plan):
    """The plan with every layer recomputed that the model does not already cost recomputed (`--recompute full`)."""
    got = []
    for layer in range(model.num_layers):
        try:
            _costs(model, layer, MemoryChoice(RECOMPUTE))
        except PlanError:
            continue
        got.append((layer, MemoryChoice(RECOMPUTE)))
    return replace(plan, memory=tuple(got))


def full_job(model, job, layout):
    """The list scheduler's job with every layer recomputed: F keeps the layers' inputs, I and B re-run the forwards."""
    from ..formats import Plan
    from ..simulator.costs import memory_costs

    plan = full_recompute(model, Plan(model=model.name, num_devices=job.num_devices, num_microbatches=1,
                                      stages=layout.stages(), schedule=((),) * job.num_devices))
    mc = memory_costs(model, plan)
    kept = tuple(k + r for k, r in zip(mc.kept, mc.remat_b))  # B brings one layer back while it runs
    fused = None if job.fused is None else tuple(f + x for f, x in zip(job.fused, mc.extra_ms))
    return replace(job, activation=kept, bwd=tuple(b + x for b, x in zip(job.bwd, mc.extra_ms)), fused=fused)


def _costs(model, layer: int, choice):
    from ..simulator.costs import layer_memory

    return layer_memory(model, layer, choice)


def layer_options(model, cluster, layer: int, levers: MemoryLevers) -> list[tuple[int, float, float, MemoryChoice]]:
    """A layer's choices the levers allow as (bytes freed, recompute ms, copy ms, choice), cheapest first: its
    selective sets (each module, and all of them), full recompute, offload; only those that free more than the
    cheaper ones (the Pareto front on freed bytes per recompute ms)."""
    act = model.layers[layer].activation_bytes
    cands = []
    if levers.recompute == "auto":
        cands += _selective_choices(model, layer)
        cands.append(MemoryChoice(RECOMPUTE))
    out = []
    for choice in cands:
        try:
            kept, rerun, _, _ = _costs(model, layer, choice)
        except PlanError:
            continue
        if act - kept > 0:
            out.append((act - kept, rerun, 0.0, choice))
    out.sort(key=lambda o: (o[1], -o[0]))
    front, best = [], 0
    for o in out:
        if o[0] > best:
            front.append(o)
            best = o[0]
    if levers.offload == "auto" and act > 0:
        front.append((act, 0.0, cluster.host_copy_ms(act, model.host_link_gb_per_s), MemoryChoice(OFFLOAD)))
    return front


def _selective_choices(model, layer: int) -> list[MemoryChoice]:
    from ..simulator.costs import selective_modules

    mods = list(selective_modules(model, layer))
    out = [MemoryChoice(SELECTIVE, (m,)) for m in mods]
    whole = [m for m in mods if not any(m in inner and outer in mods for outer, inner in CONTAINS.items())]
    if len(whole) > 1:
        out.append(MemoryChoice(SELECTIVE, tuple(sorted(whole))))
    return out


def _in_flight(plan, between_i_and_w: bool = False) -> list[int]:
    """Per stage the most micro-batches its device's order holds between F and the backward (or between I and W)."""
    from ..actions import Kind

    opens, closes = ((Kind.I,), (Kind.W,)) if between_i_and_w else ((Kind.F,), (Kind.B, Kind.I))
    live = [0] * len(plan.stages)
    most = [0] * len(plan.stages)
    for row in plan.schedule:
        for a in row:
            if a.rule.side is not None:
                continue
            if a.kind in opens:
                live[a.stage] += 1
                most[a.stage] = max(most[a.stage], live[a.stage])
            elif a.kind in closes:
                live[a.stage] -= 1
    return most


def _w_options(ev):
    """Per layer its one `offload_w` option (what W reads goes to the host between I and W), cached as `_options`."""
    got = ev._jobs.get("memory options w")
    if got is None:
        rate = ev.model.host_link_gb_per_s
        got = [[(lay.activation_bytes, 0.0, ev.cluster.host_copy_ms(lay.activation_bytes, rate),
                 MemoryChoice(OFFLOAD_W))] if lay.activation_bytes > 0 else [] for lay in ev.model.layers]
        ev._jobs["memory options w"] = got
    return got


def _options(ev, levers: MemoryLevers):
    """Per layer its options (cached on the evaluator: the model and cluster do not change)."""
    key = ("memory options", levers)
    got = ev._jobs.get(key)
    if got is None:
        got = [layer_options(ev.model, ev.cluster, i, levers) for i in range(ev.model.num_layers)]
        ev._jobs[key] = got
    return got


def _grow(plan, over: list[int], chosen: dict, opts, weight: float, margin: float, w: bool = False) -> int:
    """Add choices to `chosen` (layer -> option index) on every device over memory until the bytes freed at the
    peak (freed x micro-batches in flight: between I and W for `w`'s offload_w) cover its excess x margin, cheapest
    per byte first; how many it added."""
    flight = _in_flight(plan, w)
    added = 0
    for d, excess in enumerate(over):
        if excess <= 0:
            continue
        layers = [(i, s) for s, st in enumerate(plan.stages) if st.device == d for i in range(st.start, st.end)]
        need = excess * margin
        while need > 0:
            best = None
            for i, s in layers:
                cur = chosen.get(i, -1)
                if cur + 1 >= len(opts[i]):
                    continue
                freed0 = opts[i][cur][0] if cur >= 0 else 0
                cost0 = (opts[i][cur][1] + weight * opts[i][cur][2]) if cur >= 0 else 0.0
                nxt = opts[i][cur + 1]
                gain = (nxt[0] - freed0) * max(1, flight[s])
                if gain <= 0:
                    continue
                ratio = (nxt[1] + weight * nxt[2] - cost0) / gain
                if best is None or ratio < best[0]:
                    best = (ratio, i, gain)
            if best is None:
                break
            chosen[best[1]] = chosen.get(best[1], -1) + 1
            need -= best[2]
            added += 1
    return added


def _mixes(levers: MemoryLevers, deferred_w: bool) -> list[tuple[MemoryLevers, float, bool]]:
    """(levers, copy weight, offload_w instead) of each repair tried; offload_w where the plan defers a W."""
    out = []
    if levers.recompute == "auto":
        out.append((MemoryLevers("auto", "none"), 0.0, False))
    if levers.offload == "auto":
        out.append((MemoryLevers("none", "auto"), 1.0, False))
        if deferred_w:
            out.append((MemoryLevers("none", "auto"), 1.0, True))
    if levers.recompute == "auto" and levers.offload == "auto":
        out.append((levers, OFFLOAD_WEIGHT, False))
    return out


def _defers_w(plan) -> bool:
    """Whether some I's W is not the next action of its device (its bytes wait between them)."""
    from ..actions import Kind

    return any(a.kind is Kind.I and (p + 1 >= len(row) or row[p + 1].kind is not Kind.W
                                     or row[p + 1].microbatch != a.microbatch or row[p + 1].stage != a.stage)
               for row in plan.schedule for p, a in enumerate(row))


def repair(ev, plan, sc, out, judge):
    """The fastest plan the memory choices make fit from `plan` (its simulated outcome `out` over usable memory), or
    None. `judge(plan, sc)` simulates a plan without repairing it. The plan's own choices are kept."""
    if getattr(plan, "splits", ()) or out is None:
        return None
    usable = ev.cluster.usable_memory_bytes
    base = dict(plan.memory)
    best = None
    for levers, weight, w in _mixes(ev.levers, _defers_w(plan)):
        opts = _w_options(ev) if w else _options(ev, levers)
        chosen: dict = {}
        cur, margin = out, 1.05
        for _ in range(ROUNDS):
            over = [p - usable for p in cur.peak]
            if not _grow(plan, over, chosen, opts, weight, margin, w):
                break
            memory = dict(base)
            memory.update({i: opts[i][k][3] for i, k in chosen.items() if i not in base})
            cand = replace(plan, memory=tuple(sorted(memory.items())))
            try:
                got = judge(cand, sc)
            except PlanError:  # e.g. the offloads exceed host memory
                got = None
            if got is None:
                break
            cur = got
            if got.fits:
                if best is None or got.step_ms < best.step_ms:
                    best = got
                break
            margin *= 1.5
    return best


def relaxed_candidates(ev, layouts, policies_of, below_ms: float = float("inf"), limit: int = 3,
                       factors=(2.0, 4.0)):
    """Plans scheduled by the list scheduler with its memory caps loosened by `factors` (more micro-batches in
    flight) and repaired by memory choices: (layout, plan outcome) of those that fit faster than `below_ms`. The
    work of a probe that finds none is given back, so a model memory does not bind is tuned exactly as without
    levers, and a probe that finds nothing faster costs the search nothing."""
    from .listsched import build_schedule, schedule_units

    if not ev.levers.auto:
        return []
    work, evals = ev.meter.work, ev.meter.evaluations
    found = []
    for lay in layouts[:limit]:
        job, sc, _ = ev.job(lay)
        for pol in policies_of(lay):
            for f in factors:
                loose = replace(job, act_cap=tuple(c * f for c in job.act_cap))
                ev.work += schedule_units(job)
                sched = build_schedule(loose, pol)
                if sched is None:
                    continue
                plan = ev.plan_of(lay, sched, {"schedule": "octopipe", "policy": pol.describe()})
                got = ev.simulated(plan, costs=sc, pair=False)
                if got is not None and got.fits and got.plan is not None and got.plan.memory and \
                        got.step_ms < below_ms:
                    found.append((lay, got))
    if not found:
        ev.meter.work, ev.meter.evaluations = work, evals
    return found


def repaired_builtins(ev, model, baselines, build, below_ms: float = float("inf")) -> list:
    """The built-ins over memory at the search count (`baselines`' search outcomes that do not fit), rebuilt by
    `build` (seeds' builder, passed in: seeds imports the evaluator, which imports this module) and repaired by
    memory choices: (layout, outcome) of those that fit faster than `below_ms`. The work of finding none is given
    back."""
    from .layout import Layout

    if not ev.levers.auto:
        return []
    work, evals = ev.meter.work, ev.meter.evaluations
    found, ranges = [], {}
    for b in baselines:
        if b.search is None or b.search.fits:
            continue
        plan, _ = build(model, b.name, b.split, b.stages_per_device, ev.cluster.num_devices, ev.m, ranges)
        if plan is None:
            continue
        got = ev.simulated(plan)
        if got is not None and got.fits and got.plan is not None and got.plan.memory and got.step_ms < below_ms:
            found.append((Layout.of_stages(plan.stages), got))
    if not found:
        ev.meter.work, ev.meter.evaluations = work, evals
    return found


def trim_step(ev, rng, best):
    """Polish: drop one memory choice of the plan in hand, or swap recompute and offload on it; the better plan that
    still fits, or None."""
    memory = dict(best.plan.memory)
    if not memory or ev.levers.full:  # --recompute full keeps every layer recomputed
        return None
    layer = rng.choice(sorted(memory))
    choice = memory[layer]
    if rng.random() < 0.6 or choice.kind == SELECTIVE:
        memory.pop(layer)
    elif choice.kind == RECOMPUTE and ev.levers.offload == "auto":
        memory[layer] = MemoryChoice(OFFLOAD)
    elif choice.kind == OFFLOAD and ev.levers.recompute == "auto":
        memory[layer] = MemoryChoice(RECOMPUTE)
    else:
        memory.pop(layer)
    try:
        out = ev.simulated(replace(best.plan, memory=tuple(sorted(memory.items()))), repair=False)
    except PlanError:
        return None
    if out is not None and out.fits and out.step_ms < best.step_ms - 1e-9:
        return out
    return None
