"""DeepSpeed's own pipeline schedules against OctoPipe on the same model and data.

    python examples/deepspeed/benchmark.py --stand-in --model gemma3 --cluster h100x8 --microbatches 32
    python examples/deepspeed/benchmark.py --stand-in --model deepseek-v3-mini --cluster h100x8 --microbatches 32

Runs DeepSpeed's PipelineEngine (its 1F1B on its `parameters` partition), its DualPipeVEngine
(2 stages per rank, `parameters` partition) and OctoPipeEngine (a plan tuned for the model and
cluster, or --plan), one local process per device, and prints each one's simulated and measured
step time and samples/s, ending with `measured speedup X.XXx (simulated Y.YYx)` of OctoPipe
over the stock 1F1B engine. Unless --splits off, OctoPipeEngine also runs a plan with split
layers (--split-plan, or the split-aware tuner's on top of the plan without splits): the LM
head's rows over several ranks, its shard passes and hand-overs slept in each rank's
`SleepShards` (executor/standin.py, the dry run's stand-in; the engine's `shards=`), the owner's
stage ending in the hand-over to them; the last line is then
`measured split gain X.XXx (simulated Y.YYx)` (with splits over without).

--memory-levers: DeepSpeed's PipelineEngine with activation_checkpoint_interval=1 (its full recompute,
the stand-in forwards really re-run) against OctoPipeEngine on a plan with per-layer recompute where
memory binds (tuned with --recompute auto --offload none within the default 8% headroom; whole layers:
the stand-in list has no sub-modules), recomputed through the engine's own per-entry checkpoints;
the last line is `measured gain X.XXx (simulated Y.YYx)`.

--stand-in (the CPU mode): every layer of the model (zoo name or model file, any layer kinds)
becomes a SleepLayer (octopipe_plugin/testing/sleep_layer.py, the same layer and DeviceClock
timing rule as the Megatron benchmark and the dry run) that sleeps its F, I and W times scaled
so that the stock engine's simulated step lasts --target-ms; its parameter is sized in proportion to the real layer, so
DeepSpeed's `parameters` partition cuts where it would cut the real model. Transfers are not
charged (tiny tensors on one host), so the simulated column is the simulation without transfer
costs; the prediction with the cluster's links is printed too. With --clock wall nothing is
modelled but the compute: the activation is as wide as the model's bytes across a cut and
DeepSpeed's p2p moves it over gloo, every host delay counts, and the simulated column prices
transfers unscaled by the links of --links (this host's: the file
`octopipe cluster --measure --ranks N` wrote), else --cluster's.
Without --stand-in, real layers need GPUs and your own PipelineModule: build it with
`OctoPipePipelineModule(specs, config=ds_config)` under the deepspeed launcher (see README).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
import sys
import tempfile

import torch

from octopipe_plugin.testing.sleep_layer import add_standin_options, check_standin_scale


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3", help="zoo name or model/architecture file (default gemma3)")
    p.add_argument("--gpu", default=None, help="GPU of the analytic cost model (default: the cluster's, else H100)")
    p.add_argument("--cluster", default="h100x8", help="named cluster (<gpu>x<count>) or cluster file")
    p.add_argument("--microbatches", type=int, default=32, help="micro-batches per step (default 32)")
    p.add_argument("--stand-in", action="store_true", help="sleeping stand-in layers on local CPU processes")
    p.add_argument("--plan", help="an octopipe-plan/1 file to run instead of tuning one")
    p.add_argument("--tune-budget", type=float, default=30.0,
                   help="tuner time budget in seconds (default 30): the plan without splits takes it, and the split "
                        "search on top of it as much again")
    p.add_argument("--target-ms", type=float, default=8000.0,
                   help="stand-ins: the stock 1F1B engine's simulated step, scaled to this (default 8000)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per engine after one warm-up (default 2)")
    add_standin_options(p, clock_help="device: stand-ins on the simulator's timing rule, free transfers; wall: host "
                                      "delays count and activations of the model's bytes really travel "
                                      "(octopipe_plugin/executor/clock.py)")
    p.add_argument("--memory-levers", action="store_true",
                   help="DeepSpeed's PipelineEngine with a checkpoint on every layer (activation_checkpoint_interval=1, "
                        "its full recompute) against OctoPipeEngine on a plan with per-layer recompute where memory "
                        "binds (--recompute auto --offload none), both recomputing through their own checkpoints")
    return p.parse_args(argv)


def deepspeed_parts(model, num_stages: int, param_divisor: float) -> list[int]:
    """DeepSpeed's `parameters` partition of the stand-in layers (its own partition_balanced)."""
    from deepspeed.runtime.utils import partition_balanced

    from octopipe_plugin.testing.deepspeed_standin import standin_numel

    counts = [standin_numel(layer, param_divisor) for layer in model.layers]
    return [int(x) for x in partition_balanced(weights=counts, num_parts=num_stages)]


