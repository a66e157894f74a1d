"""Split-layer benchmark: the tuner on the zoo's big-vocabulary models with and without vocabulary splits.

For each model, device count D (h100xD) and micro-batches per device (M = factor * D) it tunes
as `octopipe plan --time-budget BUDGET` does by default (cli/plan_split.py): where a split is tried
(`tuner.split.splits_tried`) the plan without splits with PLAIN_SHARE of the budget, then the
split search (`tuner.split.tune_split`, split_budget_s: the rest) whose plans split the LM head /
embedding over several devices, the unsplit best kept as a candidate; with --no-split the plan
without splits with the whole budget (the "before" table). The seconds column is each row's wall
clock, which the budget holds to (plus the tuner's last steps). Columns: step time, step over the
no-idle bound M * sum(work) / D, the gain (step without splits / step with), the split chosen
(devices x shares), the fullest device's memory (peak, max over devices), and `floor`: the
whole-layer floor over the same bound when the vocabulary layers are split (tuner/bounds.py:
`packing_bound`, layers that stay whole land on D devices, and `fill_bound`, a whole layer runs
all M micro-batches after the pipeline fill; deepseek-v3-mini's MTP output head is the shared
LM head's work, `costs/analytic.lm_head_block`, so only its MTP body, 4% of the work, stays whole:
above a device's share at 32 devices only).

    PYTHONPATH=. python benchmarks/split_layers.py                 # 4 models x 8/16/32 devices x 2,4 per device
    PYTHONPATH=. python benchmarks/split_layers.py --budget 30 --devices 8 16 --factors 2
    PYTHONPATH=. python benchmarks/split_layers.py --no-split      # the "before" table
    PYTHONPATH=. python benchmarks/split_layers.py --why           # and which split attempt won each row
    PYTHONPATH=. python benchmarks/split_layers.py --iterations 200 --budget 600   # the same table on any load
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time

from octopipe_plugin.costs import resolve_cluster, resolve_model
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.bounds import fill_bound, packing_bound

MODELS = ("gemma3", "llama3-8b", "nemotron-h", "deepseek-v3-mini")
EVEN_FLOOR = 1.1  # models a split can balance: whole layers leave at most 10% above the bound


def geomean(xs) -> float:
    """Geometric mean (nan for an empty list)."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def work_bound(model, num_devices: int, m: int) -> float:
    """M * sum over layers of (f + i + w) / D: the step where no device ever idles."""
    return m * sum(layer.total_ms for layer in model.layers) / num_devices


def split_floor(model, num_devices: int, m: int) -> float:
    """The whole-layer floor (ms) when the embedding and LM head are split: the other layers stay whole."""
    fluid = {i for i in (0, model.num_layers - 1) if model.layers[i].kind in ("embedding", "lm_head")}
    return max(packing_bound(model, num_devices, m, fluid), fill_bound(model, m, fluid))


def run_one(name: str, nd: int, factor: int, budget: float, seed: int, with_split: bool,
            iterations: int | None = None) -> dict:
    """Tune one configuration without splits, and with them unless told not to."""
    cluster = resolve_cluster(f"h100x{nd}")
    model = resolve_model(name, "H100")
    m = factor * nd
    t0 = time.monotonic()
    from octopipe_plugin.tuner.split import PLAIN_SHARE, splits_tried, tune_split

    share = PLAIN_SHARE if with_split and splits_tried(model, nd) else 1.0
    base = tune(model, cluster, m, time_budget_s=budget * share, seed=seed, iterations=iterations)
    row = {"model": name, "D": nd, "M": m, "bound": work_bound(model, nd, m), "base": base.step_ms,
           "base_gib": max(base.peak) / 2**30, "time": 0.0, "floor": split_floor(model, nd, m)}
    if with_split:
        res = tune_split(model, cluster, m, seed=seed, unsplit=base, iterations=iterations,
                         split_budget_s=budget * (1.0 - share))
        row.update(split=res.step_ms, split_gib=max(res.peak) / 2**30, chosen=res.describe(), source=res.source)
    row["time"] = time.monotonic() - t0
    return row


def line(row: dict, why: bool = False) -> str:
    """One table line (`why`: with the split search's attempt that made the chosen plan)."""
    text = (f"{row['model']:<17} {row['D']:>3} {row['M']:>4} {row['bound']:>9.1f} {row['floor'] / row['bound']:>6.3f} "
            f"{row['base']:>9.1f} "
            f"{row['base'] / row['bound']:>6.3f} {row['base_gib']:>6.1f}")
    if "split" in row:
        text += (f" {row['split']:>9.1f} {row['split'] / row['bound']:>6.3f} {row['base'] / row['split']:>6.3f}x"
                 f" {row['split_gib']:>6.1f}  {row['chosen']}")
        if why:
            text += f" [{row['source']}]"
    return text + f"  ({row['time']:.0f} s)"


def header(with_split: bool) -> str:
    """The table's column names."""
    text = f"{'model':<17} {'D':>3} {'M':>4} {'bound ms':>9} {'floor':>6} {'no-split':>9} {'/bound':>6} {'GiB':>6}"
    if with_split:
        text += f" {'split ms':>9} {'/bound':>6} {'gain':>7} {'GiB':>6}  split chosen"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--devices", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--factors", nargs="+", type=int, default=[2, 4], help="micro-batches per device")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="seconds per row, as octopipe plan --time-budget (work units, tuner/search.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=None,
                    help="exactly this many search steps per tune (with a large --budget: the same table on a loaded "
                         "machine, where short budgets stop by the wall clock)")
    ap.add_argument("--no-split", action="store_true", help="only today's tuner (the 'before' table)")
    ap.add_argument("--why", action="store_true", help="name the split search's attempt that made each chosen plan")
    args = ap.parse_args(argv)
    with_split = not args.no_split
    # a loaded machine stops short budgets by the wall clock; the tuner says so per run, the table is what counts
    logging.getLogger("octopipe_plugin").setLevel(logging.ERROR)
    print(f"budget {args.budget} s per row, seed {args.seed}"
          + (f", {args.iterations} search steps per tune" if args.iterations is not None else ""))
    print(header(with_split), flush=True)
    rows = []
    for nd in args.devices:
        for factor in args.factors:
            for name in args.models:
                row = run_one(name, nd, factor, args.budget, args.seed, with_split, args.iterations)
                rows.append(row)
                print(line(row, args.why and with_split), flush=True)
    print()
    for nd in args.devices:
        sel = [r for r in rows if r["D"] == nd]
        text = f"D={nd:<3} geomean step/bound without splits {geomean([r['base'] / r['bound'] for r in sel]):.3f}" \
               f" (worst {max(r['base'] / r['bound'] for r in sel):.3f})"
        if with_split:
            text += (f"; with splits {geomean([r['split'] / r['bound'] for r in sel]):.3f}"
                     f" (worst {max(r['split'] / r['bound'] for r in sel):.3f}),"
                     f" geomean gain {geomean([r['base'] / r['split'] for r in sel]):.3f}x")
            even = [r for r in sel if r["floor"] <= EVEN_FLOOR * r["bound"]]
            if even and len(even) < len(sel):
                text += (f"; over the {len(even)} rows whose whole-layer floor is <= {EVEN_FLOOR}:"
                         f" {geomean([r['split'] / r['bound'] for r in even]):.3f}")
        text += f"; floor geomean {geomean([r['floor'] / r['bound'] for r in sel]):.3f}"
        print(text)
    if with_split:
        slower = [r for r in rows if r["split"] > r["base"] * (1 + 1e-9)]
        print("never slower than without splits:", "yes" if not slower else f"NO ({len(slower)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
