"""`octopipe plan`'s split search (--splits, default on): the split-aware tuner beside the plain one, within the budget.

Wherever the model has an LM head to split and the cluster two or more devices (tuner/split.py
`splits_tried`), the plain tune (with its progress bar) takes PLAIN_SHARE of --time-budget and stays
the candidate without splits, so the chosen plan is never slower than it; the split variants
(tuner/split.py `VARIANTS`) and their shard insertions share the rest, each stopped at its deadline,
under a wall-clock guard of the rest plus GUARD_SLACK of the budget. Elsewhere the plain tune takes
the whole budget. `--splits auto` searches as the default does and always prints the split line (with
why no split was tried); `off` never splits (runtimes that run whole layers only). With `--megatron-args` /
`--deepspeed-config` the launch's run constraints apply (tuner/constraints.py FRAMEWORK_SPLITS) and a
split plan its run would refuse leaves the plan without splits.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..tuner.bounds import lower_bound
from ..tuner.split import PLAIN_SHARE, comparison_rows_with_splits, splits_tried, splittable_head, tune_split
from ._guard import WallClockGuard
from ._options import constraints_of

log = logging.getLogger(__name__)

CHOICES = ("auto", "off")
GUARD_SLACK = 0.08  # of --time-budget: the guard's margin over the split search's share (the promise is +10%)


def add_split_option(p) -> None:
    """Register --splits on a parser (default: splits where they can pay)."""
    p.add_argument("--splits", choices=CHOICES, default=None,
                   help="default: also tune plans whose LM head (and embedding) are split by vocabulary rows over "
                        "several devices, and keep the faster, within --time-budget; auto: the same search, and "
                        "always a line on the split (why none was tried); off: whole layers only")


def split_share(args, model, cluster) -> float:
    """Share of --time-budget the split search takes (0: the plain tune takes it all, no split search)."""
    if args.splits == "off" or not splits_tried(model, cluster.num_devices):
        return 0.0
    return 1.0 - PLAIN_SHARE


def plain_budget(args, model, cluster) -> float:
    """Seconds of --time-budget the plan without splits is tuned with."""
    return args.time_budget * (1.0 - split_share(args, model, cluster))


def with_splits(args, model, cluster, num_microbatches: int, result, *, constraints=None, refusal=None):
    """(result to report, comparison rows, one summary line or None) after the split search on top of `result`.

    `result`: the plain tune with `plain_budget`; the split search takes the rest of --time-budget (none where
    `split_share` is 0: `result` stands, with a line only for an explicit `--splits auto`).
    `constraints`: the tune's (default the command line's); `refusal(plan) -> reason | None`: the runner's word
    on a split plan (a launch's framework): a refused split plan leaves the plan without splits, said in the line."""
    if constraints is None:
        constraints = constraints_of(args)
    if result.plan.memory:  # the split simulator prices no memory choice: the plan that needs them stands
        return result, None, ("split layers   none: the plan carries memory choices, which no split plan is priced "
                              "with" if args.splits == "auto" else None)
    share = split_share(args, model, cluster)
    if share == 0.0:
        if args.splits != "auto":
            return result, None, None
        why = "the model's last layer is not an lm_head" if splittable_head(model) is None else "one device"
        return result, None, f"split layers   none: {why}"
    seconds = args.time_budget * share
    guard = WallClockGuard(seconds + GUARD_SLACK * args.time_budget)
    try:
        with guard:
            sres = tune_split(model, cluster, num_microbatches, seed=args.seed, iterations=args.iterations,
                              unsplit=result, constraints=constraints, split_budget_s=seconds)
    except KeyboardInterrupt:  # the guard fired outside the split search's own stops: the plan without splits
        if not guard.fired:
            raise
        log.warning("split search: the time budget ran out; the plan without splits stands")
        return result, None, "split layers   not tried to the end (time budget); plan without splits"
    # a split layer is no longer a heaviest layer no plan can beat: the bound of the split plan leaves it out
    chosen = result if not sres.plan.splits else replace(
        result, plan=sres.plan, step_ms=sres.step_ms, bubble=sres.bubble, peak=sres.peak,
        bound=lower_bound(model, cluster.num_devices, num_microbatches, {sp.layer for sp in sres.plan.splits}))
    why = refusal(sres.plan) if refusal is not None and sres.plan.splits else None
    if why is not None:
        return result, None, (f"split layers   {sres.describe()} found ({sres.split_ms:.1f} ms), but the launch cannot "
                              f"run it: {why}; plan without splits")
    best = "none fits" if sres.split_ms is None else f"best {sres.split_ms:.1f} ms"
    line = (f"split layers   {sres.describe()} ({best} with splits, {sres.unsplit_ms:.1f} ms without)")
    return chosen, comparison_rows_with_splits(sres, cluster), line