def stock_plan(model, cluster, m: int, param_divisor: float):
    """DeepSpeed's PipelineEngine: its 1F1B on its `parameters` partition."""
    from octopipe_plugin.schedules.registry import build_plan

    p = cluster.num_devices
    return build_plan(model, "1f1b", p, m, boundaries=deepspeed_parts(model, p, param_divisor))


def plans(args, model, cluster, param_divisor, options=None):
    """(label, plan) of the engines, for the simulator: DeepSpeed's two, OctoPipe's without splits and, unless
    --splits off, OctoPipe's with split layers (given, or tuned on top of the plan without; left out where the
    split-aware tuner keeps the plan without splits)."""
    from octopipe_plugin.errors import OctoPipeError
    from octopipe_plugin.formats import read_plan
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.constraints import Constraints, framework_splits
    from octopipe_plugin.tuner.split import tune_split

    p, m = cluster.num_devices, args.microbatches
    stock = stock_plan(model, cluster, m, param_divisor)
    if args.memory_levers:
        return memory_plans(args, model, cluster, stock, options)
    dualpipev = build_plan(model, "dualpipev", p, m, boundaries=deepspeed_parts(model, 2 * p, param_divisor))
    res = None
    if args.plan:
        ours = read_plan(args.plan, num_layers=model.num_layers)
    else:
        res = tune(model, cluster, m, time_budget_s=args.tune_budget, options=options)
        ours = res.plan
    out = {"stock": stock, "dualpipev": dualpipev, "octopipe": ours}
    if args.splits == "off":
        return out
    if args.split_plan:
        split = read_plan(args.split_plan, num_layers=model.num_layers)
        if not split.splits:
            raise OctoPipeError(f"{args.split_plan}: 'splits' is empty: expected a plan with split layers "
                                "(e.g. from `octopipe plan --splits auto`)")
    else:
        # DeepSpeed's runner reports the loss from the owner's own shard: the tuner keeps one there (owner_shard);
        # the stand-in shards sleep a split head only, so the embedding stays whole
        split = tune_split(model, cluster, m, time_budget_s=args.tune_budget, unsplit=res, options=options,
                           split_budget_s=args.tune_budget,
                           constraints=Constraints(**framework_splits("deepspeed-stand-in"))).plan
    if split.splits:
        out["octopipe-split"] = split
    return out


def memory_plans(args, model, cluster, stock, options=None):
    """--memory-levers: DeepSpeed's 1F1B with every layer recomputed, OctoPipe's plan with per-layer recompute."""
    from octopipe_plugin.errors import OctoPipeError
    from octopipe_plugin.formats import read_plan
    from octopipe_plugin.formats.memory import RECOMPUTE
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.memory_choices import MemoryLevers, full_recompute

    if args.plan:
        ours = read_plan(args.plan, num_layers=model.num_layers)
    else:
        ours = tune(model, cluster, args.microbatches, time_budget_s=args.tune_budget, options=options,
                    memory=MemoryLevers(recompute="auto", offload="none")).plan
    if ours.splits or ours.pairs or any(c.kind != RECOMPUTE for _, c in ours.memory):
        raise OctoPipeError(f"--memory-levers: {args.plan}: expected a plan whose memory choices recompute whole "
                            f"layers, without split layers or pairs (a stand-in layer has no sub-modules and no "
                            f"bytes to offload)")
    return {"stock-recompute": full_recompute(model, stock), "octopipe": ours}


def split_specs(specs, model, shards):
    """The stand-in list of a split plan's engine and its layer_of_spec: the owner's HeadHandOver as one more
    entry of the layer before the head (DeepSpeed builds the owner stage without the head's entry)."""
    from deepspeed.pipe import LayerSpec

    from octopipe_plugin.testing.sleep_layer import HeadHandOver

    n = model.num_layers
    return (list(specs[:-1]) + [LayerSpec(HeadHandOver, shards), specs[-1]],
            list(range(n - 1)) + [n - 2, n - 1])


