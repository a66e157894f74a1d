"""`octopipe simulate`: simulate a plan file or a built-in schedule; print step time, bubble, utilisation, memory."""

from __future__ import annotations

import json
from dataclasses import replace

from .. import limits as L
from ..errors import OctoPipeError, PlanError
from ..formats import Plan, bind_plan, check_plan_binding, read_plan, write_plan
from ..formats.fingerprint import describe_devices, idle_devices
from ..schedules.registry import SCHEDULES, build_plan, get_schedule
from ..simulator import SimOptions, SimResult, simulate
from ..headroom import fit_word
from ._options import (add_headroom_option, add_overheads_option, apply_headroom, check_writable, integer, keep_on_failure, load_cluster,
                       load_model, load_overheads, number, warn)

_GIB = 2**30


def add_parser(subparsers) -> None:
    """Register `octopipe simulate`."""
    p = subparsers.add_parser("simulate", help="simulate a plan or a built-in schedule", description=__doc__)
    p.add_argument("--model", required=True, help="zoo name or a model/architecture file")
    p.add_argument("--cluster", required=True, help="named cluster like h100x8, or a cluster file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", metavar="PLAN.json", help="an octopipe-plan/1 file to simulate")
    src.add_argument("--schedule", choices=sorted(SCHEDULES), help="a built-in schedule (see `octopipe schedules`)")
    p.add_argument("--devices", type=integer(1, L.MAX_DEVICES), metavar="N",
                   help="run on the cluster's first N devices (default: all; a --plan must have exactly as many)")
    p.add_argument("--microbatches", type=integer(1, L.MAX_MICROBATCHES), metavar="M",
                   help="micro-batches per step (with --schedule; stages x micro-batches at most "
                        f"{L.MAX_STAGE_MICROBATCHES:,})")
    p.add_argument("--stages-per-device", type=integer(1, L.MAX_STAGES_PER_DEVICE), default=None, metavar="V",
                   help="virtual stages per device (default: the schedule's own, 2 for V schedules, else 1; "
                        f"at most {L.MAX_STAGES_PER_DEVICE})")
    p.add_argument("--split", choices=("megatron", "balanced"), default="megatron",
                   help="stage boundaries for --schedule: Megatron's even split or the min-max balanced split")
    p.add_argument("--gpu", default=None,
                   help="GPU whose analytic costs zoo/architecture models get (default: the cluster's GPU)")
    p.add_argument("--contention", action="store_true", help="one transfer at a time per link direction")
    p.add_argument("--no-overlap", action="store_true", help="devices cannot compute while sending/receiving")
    p.add_argument("--launch-us", type=number(0.0, L.MAX_LAUNCH_US, unit="us"), default=0.0, metavar="X",
                   help=f"fixed cost per message in microseconds (0..{L.MAX_LAUNCH_US:g})")
    add_overheads_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--save-plan", metavar="F", help="write the simulated plan (with `predicted`) here")
    p.add_argument("--trace", metavar="F", help="write a Chrome/Perfetto JSON trace here")
    p.add_argument("--png", metavar="F", help="write a Gantt chart PNG here")
    add_headroom_option(p)
    p.set_defaults(run=run)


def _plan(args, model, cluster) -> tuple[Plan, object]:
    """The plan to simulate and the cluster it runs on (the first --devices devices when fewer are asked)."""
    if args.devices is not None and args.devices > cluster.num_devices:
        raise OctoPipeError(f"--devices {args.devices}: cluster {cluster.name} has only {cluster.num_devices}; "
                            f"use --devices {cluster.num_devices} or fewer, or a larger cluster")
    if args.plan:
        for flag in ("microbatches", "stages_per_device"):
            if getattr(args, flag) is not None:
                raise OctoPipeError(f"--{flag.replace('_', '-')} applies to --schedule, not to --plan")
        plan = read_plan(args.plan, model.num_layers)
        used = first_devices(cluster, args.devices)
        try:
            lines = check_plan_binding(plan, model, used, source=f"--plan {args.plan}",
                                       model_source=f"--model {args.model}", cluster_source=f"--cluster {used.name}")
        except PlanError as exc:
            if plan.num_devices < cluster.num_devices and args.devices is None:
                raise OctoPipeError(f"{exc}; or pass --devices {plan.num_devices} to run it on the first "
                                    f"{plan.num_devices} devices of {cluster.name}") from None
            raise
        check_size(plan.num_stages, plan.num_microbatches, f"--plan {args.plan}")
        for line in lines:
            warn(args, line)
        return plan, used
    if args.microbatches is None:
        raise OctoPipeError("--schedule needs --microbatches (e.g. --microbatches 16)")
    used = first_devices(cluster, args.devices)
    devices = used.num_devices
    v = get_schedule(args.schedule).stages_for(args.stages_per_device)
    check_size(devices * v, args.microbatches, f"--schedule {args.schedule} on {devices} devices x {v} stages each")
    cells = model.num_layers * devices * v
    if args.split == "balanced" and cells > L.MAX_SPLIT_CELLS:
        raise OctoPipeError(f"--split balanced: {model.num_layers:,} layers x {devices * v:,} stages = {cells:,} cells, "
                            f"more than the {L.MAX_SPLIT_CELLS:,} the exact split handles; use --split megatron or "
                            f"fewer stages")
    plan = build_plan(model, args.schedule, devices, args.microbatches, args.stages_per_device, split=args.split)
    idle = idle_devices(plan)
    if idle:
        warn(args, f"{len(idle)} of {devices} devices hold no layers (device{'s' if len(idle) > 1 else ''} "
                   f"{describe_devices(idle)}): {model.name} has {model.num_layers} layers for {plan.num_stages} "
                   f"stages; use at most {max(1, model.num_layers // v)} devices")
    return plan, used


