"""Print the Megatron-LM launch arguments that build an OctoPipe plan's pipeline stages.

    python examples/megatron/layout_from_plan.py --model deepseek-v3-mini --cluster h100x4
    python examples/megatron/layout_from_plan.py --model nemotron-h --cluster h100x8 --stages-per-device 2
    python examples/megatron/layout_from_plan.py --model llama3-8b --cluster h100x4 --tune 10
    python examples/megatron/layout_from_plan.py --model llama3-8b --plan plan.json

The arguments carry the plan's partition and its round-robin placement; Megatron then runs its
own interleaved 1F1B order on them. Plans Megatron cannot express (V-shape placement, an
embedding or LM head moved off the end stages, a vision encoder) are refused with the reason.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from octopipe_plugin.adapters.megatron import megatron_launch_args
from octopipe_plugin.costs import cost_gpu, resolve_cluster, resolve_model
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import bind_plan, read_plan, write_plan
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate

log = logging.getLogger("layout_from_plan")


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="zoo name or model/architecture file (default llama3-8b)")
    p.add_argument("--gpu", default=None, help="GPU of the analytic cost model (default: the cluster's, else H100)")
    p.add_argument("--cluster", default="h100x4", help="named cluster (<gpu>x<count>) or cluster file")
    p.add_argument("--microbatches", type=int, default=16, help="micro-batches per step (default 16)")
    p.add_argument("--stages-per-device", type=int, default=2, help="virtual stages per rank (default 2)")
    p.add_argument("--split", default="megatron", choices=("megatron", "balanced"),
                   help="stage boundaries: Megatron's even split (default) or the min-max balanced split")
    p.add_argument("--tune", type=float, metavar="SECONDS", help="tune a plan with this time budget instead")
    p.add_argument("--plan", help="use this octopipe-plan/1 file instead")
    p.add_argument("-o", "--output", help="write the plan used here")
    p.add_argument("--check-with-megatron", action="store_true",
                   help="also parse and validate the layout with megatron-core and print its per-rank table")
    return p.parse_args(argv)


def choose_plan(args, model, cluster):
    """The plan to express: a file, a tuned plan, or interleaved 1F1B on the chosen split."""
    if args.plan:
        return read_plan(args.plan, model.num_layers)
    if args.tune is not None:
        from octopipe_plugin.tuner import tune

        return tune(model, cluster, args.microbatches, time_budget_s=args.tune).plan
    return build_plan(model, "interleaved-1f1b", cluster.num_devices, args.microbatches,
                      stages_per_device=args.stages_per_device, split=args.split)


def log_megatron_runs(plan, model, cluster) -> None:
    """Simulated step of what Megatron runs: its interleaved 1F1B order on these stages, and on its even split."""
    p, v = plan.num_devices, plan.num_stages // plan.num_devices
    m = plan.num_microbatches
    ranges = [(st.start, st.end) for st in plan.stages]
    on_plan = build_plan(model, "interleaved-1f1b", p, m, stages_per_device=v, boundaries=ranges)
    even = build_plan(model, "interleaved-1f1b", p, m, stages_per_device=v, split="megatron")
    log.info("Megatron's interleaved 1F1B on these stages: %.1f ms; on its even split: %.1f ms "
             "(the plan's own action order needs OctoPipe's executor)",
             simulate(model, cluster, on_plan, detail=False).step_time_ms,
             simulate(model, cluster, even, detail=False).step_time_ms)


def check_with_megatron(args_list) -> str:
    """megatron-core's own parser and validator on the layout; its per-rank table."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    opts = dict(zip(args_list[::2], args_list[1::2]))
    layout = PipelineParallelLayerLayout(opts["--pipeline-model-parallel-layout"],
                                         int(opts["--pipeline-model-parallel-size"]))
    layout.validate_layer_layout(num_layers=int(opts["--num-layers"]),
                                 mtp_num_layers=int(opts["--mtp-num-layers"]) if "--mtp-num-layers" in opts else None)
    return layout.pretty_repr()


def main(argv=None) -> int:
    """Build or tune a plan, then print the Megatron launch arguments for it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        cluster = resolve_cluster(args.cluster)
        model = resolve_model(args.model, gpu=cost_gpu(cluster, args.gpu))
        plan = choose_plan(args, model, cluster)
        if args.output:
            write_plan(bind_plan(plan, model, cluster), args.output)
        sim = simulate(model, cluster, plan, detail=False)
        log.info("plan: %d stages on %d devices, simulated step %.1f ms, bubble %.1f%%", plan.num_stages,
                 plan.num_devices, sim.step_time_ms, 100 * sim.bubble_ratio)
        launch = megatron_launch_args(plan, model)
        log_megatron_runs(plan, model, cluster)
    except OctoPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(shlex.join(launch))
    if args.check_with_megatron and "--pipeline-model-parallel-layout" in launch:
        print(check_with_megatron(launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
