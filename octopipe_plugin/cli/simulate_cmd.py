"""`octopipe simulate`: simulate a plan file or a built-in schedule; print step time, bubble, utilisation, memory."""

from __future__ import annotations

import json
from dataclasses import replace

from ..costs import get_gpu, resolve_cluster, resolve_model
from ..errors import OctoPipeError
from ..formats import Plan, read_plan, write_plan
from ..schedules.registry import SCHEDULES, build_plan
from ..simulator import SimOptions, SimResult, simulate
from . import write_output

_GIB = 2**30


def add_parser(subparsers) -> None:
    """Register `octopipe simulate`."""
    p = subparsers.add_parser("simulate", help="simulate a plan or a built-in schedule", description=__doc__)
    p.add_argument("--model", required=True, help="zoo name or a model/architecture file")
    p.add_argument("--cluster", required=True, help="named cluster like h100x8, or a cluster file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", metavar="PLAN.json", help="an octopipe-plan/1 file to simulate")
    src.add_argument("--schedule", choices=sorted(SCHEDULES), help="a built-in schedule (see `octopipe schedules`)")
    p.add_argument("--devices", type=int, help="pipeline devices (with --schedule; default: the cluster's)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (with --schedule)")
    p.add_argument("--stages-per-device", type=int, default=None, metavar="V",
                   help="virtual stages per device (default: the schedule's own, 2 for V schedules, else 1)")
    p.add_argument("--split", choices=("megatron", "balanced"), default="megatron",
                   help="stage boundaries for --schedule: Megatron's even split or the min-max balanced split")
    p.add_argument("--gpu", default="H100", help="GPU of the analytic cost model for zoo models (default H100)")
    p.add_argument("--contention", action="store_true", help="one transfer at a time per link direction")
    p.add_argument("--no-overlap", action="store_true", help="devices cannot compute while sending/receiving")
    p.add_argument("--launch-us", type=float, default=0.0, metavar="X", help="fixed cost per message (us)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--save-plan", metavar="F", help="write the simulated plan (with `predicted`) here")
    p.add_argument("--trace", metavar="F", help="write a Chrome/Perfetto JSON trace here")
    p.add_argument("--png", metavar="F", help="write a Gantt chart PNG here")
    p.set_defaults(run=run)


def _plan(args, model, cluster) -> Plan:
    if args.plan:
        for flag in ("devices", "microbatches", "stages_per_device"):
            if getattr(args, flag) is not None:
                raise OctoPipeError(f"--{flag.replace('_', '-')} applies to --schedule, not to --plan")
        plan = read_plan(args.plan, model.num_layers)
    else:
        if args.microbatches is None:
            raise OctoPipeError("--schedule needs --microbatches")
        devices = args.devices if args.devices is not None else cluster.num_devices
        plan = build_plan(model, args.schedule, devices, args.microbatches, args.stages_per_device, split=args.split)
    if plan.num_devices > cluster.num_devices:
        raise OctoPipeError(f"the plan uses {plan.num_devices} devices, cluster {cluster.name} has "
                            f"{cluster.num_devices}")
    return plan


def _options(args) -> SimOptions:
    if args.launch_us < 0:
        raise OctoPipeError(f"--launch-us must be >= 0, got {args.launch_us}")
    return SimOptions(contention=args.contention, overlap=not args.no_overlap, launch_ms=args.launch_us / 1000.0)


def run(args) -> int:
    """Build or read the plan, simulate it, write what was asked, print the report."""
    model = resolve_model(args.model, get_gpu(args.gpu).name)
    cluster = resolve_cluster(args.cluster)
    plan = _plan(args, model, cluster)
    opts = _options(args)
    res = simulate(model, cluster, plan, opts)
    report = _report(model, cluster, plan, res)
    if args.save_plan:
        write_output(lambda: write_plan(replace(plan, predicted=res.summary()), args.save_plan), args.save_plan)
    if args.trace:
        from ..simulator.trace import write_trace

        write_output(lambda: write_trace(model, cluster, plan, args.trace, opts, res), args.trace)
    if args.png:
        from ..simulator.gantt import write_png

        write_output(lambda: write_png(model, cluster, plan, args.png, opts, res), args.png)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
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
             "fits": res.peak_memory_bytes[d] <= cluster.memory_bytes}
            for d in range(plan.num_devices)
        ],
        "memory_bytes": cluster.memory_bytes,
        "critical_path_length": len(res.critical_path),
    }


def format_report(r: dict) -> str:
    """The report as a short header and a per-device table."""
    tp = r["throughput"]
    rate = (f"{tp['samples_per_s']:.2f} samples/s" if "samples_per_s" in tp
            else f"{tp['microbatches_per_s']:.2f} micro-batches/s")
    lines = [
        f"{r['model']} on {r['cluster']}: {r['schedule']}, {r['num_devices']} devices, {r['num_stages']} stages, "
        f"{r['num_microbatches']} micro-batches",
        f"  step time   {r['step_time_ms']:.3f} ms",
        f"  bubble      {r['bubble_ratio']:.2%}",
        f"  throughput  {rate}",
        "",
        f"  {'device':>6}  {'stages':<12} {'busy ms':>10} {'util':>7} {'peak GiB':>9} {'of GiB':>7}  fits",
    ]
    limit = r["memory_bytes"] / _GIB
    for d in r["devices"]:
        stages = ",".join(str(s) for s in d["stages"])
        lines.append(f"  {d['device']:>6}  {stages:<12} {d['busy_ms']:>10.2f} {d['utilisation']:>7.1%} "
                     f"{d['peak_memory_bytes'] / _GIB:>9.2f} {limit:>7.1f}  {'yes' if d['fits'] else 'NO'}")
    return "\n".join(lines)
