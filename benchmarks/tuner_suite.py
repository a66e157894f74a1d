"""Tuner benchmark: every zoo model on h100x8 and h100x16 at 2x, 4x and 8x devices micro-batches.

Columns: /LB is step time over the issue's bound max(M*sum/D, M*max layer); /RB over the
refined bound of tuner/bounds.py (packing: layers are whole, one device holds ceil(n/D) of
the n heaviest; fill: a layer's device waits for micro-batch 0 to cross the earlier layers):
it shows how much of a gap to LB is granularity and fill rather than bubbles.

Prints one line per configuration, then the summary the issue asks for: geometric-mean
speedup over Megatron interleaved 1F1B (Megatron split, best v) on the heterogeneous models,
geometric mean of step time over the lower bound and the worst case, geometric mean over the
best of ZB-V / DualPipeV / interleaved zero-bubble (any v; v = 1 is ZB-H1) / Megatron's combined
1F1B (MoE all-to-all overlapped) on the balanced split (only configurations where one fits; also
against ZB-H1 in place of interleaved-ZB, to show what the interleaved schedule adds), and the
checks: never slower than the best built-in, never slower than the baseline on the homogeneous
control.

    PYTHONPATH=. python benchmarks/tuner_suite.py                  # full suite, 60 s per config
    PYTHONPATH=. python benchmarks/tuner_suite.py --budget 10      # quicker
    PYTHONPATH=. python benchmarks/tuner_suite.py --quick          # 3 models, h100x8, 2x and 4x
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from octopipe_plugin.costs import ZOO, resolve_cluster, resolve_model
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.bounds import refined_bound
from octopipe_plugin.tuner.compare import baseline_ms, best_builtin_ms, sota_ms

CONTROL = "llama2-7b"  # the homogeneous control
QUICK_MODELS = ("deepseek-v3-mini", "gemma3", CONTROL)
ZB_H1_SOTA = ("zb-v", "dualpipev", "zb-h1", "combined-1f1b")  # the SOTA set without interleaved-ZB


def geomean(xs) -> float:
    """Geometric mean (nan for an empty list)."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def run_one(model_name, cluster_name, factor, budget, seed, gpu) -> dict:
    """Tune one configuration and collect its figures."""
    cluster = resolve_cluster(cluster_name)
    model = resolve_model(model_name, gpu)
    m = factor * cluster.num_devices
    t0 = time.monotonic()
    r = tune(model, cluster, m, time_budget_s=budget, seed=seed)
    base, best, sota = baseline_ms(r.baselines), best_builtin_ms(r.baselines), sota_ms(r.baselines)
    return {
        "model": model_name, "cluster": cluster_name, "m": m, "step": r.step_ms, "lb": r.bound.value_ms,
        "pb": refined_bound(model, cluster.num_devices, m),
        "lb_term": "layer" if r.bound.layer_ms >= r.bound.work_ms else "work", "base": base, "best": best,
        "sota": sota, "sota_h1": sota_ms(r.baselines, ZB_H1_SOTA), "bubble": r.bubble,
        "stages": r.plan.num_stages, "source": r.source,
        "time": time.monotonic() - t0, "seeded": r.seeded_s, "peak": max(r.peak) / 2**30,
    }


def line(row) -> str:
    """One table line."""
    def ratio(a, b):
        return f"{a / b:6.2f}x" if a and b else "     - "
    return (f"{row['model']:<17} {row['cluster']:<8} {row['m']:>4} {row['step']:>9.1f} {row['lb']:>9.1f}"
            f"{'(' + row['lb_term'][0] + ')':<3} {row['step'] / row['lb']:>6.3f} {row['step'] / row['pb']:>6.3f} {ratio(row['base'], row['step'])}"
            f" {ratio(row['best'], row['step'])} {ratio(row['sota'], row['step'])} {row['bubble']:>6.1%}"
            f" {row['stages']:>3} {row['peak']:>6.1f} {row['seeded']:>5.1f} {row['time']:>6.1f}  {row['source']}")


