"""What `octopipe plan` does once its inputs are read: size checks, the guarded search, the report.

Shared by the plain command (plan_cmd.py) and the plans from a user's own launch
(launch_plan.py): the summary with the honest headline (the gain over the best plan each
framework runs unmodified), the stage listing with node crossings, memory against headroom.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

from .. import limits as L
from ..errors import OctoPipeError
from ..formats import plan_to_dict
from ..formats.fingerprint import describe_devices, idle_devices
from ..simulator.pairs import hidden_ms, stage_phases
from ..simulator.split import without_split_layers
from ..tuner import tune
from ..tuner.compare import baseline_ms, per_device
from ..tuner.native import ACTIONS_PER_SECOND, WHAT, native_best
from ._guard import WallClockGuard
from ._options import constraints_of, load_overheads

SPLIT_S_PER_UNIT = 1e-6  # measured: balanced_split of 1100 layers into 1000 stages, 8.7 s on 2 busy cores
SHOWN = 24  # stages or devices listed one by one in the summary; larger plans are abridged


def check_size(model, cluster, num_microbatches: int, time_budget_s: float = L.MAX_TIME_BUDGET_S) -> None:
    """Refuse, before the search, a cluster with more devices than layers or a size the tuner cannot handle."""
    nd = cluster.num_devices
    if nd > model.num_layers:
        raise OctoPipeError(f"--cluster {cluster.name}: {nd} devices but {model.name} has {model.num_layers} layers, "
                            f"so {nd - model.num_layers} devices would hold no layers; use a cluster of at most "
                            f"{model.num_layers} devices")
    cells = model.num_layers * nd
    if cells > L.MAX_SPLIT_CELLS:
        raise OctoPipeError(f"--cluster {cluster.name}: {model.num_layers:,} layers x {nd:,} devices = {cells:,} cells "
                            f"for the exact balanced split, more than the {L.MAX_SPLIT_CELLS:,} the tuner handles "
                            f"(its table grows with both); use at most {L.MAX_SPLIT_CELLS // model.num_layers:,} "
                            f"devices for this model")
    # The exact balanced split (a DP over layers x stages, ~1 us per layer x stage x log2(layers) on 2 cores) is
    # the setup's largest fixed cost; the search needs at least two (a built-in baseline and the seeds).
    setup_s = 2 * SPLIT_S_PER_UNIT * model.num_layers * nd * math.log2(max(2, model.num_layers))
    if setup_s > time_budget_s:
        raise OctoPipeError(f"--time-budget {time_budget_s:g} s: setting up the search for {model.num_layers} layers "
                            f"on {nd} devices takes about {setup_s:.0f} s (balanced splits alone); raise "
                            f"--time-budget to at least {math.ceil(setup_s * 1.5)} or use fewer devices")
    size = nd * num_microbatches
    if size > L.MAX_TUNE_DEVICE_MICROBATCHES:
        raise OctoPipeError(f"--microbatches {num_microbatches} on {nd} devices: {size:,} device micro-batches, more "
                            f"than the {L.MAX_TUNE_DEVICE_MICROBATCHES:,} the tuner handles; use at most "
                            f"{max(1, L.MAX_TUNE_DEVICE_MICROBATCHES // nd):,} micro-batches here")


def tuned(args, model, cluster, num_microbatches: int, constraints=None, time_budget_s: float | None = None):
    """Run the tuner under the wall-clock guard with the options' budget (or `time_budget_s`, its share left to
    the plan without splits: cli/plan_split.py), seed and constraints."""
    budget = args.time_budget if time_budget_s is None else time_budget_s
    guard = WallClockGuard(budget)
    try:
        with _progress_bar(not args.no_progress) as bar, guard:
            result = tune(model, cluster, num_microbatches, time_budget_s=budget, seed=args.seed,
                          iterations=args.iterations, progress=bar, options=_sim_options(args),
                          constraints=constraints if constraints is not None else constraints_of(args),
                          memory=memory_levers_of(args))
    except KeyboardInterrupt:  # the tuner re-raises when it has no plan in hand yet
        if not guard.fired:
            raise
        raise OctoPipeError(f"--time-budget {args.time_budget:g} s ran out before any plan for {model.name} on "
                            f"{cluster.num_devices} devices x {num_microbatches} micro-batches was complete; raise "
                            f"--time-budget or use fewer micro-batches") from None
    if guard.fired:
        result = replace(result, stopped_by="the time budget (wall-clock guard)")
    return result


def memory_levers_of(args):
    """The memory choices `octopipe plan` lets the tuner make (--recompute, --offload; none where not asked)."""
    from ..tuner.memory_choices import MemoryLevers

    return MemoryLevers(getattr(args, "recompute", "none"), getattr(args, "offload", "none"))


def _sim_options(args):
    """The simulator options plans are tuned and judged by: the measured overheads when --overheads is given."""
    from ..simulator import SimOptions

    ov = load_overheads(args)
    return None if ov is None else SimOptions(overheads=ov)


NATIVE_SHARE = 0.25  # of --time-budget: the references' refinements (the tune's work units take about half of it)


def native_references(result, model, cluster, budget_s: float | None = None, deadline: float | None = None) -> dict:
    """Framework -> the best plan it runs unmodified (its boundaries refined), or None when none fits.

    `budget_s`: the refinements of both frameworks share NATIVE_SHARE of it in simulated actions
    (deterministic), and stop at `deadline` (time.monotonic: --time-budget's end) on a slower machine."""
    fws = ("megatron", "deepspeed")
    cap = float("inf") if budget_s is None else NATIVE_SHARE * budget_s * ACTIONS_PER_SECOND / len(fws)
    return {fw: native_best(result.baselines, fw, model, cluster, result.plan.num_microbatches, max_actions=cap,
                            deadline=deadline) for fw in fws}


def summary(result, model, cluster, costs: str = "", natives: dict | None = None) -> str:
    """Human-readable description of the tuned plan."""
    plan = result.plan
    idle = idle_devices(plan)
    base = baseline_ms(result.baselines)
    gain = f"{base / result.step_ms:.2f}x faster than Megatron interleaved 1F1B ({base:.1f} ms)" if base else \
        "no fitting Megatron interleaved 1F1B plan to compare with"
    peaks = _abridged([f"{p / 2**30:.1f}" for p in result.peak], ", ")
    if len(result.peak) > SHOWN:
        top = max(range(len(result.peak)), key=lambda d: result.peak[d])
        peaks += f" (largest {result.peak[top] / 2**30:.1f} on device {top})"
    cons = getattr(result, "constraints", None)
    return "\n".join([
        f"OctoPipe plan for {model.name} on {cluster.name} ({cluster.num_devices} devices), "
        f"{plan.num_microbatches} micro-batches",
        f"  step time      {result.step_ms:.1f} ms   bubble {result.bubble:.1%}   "
        f"{result.bound.describe()} -> {result.step_ms / result.bound.value_ms:.3f}x of it",
        f"  gain           {gain}",
        *[f"                 {line}" for line in native_gains(result, natives)],
        *([f"  costs          {costs}"] if costs else []),
        *([f"  constraints    {cons.describe()}"] if cons is not None and cons.active else []),
        f"  stages         {plan.num_stages} ({per_device(plan)} per device): {stage_listing(plan, cluster)}",
        *([f"  idle devices   {len(idle)} hold no layers: {describe_devices(idle)}"] if idle else []),
        *([f"  pairs          {pairs_line(plan, model)}"] if plan.pairs else []),
        *([f"  memory choices {memory_choices_line(plan)}"] if plan.memory else []),
        f"  peak memory    {peaks} GiB",
        f"  memory         {memory_line(result.peak, cluster)}",
        f"  search         {result.iterations} steps, {result.evaluations} evaluations, "
        f"{result.elapsed_s:.1f} s, stopped by {result.stopped_by}; best from {result.source}",
    ])


def memory_choices_line(plan) -> str:
    """Which stage got which memory choices: 'stage 0@0: recompute on 1-3; stage 2@2: selective:mlp on 9'."""
    from ..formats.memory import describe_choices

    parts = []
    for s, st in enumerate(plan.stages):
        mine = [(i, c) for i, c in plan.memory if st.start <= i < st.end]
        if mine:
            parts.append(f"stage {s}@{st.device}: {describe_choices(mine)}")
    return f"{len(plan.memory)} layer(s): " + _abridged(parts, "; ")


def pairs_line(plan, model) -> str:
    """How many overlapped F&B pairs the plan runs and the communication they hide (simulator/pairs.py)."""
    phases = stage_phases(without_split_layers(model, plan.splits), plan.stages)
    hidden = sum(hidden_ms(phases, a, b) for a, b in plan.pairs)
    per_device = len(plan.pairs) / plan.num_devices
    return (f"{len(plan.pairs)} overlapped F&B pairs ({per_device:.1f} per device, e.g. {plan.pairs[0][0]}+"
            f"{plan.pairs[0][1]}) hide {hidden:.1f} ms of all-to-all in all")


def native_gains(result, natives: dict | None = None) -> list[str]:
    """One line per framework: the gain over the best plan it runs unmodified, and the memory each trades."""
    ours = max(result.peak)
    out = []
    for fw in ("megatron", "deepspeed"):
        nb = natives[fw] if natives is not None else native_best(result.baselines, fw)
        if nb is None:
            out.append(f"no fitting plan {WHAT[fw]} runs, to compare with")
            continue
        delta = (ours - nb.peak_bytes) / 2**30
        out.append(f"{nb.step_ms / result.step_ms:.2f}x faster than {WHAT[fw]} at its best ({nb.describe()}: "
                   f"{nb.step_ms:.1f} ms, peak {nb.peak_bytes / 2**30:.1f} GiB; this plan "
                   f"{'+' if delta >= 0 else '-'}{abs(delta):.1f} GiB)")
    return out


def stage_listing(plan, cluster) -> str:
    """`[lo,hi)@d` per stage, ' | ' between stages and ' || ' where the boundary crosses nodes (abridged)."""
    parts = []
    for s, st in enumerate(plan.stages):
        if s:
            prev = plan.stages[s - 1].device
            parts.append(" || " if cluster.node_of(prev) != cluster.node_of(st.device) else " | ")
        parts.append(f"[{st.start},{st.end})@{st.device}")
    crossings = sum(p == " || " for p in parts)
    text = _abridged(parts[0::2], None, parts[1::2])
    return text + (f"   (|| : {crossings} boundaries cross nodes of {cluster.devices_per_node} devices)"
                   if crossings else "")


def memory_line(peaks, cluster) -> str:
    """Usable memory (device less headroom), the least headroom left on any device, and who fits only without it."""
    gib = 2**30
    usable = cluster.usable_memory_bytes
    kept = cluster.memory_headroom_bytes
    room = (f"{usable / gib:.1f} GiB usable of {cluster.memory_bytes / gib:.1f} GiB ({kept / gib:.1f} GiB headroom)"
            if kept else f"{cluster.memory_bytes / gib:.1f} GiB per device, no headroom")
    top = max(range(len(peaks)), key=lambda d: peaks[d])
    free = cluster.memory_bytes - peaks[top]
    line = f"{room}; fullest device {top}: {peaks[top] / gib:.1f} GiB, {free / gib:.1f} GiB left free"
    over = [d for d, p in enumerate(peaks) if usable < p <= cluster.memory_bytes]
    if over:
        line += f"; devices {describe_devices(over)} fit only without the headroom"
    return line


def _abridged(items: list[str], sep: str | None, seps: list[str] | None = None) -> str:
    """All items when few, else the first and last ones around a count of those left out."""
    seps = seps if seps is not None else [sep] * max(0, len(items) - 1)

    def joined(lo: int, hi: int) -> str:
        return "".join(items[i] + (seps[i] if i + 1 < hi else "") for i in range(lo, hi))

    if len(items) <= SHOWN:
        return joined(0, len(items))
    n_head, n_tail = SHOWN - 6, 4
    left = len(items) - n_head - n_tail
    return (joined(0, n_head) + seps[n_head - 1] + f"... {left} more ..." + seps[-n_tail - 1]
            + joined(len(items) - n_tail, len(items)))


def as_json(result, rows, cluster=None, natives: dict | None = None) -> dict:
    base = baseline_ms(result.baselines)
    cons = getattr(result, "constraints", None)
    natives = natives if natives is not None else {fw: native_best(result.baselines, fw)
                                                   for fw in ("megatron", "deepspeed")}
    return {
        "plan": plan_to_dict(result.plan),
        "step_time_ms": result.step_ms,
        "bubble_ratio": result.bubble,
        "peak_memory_bytes": list(result.peak),
        "lower_bound_ms": result.bound.value_ms,
        "baseline_ms": base,
        "speedup_over_baseline": base / result.step_ms if base else None,
        "source": result.source,
        "iterations": result.iterations,
        "evaluations": result.evaluations,
        "comparison": [r.as_dict() for r in rows],
        "native": {fw: None if nb is None else {"schedule": nb.schedule, "split": nb.split,
                                                "stages_per_device": nb.stages_per_device, "step_ms": nb.step_ms,
                                                "peak_bytes": nb.peak_bytes, "boundary_moves": nb.moves,
                                                "stages": [list(b) for b in nb.bounds] or None,
                                                "speedup": nb.step_ms / result.step_ms}
                   for fw, nb in natives.items()},
        **({"memory_bytes": cluster.memory_bytes, "memory_headroom_bytes": cluster.memory_headroom_bytes,
            "usable_memory_bytes": cluster.usable_memory_bytes} if cluster is not None else {}),
        **({"constraints": cons.as_dict()} if cons is not None else {}),
    }


class _progress_bar:
    """tqdm bar on stderr showing the best step time so far, bubble, phase and iteration; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.shown = enabled, None, None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=1000, file=sys.stderr, desc="tuning", leave=False, mininterval=0.3,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}|{postfix}")
        return self if self.enabled else None

    def __call__(self, p) -> None:
        bar = self.bar
        target = int(p.fraction * 1000)
        if target > bar.n:
            bar.update(target - bar.n)
        # the best plan in hand so far (Ctrl-C returns it), refreshed whenever it or the phase changes
        if (p.best_ms, p.phase) != self.shown or p.iteration % 50 == 0:
            self.shown = (p.best_ms, p.phase)
            bar.set_postfix_str(f"best so far {p.best_ms:.1f} ms, bubble {p.bubble:.1%}, {p.phase}, "
                                f"iter {p.iteration} (Ctrl-C keeps it)", refresh=False)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False
