"""Starting points: every built-in schedule on both splits, and the tuner's own layouts and policies."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..errors import PlanError
from ..partition import balanced_split, megatron_split
from ..schedules.placement import Placement, place
from ..schedules.registry import SCHEDULES, build_plan
from .evaluate import Evaluator, Outcome
from .layout import Layout
from .listsched import Order, Policy, Split, WFill, build_schedule
from .moves import rebalance
from .encoded import ActionTable
from .periodic import extend_schedule

SPLITS = ("megatron", "balanced")
NOT_RUN = "not run: time budget spent"
MAX_CHUNKS = 4  # stages per device tried by the seeds (Megatron's useful range)


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    """One built-in schedule on one split: its outcome, or why it could not run.

    `search` is the same schedule at the search's micro-batch count (the same outcome when the
    search runs at the full count). To keep long runs small, only the fastest fitting full plan
    and the ELITE fastest fitting search plans keep their schedules; other outcomes keep figures only.
    """

    name: str
    split: str
    stages_per_device: int
    outcome: Outcome | None
    reason: str = ""
    search: Outcome | None = None


def chunk_counts(model, num_devices: int) -> list[int]:
    """Stages per device worth trying: 1..4 while every stage can still own a layer."""
    return [v for v in range(1, MAX_CHUNKS + 1) if v == 1 or num_devices * v <= model.num_layers]


def builtin_configs(model, num_devices: int) -> list[tuple[str, str, int]]:
    """(schedule, split, stages per device) of every built-in run the tuner compares with."""
    out = []
    for name, spec in SCHEDULES.items():
        vs = chunk_counts(model, num_devices) if spec.stages_per_device is None else [spec.stages_per_device]
        out += [(name, split, v) for v in vs for split in SPLITS]
    return out


def builtin_baselines(ev: Evaluator, model, num_devices: int, num_microbatches: int, *,
                      search_ev: Evaluator | None = None, on_result=None, keep: int = 6,
                      deadline: float | None = None) -> list[Baseline]:
    """Every registry schedule (interleaved-1f1b, interleaved-zb at each useful v) on both splits.

    With `search_ev` at fewer micro-batches, each schedule is first built and simulated there
    (cheap), then taken to the full count fastest first: grown by its periodic steady state
    (tuner/periodic.py), or built afresh where it shows none, and simulated. `on_result` sees
    each Baseline as soon as its full outcome is known (the anytime plan in hand). Past
    `deadline` (time.monotonic()), once one fitting baseline is in hand, the rest are listed as
    not run, so the time budget holds during setup too.
    """
    search_ev = search_ev or ev
    m_s = search_ev.m
    ranges: dict[tuple[str, int], list] = {}
    table = ActionTable()
    staged = []  # (config, plan at the search count or None, search outcome, reason)
    seen: list = []
    for name, split, v in builtin_configs(model, num_devices):
        if _late(deadline) and any(o is not None and o.fits for _, _, o, _ in staged):
            staged.append(((name, split, v), None, None, NOT_RUN))
            continue
        plan, reason = _build(model, name, split, v, num_devices, m_s, ranges)
        out = None
        if plan is not None:
            out = _judge(search_ev, seen, plan)
            reason = "" if out is not None else "deadlocks"
        staged.append(((name, split, v), plan, out, reason))
    order = sorted(range(len(staged)), key=lambda i: _rank(staged[i][2]))
    results: list[Baseline | None] = [None] * len(staged)
    full_seen: list = []
    best = None  # index of the fastest fitting full outcome so far: the only full schedule kept meanwhile
    for i in order:
        (name, split, v), plan, s_out, reason = staged[i]
        full = s_out
        if m_s != num_microbatches and s_out is not None and _late(deadline) and best is not None:
            full, reason = None, NOT_RUN
        elif m_s != num_microbatches and reason != NOT_RUN:
            full, reason = _full_outcome(ev, model, name, split, v, num_devices, num_microbatches, plan, ranges,
                                         table, full_seen, reason)
        b = Baseline(name=name, split=split, stages_per_device=v, outcome=full, reason=reason, search=s_out)
        results[i] = b
        if on_result is not None:
            on_result(b)
        if m_s != num_microbatches and full is not None and full.plan is not None:
            if full.fits and (best is None or full.step_ms < results[best].outcome.step_ms):
                best, old = i, best
            else:
                old = i
            if old is not None:
                results[old] = replace(results[old], outcome=replace(results[old].outcome, plan=None))
    return _strip(results, keep)


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _rank(out: Outcome | None):
    """Fitting outcomes fastest first, then the rest fastest first, then the failed."""
    if out is None:
        return (2, 0.0)
    return (0 if out.fits else 1, out.step_ms)


def _build(model, name, split, v, num_devices, m, ranges):
    """(plan, "") of a built-in at m micro-batches, or (None, why it cannot run)."""
    n = num_devices * v
    try:
        spec = SCHEDULES[name]
        spec.check(num_devices, m, v)
        key = (split, n)
        if key not in ranges:
            ranges[key] = balanced_split(model, n) if split == "balanced" else megatron_split(model, n)
        plan = build_plan(model, name, num_devices, m, stages_per_device=v, boundaries=ranges[key], validate=False)
    except PlanError as exc:  # the schedule cannot serve this configuration
        return None, str(exc)
    return replace(plan, meta={**plan.meta, "split": split}), ""


def _full_outcome(ev, model, name, split, v, num_devices, m, plan, ranges, table, seen, reason):
    """The built-in's outcome at the full count: its short plan grown periodically, else built at m (a plan with
    pairs always: the growth repeats actions, not the pairs between them)."""
    full_plan = None
    if plan is not None and not plan.pairs:
        grown = extend_schedule(plan.schedule, plan.num_microbatches, m, table)
        if grown is not None:
            full_plan = replace(plan, num_microbatches=m, schedule=grown)
    if full_plan is None:
        full_plan, reason = _build(model, name, split, v, num_devices, m, ranges)
        if full_plan is None:
            return None, reason
    out = _judge(ev, seen, full_plan)
    return out, "" if out is not None else "deadlocks"


def _strip(baselines: list[Baseline], keep: int) -> list[Baseline]:
    """Drop the schedules nobody will use: all but the fastest fitting full plan and `keep` search plans."""
    fitting = [b for b in baselines if b.outcome is not None and b.outcome.fits]
    best = min(fitting, key=lambda b: b.outcome.step_ms) if fitting else None
    ranked = sorted((b for b in baselines if b.search is not None and b.search.fits), key=lambda b: b.search.step_ms)
    elite = {id(b) for b in ranked[:keep]}
    out = []
    for b in baselines:
        same = b.search is b.outcome
        kept = b.outcome is None or b is best or (same and id(b) in elite)
        full = b.outcome if kept else replace(b.outcome, plan=None)
        if same:
            search = full
        elif b.search is None or id(b) in elite:
            search = b.search
        else:
            search = replace(b.search, plan=None)
        out.append(replace(b, outcome=full, search=search))
    return out


def _lookup(seen: list, plan):
    """The outcome of an identical plan judged before (interleaved at v=1 is 1F1B / ZB-H1), else KeyError."""
    for stages, schedule, out in seen:
        if stages == plan.stages and len(schedule) == len(plan.schedule) and schedule == plan.schedule:
            return out
    raise KeyError


def _judge(ev: Evaluator, seen: list, plan):
    """Simulate a plan unless an identical one was (as the built-in runs: no memory choices added,
    tuner/memory_choices.py `repaired_builtins` repairs those over memory)."""
    try:
        return _lookup(seen, plan)
    except KeyError:
        out = ev.simulated(plan, repair=False)
        seen.append((plan.stages, plan.schedule, out))
        return out


def seed_layouts(model, num_devices: int) -> list[tuple[str, Layout]]:
    """Own layouts: balanced, Megatron and device-rebalanced partitions under looped and V placements."""
    out, seen = [], set()
    for v in chunk_counts(model, num_devices):
        placements = [Placement.LOOPED] + ([Placement.V] if v >= 2 else [])
        for pl in placements:
            devices = tuple(place(pl, num_devices, v))
            n = num_devices * v
            for split, bounds in (("balanced", balanced_split(model, n)), ("megatron", megatron_split(model, n))):
                lay = Layout(bounds=tuple(tuple(b) for b in bounds), devices=devices)
                for tag, cand in ((split, lay), (f"{split}+rebalanced", rebalance(model, lay, num_devices))):
                    if cand not in seen:
                        seen.add(cand)
                        out.append((f"{pl.value} v={v} {tag}", cand))
    return out


def seeded_plans(ev, layout: Layout, num_devices: int, num_microbatches: int, constraints=None, *,
                 pairings=(None,), keep: int = 2) -> list:
    """The `keep` fastest fitting plans of `layout`, list-scheduled by evaluator `ev` under the seed policies
    (each with every pair mode of `pairings`, None: the policy's own) and keeping to `constraints`."""
    split_backward = constraints is None or constraints.split_backward
    found = []
    for pol in seed_policies(layout, num_devices, num_microbatches, split_backward=split_backward):
        for mode in pairings:
            out = ev.scheduled(layout, pol if mode is None else replace(pol, pair=mode))
            if out is None or out.plan is None or not out.fits:
                continue
            if constraints is not None and not constraints.allows_plan(out.plan):
                continue
            found.append(out)
    found.sort(key=lambda o: o.step_ms)
    return [o.plan for o in found[:keep]]


def seed_policies(layout: Layout, num_devices: int, num_microbatches: int, *,
                  split_backward: bool = True) -> list[Policy]:
    """Greedy (memory-capped only), 1F1B-depth and fused variants for one layout (all fused without split backward)."""
    pols = _seed_policies(layout, num_devices, num_microbatches)
    if split_backward:
        return pols
    fused = (Split.FUSED,) * num_devices
    out = []
    for pol in (replace(p, split=fused) for p in pols):
        if pol not in out:
            out.append(pol)
    return out


def _seed_policies(layout: Layout, num_devices: int, num_microbatches: int) -> list[Policy]:
    m, nd = num_microbatches, num_devices
    big = m * max(1, layout.num_stages // nd)
    v_shape = len(set(layout.devices[:nd])) == nd and layout.num_stages >= 2 * nd and \
        layout.devices[nd] == layout.devices[nd - 1]
    chunks = max(1, layout.num_stages // nd)
    # 1F1B's warm-up for one chunk; with several chunks Megatron's deeper warm-up, about p micro-batches
    tight = tuple(nd if (v_shape or chunks > 1) else max(1, nd - d) for d in range(nd))
    auto, fused = (Split.AUTO,) * nd, (Split.FUSED,) * nd
    return [
        Policy(depth=(m,) * nd, split=auto, w_limit=(big,) * nd),
        Policy(depth=tight, split=auto, w_limit=(big,) * nd),
        Policy(depth=(m,) * nd, split=fused, w_limit=(big,) * nd),
        Policy(depth=tight, split=auto, w_limit=(big,) * nd, f_order=Order.SHALLOW, w_fill=WFill.FIT),
    ]


def minimal_memory_need(ev: Evaluator, model, num_devices: int) -> int:
    """Smallest fullest-device peak over the seed layouts run one micro-batch at a time, ignoring the cap."""
    least = None
    for _, lay in seed_layouts(model, num_devices):
        job, sc, _ = ev.job(lay)
        loose = replace(job, act_cap=(float("inf"),) * num_devices)
        pol = Policy(depth=(1,) * num_devices, split=(Split.FUSED,) * num_devices, w_limit=(0,) * num_devices)
        schedule = build_schedule(loose, pol)
        if schedule is None:
            continue
        out = ev.simulated(ev.plan_of(lay, schedule), costs=sc)
        if out is not None and (least is None or out.max_peak < least):
            least = out.max_peak
    return least if least is not None else ev.cluster.usable_memory_bytes + 1