def _worker(rank, world, port, model_doc, plan_doc, split_doc, shard_costs, scale, divisor, m, steps, clock_mode,
            width, out_dir, memory_levers=False):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    import octopipe_plugin.deepspeed  # noqa: F401  (deepspeed.initialize builds OctoPipeEngine for a planned module)
    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule
    from octopipe_plugin.testing.deepspeed_standin import standin_loss, standin_specs, timed_train_batches
    from octopipe_plugin.executor.clock import DeviceClock
    from octopipe_plugin.executor.interface import TensorMeta
    from octopipe_plugin.executor.standin import SleepShards
    from octopipe_plugin.formats import model_from_dict, plan_from_dict

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = model_from_dict(model_doc)
    clock = DeviceClock(clock_mode)  # the rank's modelled device, shared by all its stand-in layers and shards
    specs = standin_specs(model, scale, divisor, clock)
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": m, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "gradient_clipping": 0.0}
    builders = {} if memory_levers else {
        "stock": lambda: PipelineModule(specs, num_stages=world, partition_method="parameters", loss_fn=standin_loss),
        "dualpipev": lambda: DualPipeVModule(specs, num_stages=world, partition_method="parameters",
                                             loss_fn=standin_loss),
    }
    if memory_levers:  # DeepSpeed's own full recompute: its checkpoint around every list entry, the forward re-run
        builders["stock-recompute"] = lambda: PipelineModule(specs, num_stages=world, partition_method="parameters",
                                                             loss_fn=standin_loss, activation_checkpoint_interval=1)
    # the plan's memory choices: OctoPipeEngine's own per-entry checkpoints (adapters/deepspeed/memory.py)
    builders["octopipe"] = lambda: OctoPipePipelineModule(specs, plan=plan_from_dict(plan_doc), loss_fn=standin_loss)
    if split_doc is not None:
        # the shard passes on the rank's clock; hand-overs of the activation's shape ([micro-batch, width]); the
        # owner hands on (hidden, None, None): the head input is declared as that one payload
        shards = SleepShards(shards=shard_costs, rank=rank, device=clock, num_devices=world,
                             hand_over=TensorMeta(shape=(1, width), dtype=torch.float64, requires_grad=False))
        entries, layer_of_spec = split_specs(specs, model, shards)
        builders["octopipe-split"] = lambda: OctoPipePipelineModule(
            entries, plan=plan_from_dict(split_doc), loss_fn=standin_loss, layer_of_spec=layer_of_spec,
            shards=shards)
    times = {}
    for name, build in builders.items():
        module = build()
        engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=list(module.parameters()))
        times[name] = {"engine": type(engine).__name__, "spans": timed_train_batches(engine, clock, m, steps, width)}
        del engine, module
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(times, fh)
    deepspeed.comm.barrier()


