"""`octopipe dryrun PLAN --model M`: run a plan through the real executor with sleeping stand-in layers."""

from __future__ import annotations

from .. import limits as L
from ..errors import OctoPipeError
from ..formats import check_plan_binding, read_plan
from ._options import load_cluster, load_model, number, warn


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
    p.add_argument("--gpu", default=None,
                   help="GPU whose analytic costs zoo/architecture models get (default: the cluster's GPU, else H100)")
    p.add_argument("--time-scale", type=number(0.0, L.MAX_TIME_SCALE, open_low=True),
                   help="multiply every cost by this (default: scale the step to --target-s)")
    p.add_argument("--target-s", type=number(0.01, L.MAX_DRYRUN_STEP_S, unit="s"), default=2.0,
                   help=f"step time in seconds to scale to when --time-scale is unset (0.01..{L.MAX_DRYRUN_STEP_S:g}; "
                        "default 2)")
    p.add_argument("--timeout", type=number(L.MIN_TIMEOUT_S, L.MAX_TIMEOUT_S, unit="s"), default=60.0,
                   help=f"seconds any rank waits for one message ({L.MIN_TIMEOUT_S:g}..{L.MAX_TIMEOUT_S:g}; "
                        "default 60)")
    p.add_argument("--clock", choices=("device", "wall"), default="device",
                   help="device: each stand-in ends at max(device free, input arrival) + cost, so host dispatch "
                        "overlaps the previous action as with asynchronous GPU kernels, and transfers take the "
                        "cluster's scaled time; wall: every action sleeps its full cost from when the host reaches "
                        "it and payloads of the model's bytes really travel over gloo (host overhead and transfers "
                        "measured, not modelled; predicted with the links of --links, else --cluster, unscaled)")
    p.add_argument("--links", help="with --clock wall: cluster file whose links price the payloads that travel "
                                   "(this host's: `octopipe cluster --measure --ranks N -o local.json`); the plan "
                                   "keeps --cluster's devices and memory (default: --cluster's links)")
    p.add_argument("--overheads", metavar="FILE",
                   help="octopipe-overheads/1 file (`octopipe profile --overheads`) to check the scale against "
                        "(default: this machine's measured figures from the profile cache, if any)")
    p.add_argument("--host-share", type=number(0.0, 1.0, open_low=True), default=None, metavar="FRACTION",
                   help="warn when the executor's host overhead per step exceeds this share of the scaled step "
                        "(default 0.05)")
    p.add_argument("--strict-host-share", action="store_true",
                   help="refuse such a run instead of warning")
    p.set_defaults(run=run)


def run(args) -> int:
    """Run the dry run and print predicted vs measured step time and per-device idle time."""
    from ..executor.dryrun import dry_run

    cluster = load_cluster(args.cluster) if args.cluster is not None else None
    model, costs = load_model(args, cluster)
    plan = read_plan(args.plan, num_layers=model.num_layers)
    lines = check_plan_binding(plan, model, cluster, source=f"plan {args.plan}", model_source=f"--model {args.model}",
                               cluster_source=f"--cluster {args.cluster}")
    _check_size(plan)
    for line in lines:
        warn(args, line)
    links = _load_links(args.links) if args.links is not None else None
    if links is not None and args.clock != "wall":
        raise OctoPipeError(f"--links {args.links}: only the wall clock sends real payloads; add --clock wall")
    if args.clock == "wall":
        _check_wall_payloads(args, model, plan, cluster or links)
    if args.strict_host_share:  # refused before any process starts
        for line in _scale_lines(args, model, plan, cluster):
            raise OctoPipeError(f"dry run refused (--strict-host-share): {line}")
    rep = dry_run(model, plan, cluster, time_scale=args.time_scale, target_ms=args.target_s * 1000.0,
                  timeout_s=args.timeout, clock=args.clock, max_step_ms=L.MAX_DRYRUN_STEP_S * 1000.0, links=links)
    print(f"plan {args.plan}: {plan.num_devices} devices, {plan.num_stages} stages, {plan.num_microbatches} micro-batches")
    print(f"costs: {costs.line()}")
    print(f"time scale {rep.time_scale:.4g}: every cost is multiplied by it, so the step sleeps about "
          f"{rep.predicted_ms / 1000:.3g} s (times below are scaled; divide by the scale for the model's own)")
    if rep.clock == "wall":
        priced_by = f"links of {args.links}" if links is not None else f"cluster {args.cluster}"
        print(f"transfers: the model's bytes over gloo, predicted with "
              f"{priced_by + ' (unscaled)' if rep.transfers_priced else 'free links'}  clock: wall")
    else:
        print(f"transfers: {'cluster ' + args.cluster if rep.transfers_priced else 'free'}  clock: {rep.clock}")
    print(f"messages checked: {rep.messages_checked} (micro-batch, stage and direction all as planned)")
    print(f"step time  predicted {rep.predicted_ms:9.1f} ms  measured {rep.measured_ms:9.1f} ms  "
          f"({100 * rep.error:+.2f}%)")
    if rep.predicted_peak_bytes:  # memory choices: the stand-ins held the plan's activation bytes, scaled
        print(f"activation peak per device (bytes x {rep.byte_scale:.3g}): predicted "
              f"{', '.join(f'{p / 2**20:.1f}' for p in rep.predicted_peak_bytes)} MiB, measured "
              f"{', '.join(f'{m / 2**20:.1f}' for m in rep.measured_peak_bytes)} MiB: measured peak within "
              f"{100 * rep.peak_error:.1f}%")
    print(f"{'device':>6} {'idle predicted ms':>18} {'idle measured ms':>17}")
    for d, (p, m) in enumerate(zip(rep.predicted_idle_ms, rep.measured_idle_ms)):
        print(f"{d:>6} {p:18.1f} {m:17.1f}")
    # after the figures they qualify (a refusal before the run stays the one line on stderr)
    for line in _scale_lines(args, model, plan, cluster):
        warn(args, line)
    return 0


