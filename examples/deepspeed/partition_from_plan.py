"""Partition a DeepSpeed PipelineModule at an OctoPipe plan's stage boundaries.

    python examples/deepspeed/partition_from_plan.py --model llama3-8b --cluster h100x2 --out ds_run
    python examples/deepspeed/partition_from_plan.py --model deepseek-v3-mini --cluster h100x2 --build

Writes the plan (plan.json) and a DeepSpeed config (ds_config.json) whose "octopipe" block names
it, prints DeepSpeed's `parts` next to DeepSpeed's own uniform split, and with --build starts one
CPU process per pipeline rank (gloo) that builds `OctoPipePipelineModule` from stand-in LayerSpecs
(one small Linear per model layer) and reports the layers it built. In a training script:

    parts = load_parts(ds_config, num_specs=len(layer_specs))
    module = OctoPipePipelineModule(layer_specs, parts=parts, loss_fn=...)
    engine, *_ = deepspeed.initialize(model=module, config=ds_config, ...)

DeepSpeed's PipelineEngine runs one stage per rank, stage s on rank s: plans with several
stages per device or another placement are refused (OctoPipe's executor runs those).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

from octopipe_plugin.adapters.deepspeed import load_parts
from octopipe_plugin.costs import cost_gpu, resolve_cluster, resolve_model
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.formats import write_plan
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate

log = logging.getLogger("partition_from_plan")
STAND_IN_WIDTH = 8


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="zoo name or model/architecture file (default llama3-8b)")
    p.add_argument("--gpu", default=None, help="GPU of the analytic cost model (default: the cluster's, else H100)")
    p.add_argument("--cluster", default="h100x2", help="named cluster (<gpu>x<count>) or cluster file")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "zb-h1"),
                   help="a one-stage-per-device schedule (default 1f1b)")
    p.add_argument("--split", default="balanced", choices=("balanced", "megatron"), help="stage boundaries")
    p.add_argument("--tune", type=float, metavar="SECONDS", help="tune a plan with this time budget instead")
    p.add_argument("--out", help="folder for plan.json and ds_config.json (default: a new temporary folder)")
    p.add_argument("--build", action="store_true", help="build the partitioned PipelineModule on CPU ranks")
    return p.parse_args(argv)


def make_plan(args, model, cluster):
    """A tuned plan or a built-in one-stage-per-device schedule on the chosen split."""
    if args.tune is not None:
        from octopipe_plugin.tuner import tune

        return tune(model, cluster, args.microbatches, time_budget_s=args.tune).plan
    return build_plan(model, args.schedule, cluster.num_devices, args.microbatches, split=args.split)


def write_files(plan, out_dir: str) -> dict:
    """plan.json and ds_config.json (with the octopipe block) in out_dir; returns the config."""
    os.makedirs(out_dir, exist_ok=True)
    plan_path = os.path.join(out_dir, "plan.json")
    write_plan(plan, plan_path)
    ds_config = {"train_batch_size": plan.num_microbatches, "train_micro_batch_size_per_gpu": 1,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                 "octopipe": {"plan": os.path.abspath(plan_path)}}
    with open(os.path.join(out_dir, "ds_config.json"), "w", encoding="utf-8") as fh:
        json.dump(ds_config, fh, indent=2)
    return ds_config


def build_rank(rank, world, port, ds_config, kinds, out_dir):
    """One pipeline rank: build the module from stand-in specs and record what it holds."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec

    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    specs = [LayerSpec(torch.nn.Linear, STAND_IN_WIDTH, STAND_IN_WIDTH) for _ in kinds]
    module = OctoPipePipelineModule(specs, parts=load_parts(ds_config, num_specs=len(specs)))
    built = sorted(int(name) for name, _ in module.named_children() if name.isdigit())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump({"built": built, "params": sum(p.numel() for p in module.parameters())}, fh)
    deepspeed.comm.barrier()


def build_all(ds_config, model, out_dir: str) -> list[dict]:
    """Spawn one process per pipeline rank; collect each rank's report."""
    import torch.multiprocessing as mp

    from octopipe_plugin.executor.launch import free_port

    world = len(load_parts(ds_config)) - 1
    kinds = [layer.kind for layer in model.layers]
    mp.spawn(build_rank, args=(world, free_port(), ds_config, kinds, out_dir), nprocs=world, join=True)
    reports = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as fh:
            reports.append(json.load(fh))
    return reports


def describe(model, lo: int, hi: int) -> str:
    """'a..b (n layers: kinds)' for a span of layers."""
    if lo == hi:
        return "(empty)"
    kinds = sorted({layer.kind for layer in model.layers[lo:hi]})
    return f"layers {lo}..{hi - 1} ({hi - lo}: {', '.join(kinds)})"


def main(argv=None) -> int:
    """Build or tune a plan, write it and its DeepSpeed config, print the partition (and build it)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        cluster = resolve_cluster(args.cluster)
        model = resolve_model(args.model, gpu=cost_gpu(cluster, args.gpu))
        plan = make_plan(args, model, cluster)
        out_dir = args.out or tempfile.mkdtemp(prefix="octopipe_ds_")
        ds_config = write_files(plan, out_dir)
        parts = load_parts(ds_config, num_specs=model.num_layers)
    except OctoPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sim = simulate(model, cluster, plan, detail=False)
    log.info("plan: %s, simulated step %.1f ms, bubble %.1f%%; files in %s", plan.meta.get("schedule", "?"),
             sim.step_time_ms, 100 * sim.bubble_ratio, out_dir)
    from deepspeed.runtime.utils import partition_uniform

    uniform = partition_uniform(model.num_layers, len(parts) - 1)
    print(f"parts {parts} (DeepSpeed's uniform split: {uniform})")
    # DeepSpeed's engine runs its own 1F1B TrainSchedule: compare the two partitions under it
    steps = [simulate(model, cluster, build_plan(model, "1f1b", cluster.num_devices, args.microbatches,
                                                 boundaries=b), detail=False).step_time_ms for b in (parts, uniform)]
    log.info("DeepSpeed's 1F1B, simulated: %.1f ms on these stages, %.1f ms on its uniform split", *steps)
    print(f"ds_config {json.dumps(ds_config)}")
    if args.build:
        for rank, rep in enumerate(build_all(ds_config, model, out_dir)):
            lo, hi = (rep["built"][0], rep["built"][-1] + 1) if rep["built"] else (parts[rank], parts[rank])
            print(f"rank {rank} built {describe(model, lo, hi)}, {rep['params']} stand-in parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
