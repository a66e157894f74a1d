"""`octopipe schedules`: list the built-in schedules, their placement and requirements."""

from __future__ import annotations

import json

from ..schedules.registry import SCHEDULES


def add_parser(subparsers) -> None:
    """Register `octopipe schedules`."""
    p = subparsers.add_parser("schedules", help="list the built-in schedules", description=__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.set_defaults(run=run)


def rows() -> list[dict]:
    """One dict per registered schedule."""
    return [
        {"name": s.name, "placement": s.placement.value,
         "stages_per_device": s.stages_per_device if s.stages_per_device is not None else "any",
         "split_backward": s.uses_split_backward, "requirements": s.requirements}
        for s in SCHEDULES.values()
    ]


def run(args) -> int:
    """Print the registry."""
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'name':<17} {'placement':<9} {'v':<4} {'I/W':<4} requirements")
    for r in table:
        print(f"{r['name']:<17} {r['placement']:<9} {str(r['stages_per_device']):<4} "
              f"{'yes' if r['split_backward'] else 'no':<4} {r['requirements']}")
    return 0
