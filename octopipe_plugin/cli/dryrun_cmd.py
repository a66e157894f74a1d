"""`octopipe dryrun PLAN --model M`: run a plan through the real executor with sleeping stand-in layers."""

from __future__ import annotations

from ..costs import get_gpu, resolve_cluster, resolve_model
from ..errors import OctoPipeError
from ..formats import read_plan


def add_parser(subparsers) -> None:
    """Register `octopipe dryrun`."""
    p = subparsers.add_parser(
        "dryrun", help="run a plan on local processes (gloo) with stand-in layers that sleep their cost",
        description="Start one local process per device, replace every layer by a stand-in that sleeps its scaled "
                    "F, I and W cost, run the plan through the real executor, check that every message carries the "
                    "micro-batch and stage it should, and print measured against predicted step time.")
    p.add_argument("plan", help="octopipe-plan/1 file")
    p.add_argument("--model", required=True, help="zoo name or model/architecture file the plan was made for")
    p.add_argument("--cluster", help="cluster name (e.g. h100x8) or octopipe-cluster/1 file; transfers then sleep "
                                     "their scaled cost (default: free transfers)")
    p.add_argument("--gpu", default="H100", help="GPU of the analytic cost model for zoo names")
    p.add_argument("--time-scale", type=float, help="multiply every cost by this (default: scale to --target-s)")
    p.add_argument("--target-s", type=float, default=2.0, help="step time to scale to when --time-scale is unset")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any rank waits for one message")
    p.add_argument("--clock", choices=("device", "wall"), default="device",
                   help="device: each stand-in ends at max(device free, input arrival) + cost, so host dispatch "
                        "overlaps the previous action as with asynchronous GPU kernels; wall: every action sleeps "
                        "its full cost from when the host reaches it (host overhead adds up)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Run the dry run and print predicted vs measured step time and per-device idle time."""
    from ..executor.dryrun import dry_run

    if args.time_scale is not None and args.time_scale <= 0:
        raise OctoPipeError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.timeout <= 0:
        raise OctoPipeError(f"--timeout must be > 0, got {args.timeout}")
    model = resolve_model(args.model, get_gpu(args.gpu).name)
    plan = read_plan(args.plan, num_layers=model.num_layers)
    cluster = resolve_cluster(args.cluster) if args.cluster is not None else None
    if cluster is not None and cluster.num_devices < plan.num_devices:
        raise OctoPipeError(f"--cluster {args.cluster}: {cluster.num_devices} devices, the plan needs {plan.num_devices}")
    rep = dry_run(model, plan, cluster, time_scale=args.time_scale, target_ms=args.target_s * 1000.0,
                  timeout_s=args.timeout, clock=args.clock)
    print(f"plan {args.plan}: {plan.num_devices} devices, {plan.num_stages} stages, {plan.num_microbatches} micro-batches")
    print(f"time scale {rep.time_scale:.4g}  transfers: {'cluster ' + args.cluster if rep.transfers_priced else 'free'}"
          f"  clock: {rep.clock}")
    print(f"messages checked: {rep.messages_checked} (micro-batch, stage and direction all as planned)")
    print(f"step time  predicted {rep.predicted_ms:9.1f} ms  measured {rep.measured_ms:9.1f} ms  "
          f"({100 * rep.error:+.2f}%)")
    print(f"{'device':>6} {'idle predicted ms':>18} {'idle measured ms':>17}")
    for d, (p, m) in enumerate(zip(rep.predicted_idle_ms, rep.measured_idle_ms)):
        print(f"{d:>6} {p:18.1f} {m:17.1f}")
    return 0
