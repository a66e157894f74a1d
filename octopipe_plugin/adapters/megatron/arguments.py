"""OctoPipe's Megatron-LM arguments: the extra_args_provider and the run facts a plan must match.

`add_octopipe_args` is an `extra_args_provider` for `megatron.training.arguments.parse_args`
(the launcher chains it after the script's own provider; the patch calls it inside parse_args):

    --pipeline-schedule {default,octopipe}   Megatron's own schedule, or the plan's order via OctoPipe
    --octopipe-plan PATH                     an octopipe-plan/1 file to run
    --octopipe-cluster NAME|PATH             tune a plan at start-up for this cluster (rank 0, broadcast)
    --octopipe-gpu, --octopipe-tune-seconds, --octopipe-tune-iterations, --octopipe-seed, --octopipe-costs
    --octopipe-memory-headroom GIB|FRACTION  memory the tuned plan leaves free per rank (default 8%)
    --octopipe-profile                       measure the layer kinds on this device before tuning (rank 0)
    --octopipe-profile-repeats, --octopipe-profile-cache
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ...errors import OctoPipeError
from ...headroom import DEFAULT as HEADROOM, HELP as HEADROOM_HELP

SCHEDULES = ("default", "octopipe")
PLAN_FILE = "octopipe-plan.json"  # written next to the checkpoint (--save), read back on --load


def add_octopipe_args(parser):
    """Add OctoPipe's arguments to Megatron's parser (an extra_args_provider); returns the parser."""
    if "--pipeline-schedule" in parser._option_string_actions:  # a patched Megatron already added them
        return parser
    group = parser.add_argument_group(title="OctoPipe pipeline schedule")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default="default",
                       help="'octopipe' runs the plan's stages, stage->rank map and per-rank F/B/I/W order")
    group.add_argument("--octopipe-plan", default=None, metavar="PATH",
                       help="octopipe-plan/1 file to run (default: the one saved next to --load, else tune)")
    group.add_argument("--octopipe-cluster", default=None, metavar="NAME|PATH",
                       help="cluster to tune for at start-up: '<gpu>x<P>' (e.g. h100x8) or an octopipe-cluster/1 "
                            "file with one device per pipeline rank")
    group.add_argument("--octopipe-gpu", default=None,
                       help="GPU of the analytic cost model (default: the cluster's GPU, else H100)")
    group.add_argument("--octopipe-tune-seconds", type=float, default=30.0,
                       help="tuning time budget on rank 0 (default 30)")
    group.add_argument("--octopipe-tune-iterations", type=int, default=None,
                       help="tuning iterations instead of a time budget (same plan on every run)")
    group.add_argument("--octopipe-seed", type=int, default=0, help="tuner seed (default 0)")
    group.add_argument("--octopipe-memory-headroom", default=HEADROOM, metavar="GIB|FRACTION",
                       help="memory the tuned plan leaves free on every rank: " + HEADROOM_HELP.split(": ", 1)[1])
    group.add_argument("--octopipe-costs", default=None, metavar="PATH",
                       help="measured per-layer costs (JSON: layer name or kind -> {fwd_ms, bwd_ms, wgrad_ms, ...}) "
                            "that replace the analytic ones")
    group.add_argument("--octopipe-profile", action="store_true",
                       help="before tuning at start-up, measure one real Megatron layer of each kind on this device "
                            "(rank 0; cached on disk) and tune on those costs (not with --octopipe-plan)")
    group.add_argument("--octopipe-profile-repeats", type=int, default=10,
                       help="timed repeats per layer kind for --octopipe-profile (default 10)")
    group.add_argument("--octopipe-profile-cache", default=None, metavar="DIR",
                       help="profile cache folder for --octopipe-profile (default: the profiler's)")
    return parser


def chain_providers(*providers):
    """One extra_args_provider applying each given provider (None skipped) in order."""
    active = [p for p in providers if p is not None]

    def provider(parser):
        for p in active:
            parser = p(parser)
        return parser

    return provider


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """What a plan must agree with: pipeline size and micro-batches per step of this run."""

    pipeline_size: int
    data_parallel_size: int
    num_microbatches: int
    rampup: bool


def run_facts(args) -> RunFacts:
    """Pipeline size, data-parallel size and micro-batches per step, as Megatron will derive them."""
    pp = int(args.pipeline_model_parallel_size)
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
    model_parallel = pp * int(args.tensor_model_parallel_size) * int(getattr(args, "context_parallel_size", 1) or 1)
    if world % model_parallel:
        raise OctoPipeError(f"world size {world} is not a multiple of TP x PP x CP = {model_parallel}")
    dp = world // model_parallel
    mbs = int(args.micro_batch_size)
    gbs = int(args.global_batch_size or mbs * dp)
    if gbs % (mbs * dp):
        raise OctoPipeError(f"--global-batch-size {gbs} is not a multiple of micro-batch size x data-parallel size "
                            f"= {mbs} x {dp}")
    return RunFacts(pipeline_size=pp, data_parallel_size=dp, num_microbatches=gbs // (mbs * dp),
                    rampup=bool(getattr(args, "rampup_batch_size", None)))


def load_measured_costs(path: str | None) -> dict:
    """Measured per-layer costs from a JSON file (layer name or kind -> fields), or {} without a path."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise OctoPipeError(f"--octopipe-costs {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise OctoPipeError(f"--octopipe-costs {path}: expected an object mapping a layer name or kind to an object "
                            "of cost fields (fwd_ms, bwd_ms, wgrad_ms, ...)")
    return data
