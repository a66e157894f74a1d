"""`octopipe schedules`: list the built-in schedules, their placement and requirements; `--show` draws one.

`--show NAME --devices N --microbatches M` prints that schedule's per-device order as a grid,
each overlapped pair's halves side by side joined by the sign (`3F12+` `5B7`: stage 3's forward
of micro-batch 12 run overlapped with stage 5's backward of micro-batch 7).
"""

from __future__ import annotations

import json

from ..actions import PairedSchedule, format_schedule, render_grid
from ..errors import OctoPipeError
from ..schedules.registry import SCHEDULES, get_schedule, stage_devices_for
from ._options import integer

# What `--show` draws at most: a grid is read by a person.
MAX_SHOW_DEVICES = 64
MAX_SHOW_MICROBATCHES = 1024
MAX_SHOW_ACTIONS = 100_000


def add_parser(subparsers) -> None:
    """Register `octopipe schedules`."""
    p = subparsers.add_parser("schedules", help="list the built-in schedules", description=__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.add_argument("--show", choices=sorted(SCHEDULES), metavar="NAME",
                   help="draw this schedule's per-device order (with --devices and --microbatches)")
    p.add_argument("--devices", type=integer(1, MAX_SHOW_DEVICES), metavar="N", help="devices for --show")
    p.add_argument("--microbatches", type=integer(1, MAX_SHOW_MICROBATCHES), metavar="M",
                   help="micro-batches for --show")
    p.add_argument("--stages-per-device", type=integer(1, 16), default=None, metavar="V",
                   help="stages per device for --show (default: the schedule's own, 2 for V schedules, else 1)")
    p.add_argument("--width", type=integer(1, 100_000), default=None, metavar="K",
                   help="with --show, draw each device's first K actions only")
    p.set_defaults(run=run)


def rows() -> list[dict]:
    """One dict per registered schedule."""
    return [
        {"name": s.name, "placement": s.placement.value,
         "stages_per_device": s.stages_per_device if s.stages_per_device is not None else "any",
         "split_backward": s.uses_split_backward, "pairs": s.overlapped_pairs, "requirements": s.requirements}
        for s in SCHEDULES.values()
    ]


def generated(name: str, num_devices: int, num_microbatches: int, stages_per_device: int | None = None):
    """(stages per device, per-device schedule as a PairedSchedule) of built-in `name`; PlanError when it cannot serve."""
    spec = get_schedule(name)
    v = spec.stages_for(stages_per_device)
    spec.check(num_devices, num_microbatches, v)
    if num_devices * v * num_microbatches * 3 > MAX_SHOW_ACTIONS:
        raise OctoPipeError(f"--show draws at most about {MAX_SHOW_ACTIONS:,} actions; {num_devices} devices x "
                            f"{v} stages x {num_microbatches} micro-batches is more (use fewer micro-batches)")
    schedule = spec.generate(stage_devices_for(name, num_devices, v), num_devices, num_microbatches)
    return v, PairedSchedule(schedule, getattr(schedule, "pairs", ()))


def run(args) -> int:
    """Print the registry, or one schedule's grid."""
    if args.show is not None:
        return _show(args)
    if args.devices is not None or args.microbatches is not None or args.width is not None \
            or args.stages_per_device is not None:
        raise OctoPipeError("--devices, --microbatches, --stages-per-device and --width go with --show NAME")
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'name':<17} {'placement':<9} {'v':<4} {'I/W':<4} {'pairs':<5} requirements")
    for r in table:
        print(f"{r['name']:<17} {r['placement']:<9} {str(r['stages_per_device']):<4} "
              f"{'yes' if r['split_backward'] else 'no':<4} {'yes' if r['pairs'] else 'no':<5} {r['requirements']}")
    return 0


def _show(args) -> int:
    if args.devices is None or args.microbatches is None:
        raise OctoPipeError(f"--show {args.show} needs --devices N and --microbatches M")
    v, schedule = generated(args.show, args.devices, args.microbatches, args.stages_per_device)
    if args.json:
        print(json.dumps({"name": args.show, "devices": args.devices, "microbatches": args.microbatches,
                          "stages_per_device": v, "schedule": format_schedule(schedule, schedule.pairs)}, indent=1))
        return 0
    print(f"{args.show}: {args.devices} devices, {args.microbatches} micro-batches, {v} stage(s) per device, "
          f"{len(schedule.pairs)} overlapped pair(s) (a pair's halves side by side, joined by +: `3F12+` `5B7`)")
    print(render_grid(schedule, width=args.width))
    return 0
