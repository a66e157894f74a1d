"""`octopipe plan`: tune partition, placement and per-device schedule; compare with every built-in schedule."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

from .. import limits as L
from ..errors import OctoPipeError
from ..formats import bind_plan, plan_to_dict, write_plan
from ..formats.fingerprint import describe_devices, idle_devices
from ..tuner import tune
from ..tuner.compare import baseline_ms, comparison_rows, format_table, per_device
from ._guard import WallClockGuard
from ._options import check_writable, integer, keep_on_failure, load_cluster, load_model, number

SPLIT_S_PER_UNIT = 1e-6  # measured: balanced_split of 1100 layers into 1000 stages, 8.7 s on 2 busy cores
SHOWN = 24  # stages or devices listed one by one in the summary; larger plans are abridged


def add_parser(subparsers) -> None:
    """Register `octopipe plan`."""
    p = subparsers.add_parser("plan", help="tune a pipeline plan (partition + placement + schedule)",
                              description=__doc__)
    p.add_argument("--model", required=True, help="zoo name (octopipe model --list) or a model/architecture file")
    p.add_argument("--cluster", required=True, help="named cluster like h100x8, h100x16, or a cluster file")
    p.add_argument("--microbatches", type=integer(1, L.MAX_MICROBATCHES), required=True, metavar="M",
                   help=f"micro-batches per step (devices x micro-batches at most {L.MAX_TUNE_DEVICE_MICROBATCHES:,})")
    p.add_argument("--gpu", default=None,
                   help="GPU whose analytic costs zoo/architecture models get (default: the cluster's GPU)")
    p.add_argument("--time-budget", type=number(0.0, L.MAX_TIME_BUDGET_S, open_low=True, unit="s"), default=60.0,
                   metavar="SECONDS", help="search budget in seconds, setup included (default 60); converted to a "
                                           "fixed amount of work, with the wall clock as a guard")
    p.add_argument("--seed", type=integer(0, L.MAX_SEED), default=0, help="random seed of the search (default 0)")
    p.add_argument("--iterations", type=integer(0, L.MAX_ITERATIONS), default=None,
                   help="run exactly this many search steps (fully deterministic; the time budget still caps)")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the tuned octopipe-plan/1 here")
    p.add_argument("--png", metavar="PLAN.png", help="draw the tuned plan's timeline here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


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


def run(args) -> int:
    """Tune, write the plan (and picture) if asked, print the summary and the comparison."""
    check_writable(args.output, "-o")
    check_writable(args.png, "--png")
    cluster = load_cluster(args.cluster)
    model, costs = load_model(args, cluster)
    check_size(model, cluster, args.microbatches, args.time_budget)
    guard = WallClockGuard(args.time_budget)
    try:
        with _progress_bar(not args.no_progress) as bar, guard:
            result = tune(model, cluster, args.microbatches, time_budget_s=args.time_budget, seed=args.seed,
                          iterations=args.iterations, progress=bar)
    except KeyboardInterrupt:  # the tuner re-raises when it has no plan in hand yet
        if not guard.fired:
            raise
        raise OctoPipeError(f"--time-budget {args.time_budget:g} s ran out before any plan for {model.name} on "
                            f"{cluster.num_devices} devices x {args.microbatches} micro-batches was complete; raise "
                            f"--time-budget or use fewer micro-batches") from None
    if guard.fired:
        result = replace(result, stopped_by="the time budget (wall-clock guard)")
    plan = bind_plan(result.plan, model, cluster)
    failed = []
    if args.output:
        failed += keep_on_failure(lambda: write_plan(plan, args.output), args.output, plan)
    if args.png:
        from ..simulator.gantt import write_png

        failed += keep_on_failure(lambda: write_png(model, cluster, plan, args.png), args.png,
                                  None if args.output and not failed else plan)
    rows = comparison_rows(result)
    if args.json:
        print(json.dumps({**_as_json(result, rows), "plan": plan_to_dict(plan), "costs": costs.as_dict()}, indent=1))
    else:
        print(summary(result, model, cluster, costs.line()))
        print()
        print(format_table(rows, cluster.memory_bytes))
    if failed:
        raise OctoPipeError("; ".join(failed))
    return 0


def summary(result, model, cluster, costs: str = "") -> str:
    """Human-readable description of the tuned plan."""
    plan = result.plan
    idle = idle_devices(plan)
    base = baseline_ms(result.baselines)
    gain = f"{base / result.step_ms:.2f}x faster than Megatron interleaved 1F1B ({base:.1f} ms)" if base else \
        "no fitting Megatron interleaved 1F1B plan to compare with"
    stages = _abridged([f"[{st.start},{st.end})@{st.device}" for st in plan.stages], " | ")
    peaks = _abridged([f"{p / 2**30:.1f}" for p in result.peak], ", ")
    if len(result.peak) > SHOWN:
        top = max(range(len(result.peak)), key=lambda d: result.peak[d])
        peaks += f" (largest {result.peak[top] / 2**30:.1f} on device {top})"
    return "\n".join([
        f"OctoPipe plan for {model.name} on {cluster.name} ({cluster.num_devices} devices), "
        f"{plan.num_microbatches} micro-batches",
        f"  step time      {result.step_ms:.1f} ms   bubble {result.bubble:.1%}   "
        f"{result.bound.describe()} -> {result.step_ms / result.bound.value_ms:.3f}x of it",
        f"  gain           {gain}",
        *([f"  costs          {costs}"] if costs else []),
        f"  stages         {plan.num_stages} ({per_device(plan)} per device): {stages}",
        *([f"  idle devices   {len(idle)} hold no layers: {describe_devices(idle)}"] if idle else []),
        f"  peak memory    {peaks} GiB (limit {cluster.memory_bytes / 2**30:.1f} GiB)",
        f"  search         {result.iterations} steps, {result.evaluations} evaluations, "
        f"{result.elapsed_s:.1f} s, stopped by {result.stopped_by}; best from {result.source}",
    ])


def _abridged(items: list[str], sep: str) -> str:
    """All items when few, else the first and last ones around a count of those left out."""
    if len(items) <= SHOWN:
        return sep.join(items)
    head, tail = items[:SHOWN - 6], items[-4:]
    return sep.join(head) + f"{sep}... {len(items) - len(head) - len(tail)} more ...{sep}" + sep.join(tail)


def _as_json(result, rows) -> dict:
    base = baseline_ms(result.baselines)
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
