"""`octopipe plan --splits auto`: the split-aware tuner after the plain one, and what the report shows of it.

The plain tune (with its full --time-budget and progress bar) stays the candidate without
splits, so `auto` is never slower than `off`; the split variants (tuner/split.py `VARIANTS`)
share one more --time-budget for their tunes and three for placing the shards (tuner/split.py
`INSERT_SHARE`), under a wall-clock guard of that much. With `--megatron-args` the launch's
run constraints apply and a split plan its Megatron run would refuse (a tied head, a split
embedding, the owner without a shard, MTP: adapters/megatron/startup.split_refusal)
leaves the plan without splits. Default `off`: `auto` takes up to about five times the
--time-budget.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..tuner.bounds import lower_bound
from ..tuner.split import INSERT_SHARE, VARIANTS, comparison_rows_with_splits, splittable_head, tune_split
from ._guard import WallClockGuard
from ._options import constraints_of

log = logging.getLogger(__name__)

CHOICES = ("auto", "off")


def add_split_option(p) -> None:
    """Register --splits on a parser."""
    p.add_argument("--splits", choices=CHOICES, default="off",
                   help="auto: also tune plans whose LM head (and embedding) are split by vocabulary rows over "
                        "several devices, and keep the faster (up to about five times the --time-budget); off (default): "
                        "whole layers only, the plans Megatron and DeepSpeed run")


def with_splits(args, model, cluster, num_microbatches: int, result, *, constraints=None, refusal=None):
    """(result to report, comparison rows, one summary line) after the split-aware tune on top of `result`.

    `constraints`: the tune's (default the command line's); `refusal(plan) -> reason | None`: the runner's word
    on a split plan (a launch's framework): a refused split plan leaves the plan without splits, said in the line."""
    if constraints is None:
        constraints = constraints_of(args)
    if splittable_head(model) is None:
        return result, None, "split layers   none: the model's last layer is not an lm_head"
    guard = WallClockGuard(args.time_budget * (1 + INSERT_SHARE))
    try:
        with guard:
            sres = tune_split(model, cluster, num_microbatches, time_budget_s=args.time_budget, seed=args.seed,
                              iterations=args.iterations, unsplit=result, constraints=constraints,
                              variant_budget_s=args.time_budget / len(VARIANTS))
    except KeyboardInterrupt:  # the budget ran out between the variants' tunes: the plan without splits stands
        if not guard.fired:
            raise
        log.warning("--splits auto: the time budget ran out while placing the shards; the plan without splits stands")
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