HEADER = (f"{'model':<17} {'cluster':<8} {'M':>4} {'step ms':>9} {'LB ms':>9}{'':<3} {'/LB':>6} {'/RB':>6} {'vs base':>7}"
          f" {'vs best':>7} {'vs SOTA':>7} {'bubble':>6} {'S':>3} {'GiB':>6} {'seed s':>5} {'time s':>6}  from")


def summarise(rows) -> str:
    """The closing figures of the suite."""
    het = [r for r in rows if r["model"] != CONTROL]
    worst = max(rows, key=lambda r: r["step"] / r["lb"])
    slower_best = [r for r in rows if r["best"] is not None and r["step"] > r["best"] * (1 + 1e-9)]
    slower_ctrl = [r for r in rows if r["model"] == CONTROL and r["base"] and r["step"] > r["base"] * (1 + 1e-9)]
    sota = [r["sota"] / r["step"] for r in rows if r["sota"]]
    sota_h1 = [r["sota_h1"] / r["step"] for r in rows if r["sota_h1"]]
    gained = [r for r in rows if r["sota"] and r["sota_h1"] and r["sota"] < r["sota_h1"] * (1 - 1e-9)]
    out = [
        f"configurations: {len(rows)} ({len(het)} heterogeneous)",
        f"geomean speedup over Megatron interleaved 1F1B, heterogeneous models: "
        f"{geomean([r['base'] / r['step'] for r in het if r['base']]):.3f}x "
        f"(max {max([r['base'] / r['step'] for r in het if r['base']] or [float('nan')]):.2f}x)",
        f"geomean speedup over it, all models: {geomean([r['base'] / r['step'] for r in rows if r['base']]):.3f}x",
        f"geomean speedup over best of ZB-V/DualPipeV/interleaved-ZB/combined-1F1B (balanced split, "
        f"fitting): "
        f"{geomean(sota):.3f}x over {len(sota)} configurations",
        f"  (over best of ZB-V/DualPipeV/ZB-H1/combined-1F1B instead: {geomean(sota_h1):.3f}x over "
        f"{len(sota_h1)}; "
        f"interleaved-ZB at v >= 2 beats that set on {len(gained)})",
        f"configurations slower than the best built-in: {len(slower_best)}; control slower than baseline: "
        f"{len(slower_ctrl)}",
        f"longest search {max(r['time'] for r in rows):.1f} s; plan >= best built-in after at most "
        f"{max(r['seeded'] for r in rows):.1f} s",
        f"geomean step / LB: {geomean([r['step'] / r['lb'] for r in rows]):.3f}; within 1.10x of LB: "
        f"{sum(r['step'] / r['lb'] <= 1.10 for r in rows)}/{len(rows)}",
        f"geomean step / refined bound (whole layers, pipeline fill): "
        f"{geomean([r['step'] / r['pb'] for r in rows]):.3f}; worst {max(r['step'] / r['pb'] for r in rows):.3f}",
        f"worst step / LB: {worst['step'] / worst['lb']:.3f} ({worst['model']} {worst['cluster']} M={worst['m']})",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    """Run the suite and print the table and summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=60.0, help="tuner time budget per configuration (s)")
    ap.add_argument("--quick", action="store_true", help="3 models on h100x8 at 2x and 4x micro-batches")
    ap.add_argument("--models", nargs="*", help="zoo models (default: all)")
    ap.add_argument("--clusters", nargs="*", default=None, help="default: h100x8 h100x16")
    ap.add_argument("--factors", nargs="*", type=int, default=None, help="micro-batches per device (2 4 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="H100")
    args = ap.parse_args(argv)
    models = args.models or (list(QUICK_MODELS) if args.quick else list(ZOO))
    clusters = args.clusters or (["h100x8"] if args.quick else ["h100x8", "h100x16"])
    factors = args.factors or ([2, 4] if args.quick else [2, 4, 8])
    print(HEADER, flush=True)
    rows = []
    for name in models:
        for cl in clusters:
            for f in factors:
                rows.append(run_one(name, cl, f, args.budget, args.seed, args.gpu))
                print(line(rows[-1]), flush=True)
    print()
    print(summarise(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
