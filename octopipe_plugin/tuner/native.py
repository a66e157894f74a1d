"""The best plan each framework runs unmodified, found among the built-in runs of a tuning result.

The headline gain over Megatron's interleaved 1F1B on its even split flatters a tuner: a balanced
split alone buys much of it. These are the honest references, the fastest fitting plan a user
gets without OctoPipe's executor:

- Megatron: its own schedule (interleaved 1F1B, or 1F1B at v = 1) on a looped placement with the
  same number of virtual stages per rank, on any boundaries a `--pipeline-model-parallel-layout`
  string can express (the even split and the balanced split are both such strings).
- DeepSpeed: its PipelineEngine's 1F1B, one stage per rank, on the better of the two splits.

With the model and cluster, the best one's boundaries are then refined (`refine`): a hill-climb
moving one boundary by one layer at a time, the schedule fixed, while the step gets faster and
memory fits, so the reference is the best layout string found, not merely the balanced split.
`octopipe plan` holds the refinements to its --time-budget (`max_actions`, `deadline`): a run
left unrefined is still one the framework runs, from the split it started on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..errors import DeadlockError, PlanError
from ..simulator.pairs import communicates

# framework -> (built-in schedules it runs as they are, stages per device it takes: None for any)
NATIVE = {
    "megatron": (("interleaved-1f1b", "1f1b"), None),
    "deepspeed": (("1f1b",), 1),
}
# and, where the model communicates (an expert-parallel all-to-all), what the framework runs to hide it: Megatron's
# --overlap-moe-expert-parallel-comm (with expert parallelism only) runs its combined 1F1B
OVERLAPPED = {
    "megatron": ("combined-1f1b",),
    "deepspeed": (),
}
WHAT = {
    "megatron": "stock Megatron",
    "deepspeed": "stock DeepSpeed",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class NativeBest:
    """The fastest fitting built-in run a framework runs unmodified."""

    framework: str
    schedule: str
    split: str
    stages_per_device: int
    step_ms: float
    peak_bytes: int
    bounds: tuple[tuple[int, int], ...] = ()  # stage layer ranges, when refined
    moves: int = 0  # boundary moves the refinement kept

    def describe(self) -> str:
        """'interleaved-1f1b, layout string from the balanced split + 3 boundary moves, v=2' and the like."""
        where = "partition" if self.framework == "deepspeed" else "layout string"
        moved = f" + {self.moves} boundary move{'s' if self.moves > 1 else ''}" if self.moves else ""
        return f"{self.schedule}, {where} from the {self.split} split{moved}, v={self.stages_per_device}"


def native_runs(baselines, framework: str, model=None) -> list[NativeBest]:
    """Every fitting run among `baselines` that `framework` runs unmodified, fastest first, one per (split, v);
    with a `model` that communicates, its overlapped schedules too (OVERLAPPED)."""
    names, v = NATIVE[framework]
    if communicates(model):
        names = names + OVERLAPPED[framework]
    runs = sorted((b for b in baselines if b.name in names and b.outcome is not None and b.outcome.fits
                   and (v is None or b.stages_per_device == v)), key=lambda r: (r.outcome.step_ms, r.name))
    out, seen = [], set()
    for b in runs:  # interleaved 1F1B at v = 1 is 1F1B: one of them
        if (b.split, b.stages_per_device) not in seen:
            seen.add((b.split, b.stages_per_device))
            out.append(NativeBest(framework=framework, schedule=b.name, split=b.split,
                                  stages_per_device=b.stages_per_device, step_ms=b.outcome.step_ms,
                                  peak_bytes=b.outcome.max_peak))
    return out


def native_best(baselines, framework: str, model=None, cluster=None, num_microbatches: int | None = None,
                options=None, *, max_actions: float = float("inf"), deadline: float | None = None) -> NativeBest | None:
    """The fastest fitting plan `framework` runs unmodified; None when none fits.

    With the model, cluster and micro-batch count, every fitting run's boundaries are refined
    first (each split and v, fastest first: a hill-climb can end far from where it started), all of
    them within `max_actions` simulated actions and, as a guard, before `deadline` (time.monotonic).
    """
    runs = native_runs(baselines, framework, model)
    if model is not None and cluster is not None and num_microbatches is not None:
        out = []
        for r in runs:
            r, used = _refine(r, model, cluster, num_microbatches, options, min(MAX_SIMULATED_ACTIONS, max_actions),
                              deadline)
            max_actions -= used
            out.append(r)
        runs = out
    return min(runs, key=lambda r: r.step_ms) if runs else None


MAX_SIMULATED_ACTIONS = 2_000_000  # work cap of one refinement (about a second on the reference machine)
ACTIONS_PER_SECOND = MAX_SIMULATED_ACTIONS  # what `octopipe plan` buys refinements with per second of its budget


def refine(best: NativeBest, model, cluster, num_microbatches: int, options=None) -> NativeBest:
    """`best` with its boundaries hill-climbed (one boundary, one layer, first improvement, fixed order: deterministic)."""
    return _refine(best, model, cluster, num_microbatches, options)[0]


def _refine(best: NativeBest, model, cluster, num_microbatches: int, options=None,
            max_actions: float = MAX_SIMULATED_ACTIONS, deadline: float | None = None) -> tuple[NativeBest, int]:
    """`refine` within `max_actions` simulated actions (and before `deadline`); with the actions it simulated."""
    from ..partition import balanced_split, megatron_split
    from ..schedules.registry import build_plan
    from ..simulator import simulate

    nd, v = cluster.num_devices, best.stages_per_device
    n = nd * v
    per_sim = 3 * n * num_microbatches
    budget = int(max_actions // max(1, per_sim))
    if budget < 2 * n or (deadline is not None and time.monotonic() >= deadline):
        return best, 0  # not even one pass over the boundaries: keep the built-in as it ran

    def judge(bounds):
        try:
            plan = build_plan(model, best.schedule, nd, num_microbatches, stages_per_device=v,
                              boundaries=bounds, validate=False)
            res = simulate(model, cluster, plan, options, detail=False)
        except (PlanError, DeadlockError):
            return None
        peak = max(res.peak_memory_bytes)
        return (res.step_time_ms, peak) if peak <= cluster.usable_memory_bytes else None

    start = balanced_split(model, n) if best.split == "balanced" else megatron_split(model, n)
    cuts = [a for a, _ in start[1:]]
    step, peak = best.step_ms, best.peak_bytes
    moves, sims, improved = 0, 0, True
    while improved and sims < budget:
        improved = False
        for k in range(len(cuts)):
            for d in (-1, 1):
                lo = cuts[k - 1] + 1 if k else 1
                hi = cuts[k + 1] - 1 if k + 1 < len(cuts) else model.num_layers - 1
                new = cuts[k] + d
                if not lo <= new <= hi or sims >= budget:
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    budget = sims  # the wall-clock guard: the best found so far stands
                    break
                trial = cuts[:k] + [new] + cuts[k + 1:]
                sims += 1
                got = judge(list(zip([0, *trial], [*trial, model.num_layers])))
                if got is not None and got[0] < step - 1e-9:
                    cuts, (step, peak), moves, improved = trial, got, moves + 1, True
    if not moves:
        return best, sims * per_sim
    return replace(best, step_ms=step, peak_bytes=peak, moves=moves,
                   bounds=tuple(zip([0, *cuts], [*cuts, model.num_layers]))), sims * per_sim
