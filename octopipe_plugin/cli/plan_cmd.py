"""`octopipe plan`: tune partition, placement and per-device schedule; compare with every built-in schedule."""

from __future__ import annotations

import json
import time

from .. import limits as L
from ..errors import OctoPipeError
from ..formats import bind_plan, plan_to_dict, write_plan
from ..tuner.compare import comparison_rows, format_table
from ._options import (add_constraint_options, add_headroom_option, add_overheads_option, apply_headroom, check_writable, integer,
                       keep_on_failure, load_cluster, load_model, number)
from .plan_report import as_json, check_size, native_references, summary, tuned
from .plan_split import add_split_option, plain_budget, with_splits


def add_parser(subparsers) -> None:
    """Register `octopipe plan`."""
    p = subparsers.add_parser("plan", help="tune a pipeline plan (partition + placement + schedule)",
                              description=__doc__)
    p.add_argument("--model", help="zoo name (octopipe model --list) or a model/architecture file "
                                    "(or give --megatron-args)")
    p.add_argument("--cluster", required=True, help="named cluster like h100x8, h100x16, or a cluster file")
    p.add_argument("--microbatches", type=integer(1, L.MAX_MICROBATCHES), metavar="M",
                   help=f"micro-batches per step (devices x micro-batches at most {L.MAX_TUNE_DEVICE_MICROBATCHES:,})")
    p.add_argument("--gpu", default=None,
                   help="GPU whose analytic costs zoo/architecture models get (default: the cluster's GPU)")
    p.add_argument("--time-budget", type=number(0.0, L.MAX_TIME_BUDGET_S, open_low=True, unit="s"), default=60.0,
                   metavar="SECONDS", help="search budget in seconds, setup included (default 60); converted to a "
                                           "fixed amount of work, with the wall clock as a guard")
    p.add_argument("--seed", type=integer(0, L.MAX_SEED), default=0, help="random seed of the search (default 0)")
    p.add_argument("--iterations", type=integer(0, L.MAX_ITERATIONS), default=None,
                   help="run exactly this many search steps (fully deterministic; the time budget still caps)")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the tuned octopipe-plan/1 here")
    p.add_argument("--png", metavar="PLAN.png", help="draw the tuned plan's timeline here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_headroom_option(p)
    add_constraint_options(p)
    add_overheads_option(p)
    add_split_option(p)
    p.add_argument("--recompute", choices=("none", "auto", "full"), default="auto",
                   help="per-layer activation recompute (docs/formats.md \"Memory choices\"): auto (default) where a "
                        "faster schedule fits only with it, full on every layer, none never")
    p.add_argument("--offload", choices=("none", "auto"), default="auto",
                   help="offload of saved activations to host memory: auto (default) where it pays, none never")
    g = p.add_argument_group("from your launch", "plan for the model and batch a Megatron launch would run")
    g.add_argument("--megatron-args", metavar="'ARGS'|@FILE",
                   help="the launch's Megatron arguments (pretrain_gpt.py ...), inline or @file: parsed and "
                        "validated by Megatron itself; the model, micro-batch count and current stages come from them")
    g.add_argument("--deepspeed-config", metavar="DS_CONFIG.json",
                   help="a DeepSpeed config: gradient_accumulation_steps gives the micro-batches, its \"octopipe\" "
                        "block (if any) the tune settings; needs --module")
    g.add_argument("--module", metavar="PKG.MOD:FN",
                   help="with --deepspeed-config: a function returning the LayerSpec list you give PipelineModule "
                        "(called on the meta device: nothing is allocated)")
    g.add_argument("--partition-method", default="parameters", metavar="METHOD",
                   help="with --deepspeed-config: your PipelineModule's partition_method, for the table against "
                        "your current setup (parameters, uniform or type:REGEX; default DeepSpeed's parameters)")
    g.add_argument("--activation-checkpoint-interval", type=integer(0, 10 ** 6), default=0, metavar="N",
                   help="with --deepspeed-config: your PipelineModule's activation_checkpoint_interval; the plan's "
                        "per-layer choices replace it (printed to drop) unless --recompute none --offload none")
    g.add_argument("--world-size", type=integer(1, L.MAX_DEVICES * 1024), default=None, metavar="N",
                   help="GPUs of the launch (default TP x PP x CP: one data-parallel replica); sets the "
                        "data-parallel size, hence micro-batches per step and the optimizer's sharding")
    p.set_defaults(run=run)


def run(args) -> int:
    """Tune, write the plan (and picture) if asked, print the summary and the comparison."""
    if args.megatron_args is not None and args.deepspeed_config is not None:
        raise OctoPipeError("--megatron-args and --deepspeed-config: give one launch to plan from")
    if args.megatron_args is not None:
        from .launch_plan import run_from_megatron

        return run_from_megatron(args)
    if args.deepspeed_config is not None or args.module is not None:
        if args.deepspeed_config is None or args.module is None:
            raise OctoPipeError("--deepspeed-config and --module go together (the config and the function returning "
                                "your PipelineModule's LayerSpec list)")
        from .launch_plan import run_from_deepspeed

        return run_from_deepspeed(args)
    for flag in ("model", "microbatches"):
        if getattr(args, flag) is None:
            raise OctoPipeError(f"--{flag} is required (or plan from your launch with --megatron-args '...')")
    if args.world_size is not None:
        raise OctoPipeError("--world-size applies to --megatron-args and --deepspeed-config")
    check_writable(args.output, "-o")
    check_writable(args.png, "--png")
    end = time.monotonic() + args.time_budget  # the tunes and the references' refinements end by then
    cluster = apply_headroom(args, load_cluster(args.cluster))
    model, costs = load_model(args, cluster)
    check_size(model, cluster, args.microbatches, args.time_budget)
    result = tuned(args, model, cluster, args.microbatches,
                   time_budget_s=plain_budget(args, model, cluster))
    result, rows, split_line = with_splits(args, model, cluster, args.microbatches, result)
    plan = bind_plan(result.plan, model, cluster)
    failed = []
    if args.output:
        failed += keep_on_failure(lambda: write_plan(plan, args.output), args.output, plan)
    if args.png:
        from ..simulator.gantt import write_png

        failed += keep_on_failure(lambda: write_png(model, cluster, plan, args.png), args.png,
                                  None if args.output and not failed else plan)
    rows = rows or comparison_rows(result, cluster)
    natives = native_references(result, model, cluster, args.time_budget, end)
    if args.json:
        print(json.dumps({**as_json(result, rows, cluster, natives), "plan": plan_to_dict(plan),
                          "costs": costs.as_dict(), **({"split_layers": split_line} if split_line else {})},
                         indent=1))
    else:
        print(summary(result, model, cluster, costs.line(), natives))
        if split_line:
            print("  " + split_line)
        print()
        print(format_table(rows, cluster.memory_bytes, cluster.memory_headroom_bytes))
    if failed:
        raise OctoPipeError("; ".join(failed))
    return 0
