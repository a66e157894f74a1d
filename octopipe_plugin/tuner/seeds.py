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

SPLITS = ("megatron", "balanced")
MAX_CHUNKS = 4  # stages per device tried by the seeds (Megatron's useful range)


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    """One built-in schedule on one split: its outcome, or why it could not run."""

    name: str
    split: str
    stages_per_device: int
    outcome: Outcome | None
    reason: str = ""


def chunk_counts(model, num_devices: int) -> list[int]:
    """Stages per device worth trying: 1..4 while every stage can still own a layer."""
    return [v for v in range(1, MAX_CHUNKS + 1) if v == 1 or num_devices * v <= model.num_layers]


def builtin_baselines(ev: Evaluator, model, num_devices: int, num_microbatches: int,
                      deadline: float | None = None) -> list[Baseline]:
    """Every registry schedule (interleaved-1f1b, interleaved-zb at each useful v) on both splits.

    Past `deadline` (time.monotonic()), once one fitting baseline is in hand, the rest are listed
    as not run, so the time budget holds during setup too.
    """
    out = []
    for name, spec in SCHEDULES.items():
        vs = chunk_counts(model, num_devices) if spec.stages_per_device is None else [
            spec.stages_per_device]
        for v in vs:
            for split in SPLITS:
                if deadline is not None and time.monotonic() >= deadline and any(
                        b.outcome is not None and b.outcome.fits for b in out):
                    out.append(Baseline(name=name, split=split, stages_per_device=v, outcome=None,
                                        reason="not run: time budget spent"))
                    continue
                out.append(_baseline(ev, model, name, split, v, num_devices, num_microbatches))
    return out


def _baseline(ev: Evaluator, model, name, split, v, num_devices, num_microbatches) -> Baseline:
    try:
        plan = build_plan(model, name, num_devices, num_microbatches, stages_per_device=v, split=split)
    except PlanError as exc:  # the schedule cannot serve this configuration
        return Baseline(name=name, split=split, stages_per_device=v, outcome=None, reason=str(exc))
    out = ev.simulated(plan)
    reason = "" if out is not None else "deadlocks"
    return Baseline(name=name, split=split, stages_per_device=v, outcome=out, reason=reason)


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


def seed_policies(layout: Layout, num_devices: int, num_microbatches: int) -> list[Policy]:
    """Greedy (memory-capped only), 1F1B-depth and fused variants for one layout."""
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
    return least if least is not None else ev.cluster.memory_bytes + 1