def first_devices(cluster, n: int | None):
    """The cluster cut to its first `n` devices (itself when n is None or all of them)."""
    if n is None or n == cluster.num_devices:
        return cluster
    return replace(cluster, num_devices=n, devices_per_node=min(cluster.devices_per_node, n),
                   name=f"{cluster.name}[0:{n}]")


def check_size(num_stages: int, num_microbatches: int, what: str) -> None:
    """Refuse a simulation larger than `limits.MAX_STAGE_MICROBATCHES` (stages x micro-batches), naming the limit."""
    size = num_stages * num_microbatches
    if size > L.MAX_STAGE_MICROBATCHES:
        most = max(1, L.MAX_STAGE_MICROBATCHES // num_stages)
        raise OctoPipeError(f"{what}: {num_stages:,} stages x {num_microbatches:,} micro-batches = {size:,}, more than "
                            f"the {L.MAX_STAGE_MICROBATCHES:,} one simulation handles (about 10 s and 1 GiB); "
                            f"use at most {most:,} micro-batches here")


def run(args) -> int:
    """Build or read the plan, simulate it, write what was asked, print the report."""
    for option, path in (("--save-plan", args.save_plan), ("--trace", args.trace), ("--png", args.png)):
        check_writable(path, option)
    cluster = apply_headroom(args, load_cluster(args.cluster))
    model, costs = load_model(args, cluster)
    plan, cluster = _plan(args, model, cluster)
    opts = SimOptions(contention=args.contention, overlap=not args.no_overlap, launch_ms=args.launch_us / 1000.0,
                      overheads=load_overheads(args))
    res = simulate(model, cluster, plan, opts)
    report = _report(model, cluster, plan, res)
    report["costs"] = costs.as_dict()
    failed = []
    if args.save_plan:
        saved = bind_plan(replace(plan, predicted=res.summary()), model, cluster)
        failed += keep_on_failure(lambda: write_plan(saved, args.save_plan), args.save_plan, saved)
    if args.trace:
        from ..simulator.trace import write_trace

        failed += keep_on_failure(lambda: write_trace(model, cluster, plan, args.trace, opts, res), args.trace)
    if args.png:
        from ..simulator.gantt import write_png

        failed += keep_on_failure(lambda: write_png(model, cluster, plan, args.png, opts, res), args.png)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if failed:
        raise OctoPipeError("; ".join(failed))
    return 0


def _samples_per_step(model, plan) -> int | None:
    """Samples per step when the model says its micro-batch size (meta or meta.arch), else None."""
    meta = model.meta if isinstance(model.meta, dict) else {}
    arch = meta.get("arch") if isinstance(meta.get("arch"), dict) else {}
    mbs = meta.get("micro_batch_size", arch.get("micro_batch_size"))
    return mbs * plan.num_microbatches if isinstance(mbs, int) and mbs > 0 else None


def _report(model, cluster, plan, res: SimResult) -> dict:
    """Everything the command prints, as one JSON-ready dict."""
    samples = _samples_per_step(model, plan)
    per_s = 1000.0 / res.step_time_ms if res.step_time_ms > 0 else 0.0
    return {
        "model": model.name,
        "cluster": cluster.name,
        "schedule": plan.meta.get("schedule", "custom"),
        "num_devices": plan.num_devices,
        "num_stages": plan.num_stages,
        "num_microbatches": plan.num_microbatches,
        "step_time_ms": res.step_time_ms,
        "bubble_ratio": res.bubble_ratio,
        "throughput": ({"samples_per_s": samples * per_s} if samples is not None
                       else {"microbatches_per_s": plan.num_microbatches * per_s}),
        "devices": [
            {"device": d, "stages": plan.stages_of(d), "busy_ms": res.busy_ms[d], "utilisation": res.utilisation[d],
             "peak_memory_bytes": res.peak_memory_bytes[d], "static_bytes": res.static_bytes[d],
             "free_bytes": cluster.memory_bytes - res.peak_memory_bytes[d],
             "fits": res.peak_memory_bytes[d] <= cluster.usable_memory_bytes,
             "fit": fit_word(res.peak_memory_bytes[d], cluster)}
            for d in range(plan.num_devices)
        ],
        "memory_bytes": cluster.memory_bytes,
        "memory_headroom_bytes": cluster.memory_headroom_bytes,
        "usable_memory_bytes": cluster.usable_memory_bytes,
        "critical_path_length": len(res.critical_path),
    }


def _costs_line(costs: dict | None) -> str:
    if not costs:
        return "as given"
    return f"{costs['source']}, {costs['gpu'] or 'GPU not recorded'} ({costs['why']})"


def _memory_line(r: dict) -> str:
    kept = r.get("memory_headroom_bytes", 0)
    if not kept:
        return f"{r['memory_bytes'] / _GIB:.1f} GiB per device, no headroom"
    return (f"{r['usable_memory_bytes'] / _GIB:.1f} GiB usable of {r['memory_bytes'] / _GIB:.1f} GiB per device "
            f"({kept / _GIB:.1f} GiB headroom, --memory-headroom)")


def format_report(r: dict) -> str:
    """The report as a short header and a per-device table."""
    tp = r["throughput"]
    rate = (f"{tp['samples_per_s']:.2f} samples/s" if "samples_per_s" in tp
            else f"{tp['microbatches_per_s']:.2f} micro-batches/s")
    lines = [
        f"{r['model']} on {r['cluster']}: {r['schedule']}, {r['num_devices']} devices, {r['num_stages']} stages, "
        f"{r['num_microbatches']} micro-batches",
        f"  costs       {_costs_line(r.get('costs'))}",
        f"  step time   {r['step_time_ms']:.3f} ms",
        f"  bubble      {r['bubble_ratio']:.2%}",
        f"  throughput  {rate}",
        f"  memory      {_memory_line(r)}",
        "",
        f"  {'device':>6}  {'stages':<12} {'busy ms':>10} {'util':>7} {'peak GiB':>9} {'free GiB':>9} {'of GiB':>7}  "
        f"fits",
    ]
    limit = r["memory_bytes"] / _GIB
    for d in r["devices"]:
        stages = ",".join(str(s) for s in d["stages"])
        fit = d.get("fit", "yes" if d["fits"] else "NO")
        lines.append(f"  {d['device']:>6}  {stages:<12} {d['busy_ms']:>10.2f} {d['utilisation']:>7.1%} "
                     f"{d['peak_memory_bytes'] / _GIB:>9.2f} {(r['memory_bytes'] - d['peak_memory_bytes']) / _GIB:>9.2f}"
                     f" {limit:>7.1f}  {fit}")
    kept = r.get("memory_headroom_bytes", 0)
    tight = [d for d in r["devices"] if d.get("fit") == "only without headroom"]
    if tight:
        lines.append(f"  fits only without headroom: device{'s' if len(tight) > 1 else ''} "
                     f"{', '.join(str(d['device']) for d in tight[:8])}{' ...' if len(tight) > 8 else ''} stay within "
                     f"the device but eat into the {kept / _GIB:.1f} GiB kept free (--memory-headroom); on a real "
                     f"GPU that risks an out-of-memory error")
    over = [d for d in r["devices"] if d.get("fit", "yes" if d["fits"] else "NO") == "NO"]
    if over:
        worst = max(d["peak_memory_bytes"] for d in over) / _GIB
        lines.append(f"  does not fit: device{'s' if len(over) > 1 else ''} "
                     f"{', '.join(str(d['device']) for d in over[:8])}{' ...' if len(over) > 8 else ''} need up to "
                     f"{worst:.1f} GiB of {limit:.1f} GiB; try fewer micro-batches in flight (1f1b or zb-h1 instead of "
                     f"gpipe), full recompute (`octopipe model ... --recompute -o m.json`), more devices, or --tp")
    return "\n".join(lines)