def _check_size(plan) -> None:
    """Refuse a dry run with more local processes or actions than this machine runs in reasonable time."""
    if plan.num_devices > L.MAX_DRYRUN_DEVICES:
        raise OctoPipeError(f"the plan has {plan.num_devices} devices; a dry run starts one local process each and "
                            f"handles at most {L.MAX_DRYRUN_DEVICES}: check larger plans with `octopipe simulate`")
    size = plan.num_stages * plan.num_microbatches
    if size > L.MAX_DRYRUN_STAGE_MICROBATCHES:
        raise OctoPipeError(f"the plan has {plan.num_stages} stages x {plan.num_microbatches} micro-batches = {size:,}"
                            f"; a dry run exchanges real messages for each and handles at most "
                            f"{L.MAX_DRYRUN_STAGE_MICROBATCHES:,}: check it with `octopipe simulate`")


def _load_links(name: str):
    """The --links cluster, its errors naming --links."""
    try:
        return load_cluster(name)
    except OctoPipeError as exc:
        text = str(exc)
        raise OctoPipeError(text.replace(f"--cluster {name}", f"--links {name}", 1)) from None


def _check_wall_payloads(args, model, plan, cluster) -> None:
    """Wall clock: refuse payloads the host's memory cannot hold at once; warn when the prediction prices none."""
    import torch

    from ..profile.device import device_memory_bytes
    from ..simulator import stage_costs

    if cluster is None:
        warn(args, "--clock wall without --links or --cluster: payloads travel for real but the prediction prices "
                   "them free; give --links with the file `octopipe cluster --measure --ranks N` wrote for this host")
    out = stage_costs(model, plan.stages).output
    devices = [st.device for st in plan.stages]
    # every receive of a step may be posted at once: an activation and its gradient per micro-batch and cut
    total = sum(2 * plan.num_microbatches * out[s] for s in range(plan.num_stages - 1) if devices[s] != devices[s + 1])
    free = device_memory_bytes(torch.device("cpu"))
    if total > free // 2:
        raise OctoPipeError(f"--clock wall sends the model's bytes across every cut: {total / 2**20:,.0f} MiB of "
                            f"payloads per step, more than half the {free / 2**20:,.0f} MiB this host has free; use a "
                            f"model with smaller activations (e.g. a shorter seq_len) or fewer micro-batches")


def _scale_lines(args, model, plan, cluster) -> list[str]:
    """Lines saying the scale lets the executor's host overhead decide the figures (none when it does not)."""
    from ..executor.dryrun import STANDIN_PAYLOAD_BYTES, zero_cost_cluster
    from ..profile.overheads import machine_overheads
    from ..simulator import simulate
    from ..simulator.overheads import HOST_SHARE_LIMIT, scale_warnings

    ov = machine_overheads(args.overheads, measure=False)
    if ov is None:
        return ["scale not checked against host overheads: none measured on this machine (run `octopipe profile "
                "--overheads` once, or pass --overheads FILE)"]
    if args.time_scale is not None:
        base = simulate(model, cluster or zero_cost_cluster(plan.num_devices), plan, detail=False).step_time_ms
        step = args.time_scale * base
    else:
        step = args.target_s * 1000.0
    limit = args.host_share if args.host_share is not None else HOST_SHARE_LIMIT
    flag = "--target-s" if args.time_scale is None else "--target-s (instead of --time-scale)"
    return scale_warnings([("", plan, step)], ov, flag, step / 1000.0, limit,
                          [STANDIN_PAYLOAD_BYTES] * plan.num_stages)
