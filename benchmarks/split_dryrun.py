"""Dry run of a tuned split plan: `tune_split` on a zoo big-vocabulary model, then the real executor with stand-ins.

Tunes the model on h100xD with M = factor x D micro-batches (the split-aware tuner, as
benchmarks/split_layers.py does), writes the plan (`--save`, to rerun it with `octopipe dryrun`),
runs it on D local gloo processes whose layers and shards sleep their scaled costs, and prints
the predicted and measured step. A loaded host shows as lateness at short steps: the scaled
step (`--target-s`) must be long against the host's per-message overhead.

    PYTHONPATH=. python benchmarks/split_dryrun.py --model gemma3 --devices 16 --target-s 120
"""

from __future__ import annotations

import argparse
import sys

from octopipe_plugin.costs import resolve_cluster, resolve_model
from octopipe_plugin.executor.dryrun import dry_run
from octopipe_plugin.formats import write_plan
from octopipe_plugin.tuner.split import tune_split


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--factor", type=int, default=2, help="micro-batches per device")
    ap.add_argument("--budget", type=float, default=5.0, help="tuner seconds")
    ap.add_argument("--target-s", type=float, default=120.0, help="scaled step the dry run sleeps through")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--save", help="write the tuned plan here")
    args = ap.parse_args(argv)
    model = resolve_model(args.model, "H100")
    cluster = resolve_cluster(f"h100x{args.devices}")
    res = tune_split(model, cluster, args.factor * args.devices, time_budget_s=args.budget, seed=0)
    print(f"{args.model} D={args.devices} M={args.factor * args.devices}: tuned {res.step_ms:.1f} ms "
          f"(without splits {res.unsplit_ms:.1f} ms), {res.describe()}")
    if args.save:
        write_plan(res.plan, args.save)
    rep = dry_run(model, res.plan, cluster, target_ms=args.target_s * 1000.0, timeout_s=args.timeout)
    print(f"dry run: scale {rep.time_scale:.4g}, predicted {rep.predicted_ms:.1f} ms, measured {rep.measured_ms:.1f} "
          f"ms ({100 * rep.error:+.2f}%), {rep.messages_checked} messages checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
