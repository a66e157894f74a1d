"""`octopipe dryrun --clock wall` on built-in and tuned plans: measured against the simulator, with the load average.

    PYTHONPATH=. python benchmarks/wall_clock.py --links local8.json   # links from `octopipe cluster --measure --ranks 8`
    PYTHONPATH=. python benchmarks/wall_clock.py                        # measures the links first (8 local ranks)

Every plan runs on 8 local processes (gloo) through the real executor with sleeping stand-ins
on the wall clock: every host delay counts and each boundary's payload is the model's bytes
across that cut, really sent. The prediction is the simulator's at the same time scale, with
the transfers priced unscaled by this host's measured links (--links). The model's sequence is
shortened (--seq-len) so that the payloads of a step fit a small host's memory and cores. One
line per plan: predicted, the overhead-aware prediction (the same with the executor's own host
costs per action and message charged: --overheads, or this machine's as `octopipe profile
--overheads` measures them), measured, both deviations, and the 1-minute load average before
and after (a dry run on a loaded machine measures the load as much as the plan).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="nemotron-h", help="zoo name or model/architecture file (default nemotron-h)")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length of a zoo model (default 256)")
    p.add_argument("--cluster", default="h100x8", help="cluster the plans are made for (default h100x8)")
    p.add_argument("--links", help="this host's cluster file (default: measure 8 local ranks now)")
    p.add_argument("--microbatches", type=int, default=16, help="micro-batches per step (default 16)")
    p.add_argument("--target-s", type=float, default=2.0, help="simulated step to scale to, in s (default 2)")
    p.add_argument("--tune-seconds", type=float, default=20.0, help="tuning budget of the tuned plan (default 20)")
    p.add_argument("--schedules", default="1f1b,interleaved-1f1b,zb-v,tuned",
                   help="comma-separated built-in schedules and/or 'tuned' (default all four)")
    p.add_argument("--clock", default="wall", choices=("device", "wall"), help="dry-run clock (default wall)")
    p.add_argument("--overheads", metavar="FILE",
                   help="octopipe-overheads/1 file for the overhead-aware prediction (default: this machine's "
                        "cached figures, else measured now, as `octopipe profile --overheads`)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run every plan's dry run and print one line each."""
    from octopipe_plugin.costs import cost_gpu, resolve_cluster, resolve_model
    from octopipe_plugin.executor.dryrun import dry_run, host_links, scaled_cluster, scaled_costs
    from octopipe_plugin.profile.overheads import machine_overheads
    from octopipe_plugin.simulator import SimOptions, simulate
    from octopipe_plugin.profile.links import measure_local
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.tuner import tune

    args = parse_args(argv)
    cluster = resolve_cluster(args.cluster)
    zoo = not os.path.exists(args.model)
    model = resolve_model(args.model, gpu=cost_gpu(cluster), **({"seq_len": args.seq_len} if zoo else {}))
    if args.links:
        links = resolve_cluster(args.links)
    else:
        links = measure_local(cluster.num_devices)
    overheads = machine_overheads(args.overheads)
    print(f"model {model.name} ({model.num_layers} layers{f', seq_len {args.seq_len}' if zoo else ''}), plans for "
          f"{args.cluster}, {args.microbatches} micro-batches, {args.clock} clock; links {links.name}: "
          f"{links.intra_node.bandwidth_gb_per_s:.3g} GB/s, {links.intra_node.latency_us:.0f} us; "
          f"{os.cpu_count()} cores")
    print(f"{'plan':>18} {'stages':>6} {'predicted ms':>13} {'aware ms':>9} {'measured ms':>12} {'deviation':>10} "
          f"{'aware dev':>10} {'load before':>12} {'load after':>11}")
    for name in args.schedules.split(","):
        if name == "tuned":
            plan = tune(model, cluster, args.microbatches, time_budget_s=args.tune_seconds, seed=0).plan
        else:
            extra = {"stages_per_device": 2} if name.startswith("interleaved") else {}  # Megatron's usual 2
            plan = build_plan(model, name, cluster.num_devices, args.microbatches, **extra)
        before = os.getloadavg()[0]
        rep = dry_run(model, plan, cluster, target_ms=args.target_s * 1000.0, timeout_s=120.0, clock=args.clock,
                      links=links)
        after = os.getloadavg()[0]
        # the same prediction with the executor's host costs charged (they are real time: not scaled)
        fast = host_links(cluster, links) if args.clock == "wall" else scaled_cluster(cluster, rep.time_scale)
        aware = simulate(None, fast, plan, SimOptions(overheads=overheads), costs=scaled_costs(model, plan, rep.time_scale),
                         detail=False).step_time_ms
        print(f"{name:>18} {plan.num_stages:>6} {rep.predicted_ms:13.1f} {aware:9.1f} {rep.measured_ms:12.1f} "
              f"{100 * rep.error:+9.1f}% {100 * (rep.measured_ms / aware - 1):+9.1f}% {before:12.2f} {after:11.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
