"""`octopipe export`: write a plan in another runtime's format (torch.distributed.pipelining's CSV schedule)."""

from __future__ import annotations

from ..errors import OctoPipeError
from ..formats import read_plan
from ..schedules.torch_csv import STYLES, plan_to_torch_csv, torch_csv_problems
from . import write_output
from ._options import check_writable


def add_parser(subparsers) -> None:
    """Register `octopipe export`."""
    p = subparsers.add_parser("export", help="write a plan as torch.distributed.pipelining's CSV schedule",
                              description=__doc__)
    p.add_argument("plan", metavar="PLAN.json", help="an octopipe-plan/1 file")
    p.add_argument("--torch-csv", required=True, metavar="OUT.csv",
                   help="write the compute-only CSV `_PipelineScheduleRuntime._load_csv` reads (one row per rank)")
    p.add_argument("--style", choices=STYLES, default="loop",
                   help="torchtitan's stage assignment the plan must fit: loop (stage s on rank s %% P, the one "
                        "CSV schedules get; default) or v (stages r and 2P-1-r on rank r)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Check the plan against torch's runtime and torchtitan's stages, write the CSV, say how to use it."""
    check_writable(args.torch_csv, "--torch-csv")
    plan = read_plan(args.plan)
    problems = torch_csv_problems(plan, args.style)
    if problems:
        raise OctoPipeError(f"{args.plan}: torchtitan's {args.style!r} stage assignment cannot run this plan: "
                            + "; ".join(problems))
    text = plan_to_torch_csv(plan)  # torch's notation is ours: one row of actions per rank
    write_output(lambda: _write(args.torch_csv, text), args.torch_csv)
    ranges = ", ".join(f"{s}:[{st.start},{st.end})" for s, st in enumerate(plan.stages))
    print(f"wrote {args.torch_csv}: {plan.num_devices} ranks x {plan.num_stages} stages, {plan.num_microbatches} "
          f"micro-batches ({sum(len(r) for r in plan.schedule)} actions)")
    print(f"  stage layers  {ranges}")
    print(f"  torch         _PipelineScheduleRuntime(stages, {plan.num_microbatches}, loss_fn=...)"
          f"._load_csv({args.torch_csv!r}, format='compute_only')")
    print(f"  torchtitan    pipeline_parallel_degree {plan.num_devices}, pipeline_parallel_schedule_csv "
          f"{args.torch_csv}, {plan.num_stages // plan.num_devices} stages per rank with the layers above "
          f"(module_fqns_per_model_part when they are not uniform)")
    return 0


def _write(path: str, text: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write(text)
