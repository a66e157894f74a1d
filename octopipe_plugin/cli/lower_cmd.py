"""`octopipe lower PLAN [--rank R]`: print a rank's lowered program (compute and comm in posting order)."""

from __future__ import annotations

from .. import limits as L
from ..errors import OctoPipeError
from ..formats import read_plan
from ._options import integer


def add_parser(subparsers) -> None:
    """Register `octopipe lower`."""
    p = subparsers.add_parser(
        "lower", help="print each rank's lowered program: receives, waits, actions and sends in posting order",
        description="Print what the executor posts on each rank in one step: every receive post (prefetched), "
                    "wait, compute action (3F12 notation) and send, in order; `recv ACT 2F5 from r1` is the "
                    "activation made by 2F5. With --nccl, also replay the step under NCCL's rules.")
    p.add_argument("plan", help="octopipe-plan/1 file")
    p.add_argument("--rank", type=integer(0, L.MAX_DEVICES), help="only this rank (default: every rank)")
    p.add_argument("--forward-only", action="store_true", help="the evaluation program (forwards only)")
    p.add_argument("--microbatches", type=integer(1, L.MAX_MICROBATCHES), metavar="M",
                   help="with --forward-only: evaluate M micro-batches (default: the plan's count)")
    p.add_argument("--prefetch", type=integer(0, 64), default=2,
                   help="post each receive this many actions ahead of its consumer (default 2, the executor's)")
    p.add_argument("--compact", action="store_true", help="omit the receive posts")
    p.add_argument("--lazy", action="store_true",
                   help="without the executor's eager communicator warm-up (ExecutorOptions(eager_comms=False))")
    p.add_argument("--nccl", action="store_true", help="replay the step under NCCL's rules and say whether it hangs")
    p.set_defaults(run=run)


def run(args) -> int:
    """Print the lowered programs (and the NCCL replay's verdict); exit 1 when the replay hangs."""
    from ..executor.lowered import lowered_plan
    from ..executor.nccl_rules import check_nccl_rules
    from ..executor.posting import format_lowered
    from ..errors import DeadlockError

    plan = read_plan(args.plan)
    if args.rank is not None and args.rank >= plan.num_devices:
        raise OctoPipeError(f"plan {args.plan}: --rank {args.rank}: expected 0..{plan.num_devices - 1} "
                            f"(the plan has {plan.num_devices} devices)")
    if args.microbatches is not None and not args.forward_only:
        raise OctoPipeError("--microbatches: only with --forward-only (a training step runs the plan's count)")
    ranks = range(plan.num_devices) if args.rank is None else [args.rank]
    for r in ranks:
        train = lowered_plan(plan, r, args.prefetch)
        low = train.forward(args.microbatches) if args.forward_only else train
        # the executor warms the directions of the plan it was built for, also before evaluation steps
        print(format_lowered(low, warm=() if args.lazy else train.my_pairs, compact=args.compact))
    if not args.nccl:
        return 0
    target = lowered_plan(plan, 0, args.prefetch).forward(args.microbatches).plan if args.forward_only else plan
    try:
        check_nccl_rules(target, prefetch=args.prefetch, eager=not args.lazy)
    except DeadlockError as exc:
        print(f"nccl: {exc}")
        return 1
    print("nccl: no rank hangs (per-direction communicators" + (", created lazily)" if args.lazy else
                                                               ", warmed eagerly in sorted pair order)"))
    return 0