def main(argv=None) -> int:
    """Run the three engines and print the comparison."""
    args = parse_args(argv)
    if not args.stand_in:
        print("real layers need GPUs and your own PipelineModule; on CPU run with --stand-in", file=sys.stderr)
        return 2
    from octopipe_plugin.costs import cost_gpu, resolve_cluster, resolve_model
    from octopipe_plugin.errors import OctoPipeError
    from octopipe_plugin.executor.dryrun import host_links, scaled_costs, scaled_model, zero_cost_cluster
    from octopipe_plugin.executor.launch import free_port
    from octopipe_plugin.executor.standin import split_numel, standin_shards
    from octopipe_plugin.formats import model_to_dict, plan_to_dict
    from octopipe_plugin.simulator import simulate
    from octopipe_plugin.testing.deepspeed_standin import standin_width
    from octopipe_plugin.testing.sleep_layer import standin_sim_options

    from octopipe_plugin.testing.deepspeed_standin import whole_layer_model

    cluster = resolve_cluster(args.cluster)
    model = resolve_model(args.model, gpu=cost_gpu(cluster, args.gpu))
    if args.memory_levers:  # where memory decides what runs: the plans fit what `octopipe plan` keeps usable
        from octopipe_plugin.headroom import DEFAULT, parse_headroom, with_headroom

        cluster = with_headroom(cluster, parse_headroom(DEFAULT))
        model = whole_layer_model(model)
    divisor = max(1.0, sum(layer.state_bytes for layer in model.layers) / 18 / 2e6)  # ~2M stand-in parameters
    free = zero_cost_cluster(cluster.num_devices)
    base = stock_plan(model, cluster, args.microbatches, divisor)
    if args.memory_levers:
        from octopipe_plugin.tuner.memory_choices import full_recompute

        base = full_recompute(model, base)
    scale = args.target_ms / simulate(model, free, base, detail=False).step_time_ms
    # this host's per-message costs at the run's ranks per core, in the model's milliseconds (the stand-ins sleep
    # `scale` times those; the host's own costs are not scaled): a split head's fan-out is priced (issue 36)
    host = standin_sim_options(args, cluster.num_devices)
    options = replace(host, overheads=host.overheads.scaled(1.0 / scale)) if host.overheads else host
    try:
        chosen = plans(args, model, cluster, divisor, options)
    except OctoPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    split = chosen.get("octopipe-split")
    stock = "stock-recompute" if args.memory_levers else "stock"
    # The stand-ins pass tiny tensors on one host: links cost nothing there, so the figure to compare the
    # measurement with is the simulation without transfer costs; the cluster's own is printed beside it.
    sim = {k: simulate(model, free, p, options, detail=False).step_time_ms for k, p in chosen.items()}
    linked = {k: simulate(model, cluster, p, detail=False).step_time_ms for k, p in chosen.items()}
    scaled = {k: v * scale for k, v in sim.items()}
    if args.clock == "wall":  # compute scaled, the model's bytes over this host's links as they are
        wire = host_links(cluster, resolve_cluster(args.links) if args.links else None)
        scaled = {k: simulate(scaled_model(model, scale) if p.splits or p.memory else None, wire, p, host,
                              costs=scaled_costs(model, p, scale), detail=False).step_time_ms
                  for k, p in chosen.items()}
    if check_standin_scale(args, [(k, p, scaled[k]) for k, p in chosen.items()]):
        return 2
    world = cluster.num_devices
    print(f"model {model.name} ({model.num_layers} layers), cluster {args.cluster} ({world} devices), "
          f"{args.microbatches} micro-batches; stand-in time scale {scale:.4g} (sleeping layers on {world} local "
          f"processes, gloo, {args.clock} clock), load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    if split is not None:
        print(f"OctoPipe with splits: {split.num_stages} stages, " + ", ".join(
            f"layer {sp.layer} over {len(sp.devices)} ranks (shares {min(sp.shares):.3f}-{max(sp.shares):.3f})"
            for sp in split.splits), flush=True)
    elif args.splits == "auto" and not args.memory_levers:
        print("OctoPipe with splits: none (the split-aware tuner kept the plan without splits)", flush=True)
    if args.memory_levers:
        ours = chosen["octopipe"]
        peaks = {k: max(simulate(model, cluster, p, detail=False).peak_memory_bytes) / 2**30 for k, p in chosen.items()}
        from octopipe_plugin.formats.memory import describe_choices

        print(f"OctoPipe: {ours.num_stages} stages, {describe_choices(ours.memory) or 'no memory choices'}; "
              f"simulated peak memory: DeepSpeed "
              f"{peaks['stock-recompute']:.1f} GiB, OctoPipe {peaks['octopipe']:.1f} GiB of "
              f"{cluster.usable_memory_bytes / 2**30:.1f} GiB usable", flush=True)
    import torch.multiprocessing as mp

    # a split head's hand-over is one summable stamp with a slot per rank: the activation is at least that wide
    width = max(standin_width(args.clock, model), split_numel(world) if split is not None else 0)
    # the shards sleep on the stand-ins' clock: free transfers as the stages' (the wall clock waits for none)
    shard_costs = standin_shards(scaled_model(model, scale), split, free) if split is not None else ()
    with tempfile.TemporaryDirectory(prefix="octopipe-ds-bench-") as out:
        mp.spawn(_worker, args=(world, free_port(), model_to_dict(model), plan_to_dict(chosen["octopipe"]),
                                plan_to_dict(split) if split is not None else None, shard_costs, scale, divisor,
                                args.microbatches, args.steps, args.clock, width, out, args.memory_levers),
                 nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    labels = {"stock-recompute": "DeepSpeed PipelineEngine (1F1B, checkpoint every layer)"} if args.memory_levers \
        else {"stock": "DeepSpeed PipelineEngine (1F1B, parameters partition)",
              "dualpipev": "DeepSpeed DualPipeVEngine (parameters partition)"}
    labels["octopipe"] = f"OctoPipeEngine ({chosen['octopipe'].num_stages} stages, tuned plan)"
    if split is not None:
        labels["octopipe-split"] = f"OctoPipeEngine with splits ({split.num_stages} stages, split head)"
    measured = {}
    print(f"{'engine':58s} {'simulated ms':>13s} {'measured ms':>12s} {'samples/s':>10s}")
    for key, label in labels.items():
        # a step ends when its slowest rank returns; each timed step's max over ranks, then their mean
        steps = zip(*(r[key]["spans"] for r in ranks))
        measured[key] = sum(max(s) for s in steps) / args.steps * 1000.0
        print(f"{label:58s} {scaled[key]:13.1f} {measured[key]:12.1f} "
              f"{args.microbatches / measured[key] * 1000.0:10.2f}")
    print(f"with {args.cluster}'s links the simulator predicts {linked[stock]:.1f} ms vs {linked['octopipe']:.1f} ms "
          f"unscaled ({linked[stock] / linked['octopipe']:.2f}x)")
    if args.memory_levers:  # against DeepSpeed's own full recompute
        print(f"measured gain {measured[stock] / measured['octopipe']:.2f}x "
              f"(simulated {scaled[stock] / scaled['octopipe']:.2f}x)")
        return 0
    print(f"measured speedup {measured['stock'] / measured['octopipe']:.2f}x "
          f"(simulated {scaled['stock'] / scaled['octopipe']:.2f}x)")
    if split is not None:
        print(f"measured split gain {measured['octopipe'] / measured['octopipe-split']:.2f}x "
              f"(simulated {scaled['octopipe'] / scaled['octopipe-split']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
