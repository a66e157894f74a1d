"""Megatron's own interleaved 1F1B against OctoPipe on the same model and data: measured step time and tokens/s.

    python examples/megatron/benchmark.py --stand-in --model nemotron-h --cluster h100x8 --microbatches 32
    python examples/megatron/benchmark.py --stand-in --model my-model.json --plan plan.json
    python examples/megatron/benchmark.py --stand-in --model gemma3 --cluster h100x16 --split-plan split.json

With --stand-in (CPU), every layer of the model (a zoo name, an architecture file or any
octopipe-model/1 file) becomes a stand-in layer that sleeps its scaled F, I and W time inside
real Megatron model chunks (`MegatronModule`s, octopipe_plugin.testing.megatron_standin), and
a boundary is not used before its producer's end plus the transfer time of the bytes the real
model sends there. One local process per pipeline rank over gloo runs, on the same chunks and
data, first Megatron's schedule code (`get_forward_backward_func()` of megatron.core: its
interleaved 1F1B on Megatron's even split at its best virtual-stage count) and then OctoPipe's
(the tuned or given plan: its stages, stage->rank map and per-rank F/B/I/W order, through
`make_forward_backward_func`, the schedule `--pipeline-schedule octopipe` swaps into Megatron). Both are timed from a common start instant; the simulator's
predictions for both plans at the same scale give the simulated speedup. Unless --splits off,
a third run is OctoPipe with split layers (--split-plan, or the split-aware tuner's plan on top of
the plan without splits): the LM head's rows divided over several ranks, whose shard passes
(H, J, K) and their hand-overs sleep their modelled costs in the rank's `SleepShards` (the dry
run's stand-in, executor/standin.py), the owner chunk ending in the hand-over to them; Megatron's
runner (`MegatronStages(shards=)`) runs the owner's F and backward. With --clock wall
nothing is modelled but the compute: the boundaries are as large as the model's bytes across a
cut and Megatron's and OctoPipe's p2p move them over gloo, every host delay counts, and the
prediction prices transfers unscaled by the links of --links (this host's: the file
`octopipe cluster --measure --ranks N` wrote), else --cluster's. The last line is

    measured speedup X.XXx (simulated Y.YYx)
    measured split gain X.XXx (simulated Y.YYx)      (OctoPipe with splits over without; unless --splits off)

Two modes compare against what a user of the case runs instead (both print `measured gain X.XXx
(simulated Y.YYx)` last, the plans kept within the default 8% memory headroom):

    python examples/megatron/benchmark.py --stand-in --moe-overlap --model moe.json --cluster h100x16
    python examples/megatron/benchmark.py --stand-in --memory-levers --model long.json --cluster h100x16

--moe-overlap (a model file whose MoE layers carry their all-to-all phases: `octopipe model NAME --ep 8
-o moe.json`): Megatron's combined 1F1B under --overlap-moe-expert-parallel-comm (its interleaved
schedule's combined path, v >= 2) against OctoPipe's plan with overlapped pairs, tuned as a launch's
(B only, as many chunks on every rank, two or more); both run megatron-core's combined step
(`combined_forward_backward_step`) on the stand-in chunks' schedule plans, a pair sleeping its two
sides' phases overlapped (testing/megatron_standin.py, executor/standin.py PairSleeper).
--memory-levers: Megatron's interleaved 1F1B with every layer recomputed against OctoPipe's plan with
per-layer recompute where memory binds (--recompute auto --offload none: the stand-in chunks sleep a
recomputed forward before their backward but hold no bytes to offload).

Real layers on GPUs: launch your pretrain script twice with examples/megatron/launch.py
(`--pipeline-schedule default`, then `octopipe`) and compare Megatron's logged iteration times;
this script's own real-layer mode is not built yet (it needs GPUs to be checked).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from octopipe_plugin.testing.megatron_standin import BOUNDARY_SHAPE, DTYPE, StandInStage, boundary_shape
from octopipe_plugin.testing.sleep_layer import add_standin_options, check_standin_scale, standin_sim_options
from octopipe_plugin.costs import cost_gpu, resolve_cluster, resolve_model
from octopipe_plugin.errors import OctoPipeError
from octopipe_plugin.executor.dryrun import host_links, scaled_cluster, scaled_costs, scaled_model
from octopipe_plugin.executor.launch import init_gloo, spawn
from octopipe_plugin.executor.standin import split_numel, standin_costs, standin_shards
from octopipe_plugin.formats import plan_from_dict, plan_to_dict, read_plan
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate

log = logging.getLogger("benchmark")


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="nemotron-h", help="zoo name, architecture file or octopipe-model/1 file")
    p.add_argument("--cluster", default="h100x8", help="named cluster (<gpu>x<count>) or cluster file")
    p.add_argument("--gpu", default=None, help="GPU of the analytic cost model (default: the cluster's)")
    p.add_argument("--microbatches", type=int, default=32, help="micro-batches per step (default 32)")
    p.add_argument("--stand-in", action="store_true", help="CPU: sleeping stand-in layers in real Megatron chunks")
    p.add_argument("--plan", help="OctoPipe plan to run (default: tune one)")
    p.add_argument("--tune-seconds", type=float, default=20.0,
                   help="tuning budget in seconds when no --plan (default 20): the plan without splits takes it, "
                        "and the split search on top of it as much again")
    p.add_argument("--seed", type=int, default=0, help="tuner seed")
    p.add_argument("--megatron-vp", type=int, default=None,
                   help="Megatron's virtual stages per rank (default: its fastest in simulation)")
    p.add_argument("--target-ms", type=float, default=3000.0,
                   help="scale costs so Megatron's simulated step lasts this long (default 3000)")
    add_standin_options(p, clock_help="device: stand-ins on the simulator's timing rule, transfers stamped from the "
                                      "model; wall: host delays count and boundaries of the model's bytes really "
                                      "travel (executor/clock.py)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-wait timeout in seconds")
    p.add_argument("--per-rank", action="store_true",
                   help="also print each rank's busy and waiting time per run, measured beside simulated")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--moe-overlap", action="store_true",
                      help="MoE (a model whose layers carry all-to-all phases: `octopipe model NAME --ep N`): "
                           "Megatron's combined 1F1B under --overlap-moe-expert-parallel-comm against OctoPipe's plan "
                           "with overlapped pairs, both through megatron-core's combined step")
    mode.add_argument("--memory-levers", action="store_true",
                      help="Megatron's interleaved 1F1B with full recompute against OctoPipe's plan with per-layer "
                           "recompute where memory binds (--recompute auto --offload none)")
    return p.parse_args(argv)


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One schedule's plan and the stand-in chunks of each of its stages."""

    label: str
    plan_doc: dict
    stages: tuple[StandInStage, ...]
    shards: tuple = ()  # the split layers' ShardCosts (executor/standin.py), slept by the rank's SleepShards
    overlap: bool = False  # --overlap-moe-expert-parallel-comm: F and B through megatron-core's combined step


def megatron_plan(model, cluster, microbatches: int, vp: int | None, schedule: str = "interleaved-1f1b",
                  dress=lambda plan: plan):
    """Megatron's `schedule` on its even split: the given virtual stage count, else its fastest one that fits
    (each candidate `dress`ed first: full recompute for the memory case). The combined 1F1B at PP > 1 needs a
    virtual pipeline size (megatron-core's TransformerConfig check): v >= 2 there."""
    p = cluster.num_devices
    low = 2 if schedule == "combined-1f1b" and p > 1 else 1
    options = [vp] if vp else [v for v in (1, 2, 3, 4) if v >= low and p * v <= model.num_layers]
    best = fits = None
    for v in options:
        try:
            plan = dress(build_plan(model, schedule, p, microbatches, stages_per_device=v, split="megatron"))
        except OctoPipeError:
            continue
        res = simulate(model, cluster, plan, detail=False)
        ok = max(res.peak_memory_bytes) <= cluster.usable_memory_bytes
        key = (not ok, res.step_time_ms)  # the fastest that fits, else the fastest
        if best is None or key < best[0]:
            best, fits = (key, plan), ok
    if best is None:
        raise OctoPipeError(f"Megatron's {schedule} cannot split {model.name!r} over {p} ranks")
    if not fits:
        log.warning("megatron: no virtual stage count of %s fits %s's memory; running the fastest", schedule,
                    model.name)
    return best[1]


def octopipe_plans(model, cluster, args, options=None):
    """(the plan without splits, the plan with splits or None): given files, else tuned now (`tune`, then
    `tune_split` on top of it); None also where the split-aware tuner keeps the plan without splits."""
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.constraints import Constraints, framework_splits
    from octopipe_plugin.tuner.split import tune_split

    res = None
    if args.plan:
        plain = read_plan(args.plan, model.num_layers)
    else:
        res = tune(model, cluster, args.microbatches, time_budget_s=args.tune_seconds, seed=args.seed, options=options)
        plain = res.plan
    if plain.splits:
        raise OctoPipeError(f"{args.plan}: the plan without splits has split layers; give it with --split-plan")
    if args.splits == "off":
        return plain, None
    if args.split_plan:
        split = read_plan(args.split_plan, model.num_layers)
        if not split.splits:
            raise OctoPipeError(f"{args.split_plan}: 'splits' is empty: expected a plan with split layers "
                                "(e.g. from `octopipe plan --splits auto`)")
        return plain, split
    # Megatron's runner reports the loss from the owner's own shard: the tuner keeps one there (owner_shard)
    split = tune_split(model, cluster, args.microbatches, time_budget_s=args.tune_seconds, seed=args.seed,
                       unsplit=res, split_budget_s=args.tune_seconds, options=options,
                       constraints=Constraints(**framework_splits("megatron-stand-in"))).plan
    return plain, split if split.splits else None


def moe_plans(model, cluster, args, options=None):
    """--moe-overlap: (the model both plans are priced on, Megatron's combined 1F1B, OctoPipe's plan with pairs).

    Both run megatron-core's combined step, which runs each backward whole: the model is the launch's tuning model
    (adapters/megatron/pairs.tuning_model: I + W as one B) and the plan the one the launch runs (runnable_plan)."""
    import types

    from octopipe_plugin.adapters.megatron.pairs import (PairSupport, overlap_problem, runnable_plan, tuning_model,
                                                         virtual_stage_problem)
    from octopipe_plugin.adapters.megatron.startup import run_constraints
    from octopipe_plugin.simulator.pairs import communicates
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.constraints import Constraints

    if not communicates(model):
        raise OctoPipeError(f"--moe-overlap: {args.model}: no layer has an all-to-all phase; expected a MoE model with "
                            f"expert parallelism (e.g. `octopipe model deepseek-v3-mini --ep 8 -o moe.json`, then "
                            f"--model moe.json)")
    support = PairSupport(runs=True, why="the stand-in runs set --overlap-moe-expert-parallel-comm")
    launch = types.SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    tmodel = tuning_model(model, support, launch)
    base = megatron_plan(tmodel, cluster, args.microbatches, args.megatron_vp, "combined-1f1b")
    if args.plan:
        plan = read_plan(args.plan, model.num_layers)
    else:  # what a launch's start-up asks of the plan (as many chunks on every rank), each backward whole, and
        # at PP > 1 two chunks or more per rank (the flag's virtual pipeline size: pairs.virtual_stage_problem)
        cons, _ = run_constraints(launch, Constraints(split_backward=False, min_stages_per_device=2
                                                      if cluster.num_devices > 1 else None))
        plan = tune(tmodel, cluster, args.microbatches, time_budget_s=args.tune_seconds, seed=args.seed,
                    options=options, constraints=cons).plan
    plan = runnable_plan(plan, support, launch)
    problems = [overlap_problem(plan, rank, plan.memory or None) for rank in range(plan.num_devices)]
    problems.append(virtual_stage_problem(plan, plan.num_devices))
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise OctoPipeError(f"--moe-overlap: {args.plan or 'the tuned plan'}: {problem}")
    return tmodel, base, plan


def memory_plans(model, cluster, args, options=None):
    """--memory-levers: (Megatron's interleaved 1F1B with every layer recomputed, OctoPipe's plan with per-layer
    recompute where memory binds). Offload is not among the levers here: the stand-in chunks sleep a recompute
    inside their backward but hold no bytes to copy (the dry run's stand-ins do: executor/standin_memory.py)."""
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.memory_choices import MemoryLevers, full_recompute

    base = megatron_plan(model, cluster, args.microbatches, args.megatron_vp,
                         dress=lambda plan: full_recompute(model, plan))
    if args.plan:
        plan = read_plan(args.plan, model.num_layers)
    else:
        plan = tune(model, cluster, args.microbatches, time_budget_s=args.tune_seconds, seed=args.seed,
                    options=options, memory=MemoryLevers(recompute="auto", offload="none")).plan
    if plan.splits or plan.pairs:
        raise OctoPipeError(f"--memory-levers: {args.plan}: the plan has split layers or pairs; expected a plan with "
                            f"memory choices only")
    if any(c.kind not in ("recompute", "selective") for _, c in plan.memory):
        raise OctoPipeError(f"--memory-levers: {args.plan}: plan.memory offloads; the stand-in chunks sleep "
                            f"recompute only (fix: a plan tuned with --offload none)")
    return base, plan


def stand_in_stages(model, plan, scale: float, fast_cluster, boundary=BOUNDARY_SHAPE) -> tuple[StandInStage, ...]:
    """Per-stage stand-in layers (scaled per-layer F/I/W), the scaled transfer time of each cut, the boundary.

    A split layer is not in its owner stage (its shards sleep its work); the owner of a split head ends in
    the hand-over to its shards (megatron_standin.StandInStage.split_head). Under a plan with pairs each stage
    carries its F's and fused B's phases (what a pair sleeps overlapped); under memory choices the stage's
    recomputed forwards (simulator/costs.memory_costs, extra_ms) are slept in its first backward layer, before
    its I: what recompute costs, where the simulator charges it."""
    from octopipe_plugin.actions import Kind
    from octopipe_plugin.simulator.pairs import stage_phases

    sc = scaled_costs(model, plan, scale)
    hops = standin_costs(sc, [st.device for st in plan.stages], fast_cluster).hop
    last = plan.num_stages - 1
    split = {sp.layer for sp in plan.splits}
    phases = stage_phases(scaled_model(model, scale), plan.stages) if plan.pairs else None
    extra = [0.0] * plan.num_stages
    if plan.memory:
        from octopipe_plugin.simulator.costs import memory_costs

        extra = list(memory_costs(scaled_model(model, scale), plan, fast_cluster).extra_ms)

    def layers(s, st):
        out = [[layer.fwd_ms * scale, layer.bwd_ms * scale, layer.wgrad_ms * scale]
               for i, layer in enumerate(model.layers[st.start:st.end], st.start) if i not in split]
        if out and extra[s]:
            out[-1][1] += extra[s]
        return tuple(tuple(x) for x in out)

    return tuple(
        StandInStage(stage=s, layers=layers(s, st),
                     hop_in_ms=hops[s - 1] if s > 0 else 0.0, hop_out_ms=hops[s] if s < last else 0.0,
                     first=s == 0, last=s == last, boundary=boundary,
                     split_head=s == last and model.num_layers - 1 in split,
                     phases_f=phases.of(Kind.F, s) if phases else (), phases_b=phases.of(Kind.B, s) if phases else ())
        for s, st in enumerate(plan.stages))


def simulated_ms(model, plan, scale: float, fast_cluster, options=None) -> float:
    """The simulator's step time of `plan` at the stand-ins' scale (a split plan's shards, a pair's phases and the
    memory choices' costs from the scaled model), the host's overheads (`options`) unscaled: they are this host's
    own."""
    whole = plan.splits or plan.pairs or plan.memory
    return simulate(scaled_model(model, scale) if whole else None, fast_cluster, plan, options,
                    costs=scaled_costs(model, plan, scale), detail=False).step_time_ms


def measure(runs: list[Run], microbatches: int, clock: str, timeout_s: float):
    """Run every schedule on local processes: (measured step ms per label, per label each rank's busy ms: the
    modelled work its device clock slept, stand-in layers, pairs and shard passes)."""
    world = plan_from_dict(runs[0].plan_doc).num_devices
    with tempfile.TemporaryDirectory(prefix="octopipe-megatron-bench-") as out:
        spawn(_worker, world, runs, microbatches, clock, timeout_s, runs[0].stages[0].boundary[2], out)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"), encoding="utf-8")) for r in range(world)]
    steps = {run.label: 1000.0 * (max(r[run.label]["end"] for r in ranks) - ranks[0][run.label]["start"])
             for run in runs}
    return steps, {run.label: [1000.0 * r[run.label]["busy"] for r in ranks] for run in runs}


def _worker(rank: int, world: int, port: int, runs: list[Run], microbatches: int, clock: str, timeout_s: float,
            hidden: int, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_shims

    if not torch.cuda.is_available():
        cpu_shims.install()
    from octopipe_plugin.adapters.megatron.compat import allow_megatron_training_import

    allow_megatron_training_import()
    init_gloo(rank, world, port, timeout_s)
    times = {}
    for run in runs:
        step = _megatron_step if run.label == "megatron" else _octopipe_step
        *prepared, pairs = step(rank, world, run, microbatches, timeout_s, hidden)
        times[run.label] = _timed(prepared, clock)
        pairs.close()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(times, fh)
    dist.destroy_process_group()


def _timed(prepared, clock: str) -> dict:
    """A warm-up step without sleeping (opens every gloo pair), then the timed step from a common instant."""
    step, device_clock = prepared
    device_clock.mode = "off"
    step()
    dist.barrier()
    start = torch.tensor([time.time() + 0.5], dtype=torch.float64)
    dist.broadcast(start, src=0)
    t0 = float(start[0])
    device_clock.mode = clock
    time.sleep(max(0.0, t0 - time.time()))
    device_clock.start(t0)
    step()
    end = time.time()
    return {"start": t0, "end": end, "busy": device_clock.busy_s}


def _chunks(rank: int, world: int, run: Run, config, device_clock, shards=None, pairs=None):
    from octopipe_plugin.testing.megatron_standin import standin_chunk_class

    plan = plan_from_dict(run.plan_doc)
    chunk = standin_chunk_class()
    return plan, {s: chunk(config, run.stages[s], device_clock, shards, pairs) for s in plan.stages_of(rank)}


def _sleep_shards(rank: int, world: int, run: Run, device_clock, hidden: int):
    """The rank's SleepShards of a split plan (None without splits): the shard passes on the rank's clock,
    hand-overs of the boundary's shape (what the owner chunk's HeadHandOver makes and its backward reads)."""
    if not run.shards:
        return None
    from octopipe_plugin.executor.interface import TensorMeta
    from octopipe_plugin.executor.standin import SleepShards

    meta = TensorMeta(shape=BOUNDARY_SHAPE[:2] + (hidden,), dtype=DTYPE, requires_grad=False)
    return SleepShards(shards=run.shards, rank=rank, device=device_clock, num_devices=world, hand_over=meta,
                       learn_head_input=True)


def _config(world: int, vp: int | None, hidden: int, overlap: bool = False):
    from megatron.core.transformer import TransformerConfig

    # Megatron's p2p sizes every boundary (seq_length, micro_batch_size, hidden_size): the stand-ins' boundary
    config = TransformerConfig(num_layers=world * (vp or 1), hidden_size=hidden, num_attention_heads=1,
                               pipeline_dtype=DTYPE, params_dtype=DTYPE, pipeline_model_parallel_size=world,
                               virtual_pipeline_model_parallel_size=vp, deallocate_pipeline_outputs=False,
                               # Megatron's batched p2p gives wrong results on gloo (notes/megatron-contract.md)
                               batch_p2p_comm=False)
    # set after the checks: the flag's own (expert parallelism, the alltoall dispatcher, bf16) ask for experts the
    # stand-ins do not have; here it only selects megatron-core's combined step, as in a launch that passes them
    config.overlap_moe_expert_parallel_comm = overlap
    return config


def _megatron_step(rank: int, world: int, run: Run, microbatches: int, timeout_s: float, hidden: int):
    """Megatron's own schedule (megatron.core.pipeline_parallel.get_forward_backward_func) on stand-in chunks."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from octopipe_plugin.testing.megatron_standin import standin_forward_step
    from octopipe_plugin.executor.clock import DeviceClock

    from octopipe_plugin.executor.standin import PairSleeper

    plan = plan_from_dict(run.plan_doc)
    vp = plan.num_stages // world
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world,
                                             virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    device_clock, pairs = DeviceClock("off"), PairSleeper(rank)
    _, chunks = _chunks(rank, world, run, _config(world, vp if vp > 1 else None, hidden, run.overlap), device_clock,
                        pairs=pairs)
    model = [chunks[s] for s in sorted(chunks)]  # stage r + v*P is virtual stage v of rank r
    for v, m in enumerate(model):
        m.vp_stage = v
    forward_backward = get_forward_backward_func()

    def step():
        data = [itertools.count() for _ in model]  # each chunk reads micro-batch numbers, in order
        forward_backward(forward_step_func=standin_forward_step, data_iterator=data if vp > 1 else data[0],
                         model=model if vp > 1 else model[0], num_microbatches=microbatches,
                         seq_length=BOUNDARY_SHAPE[0], micro_batch_size=BOUNDARY_SHAPE[1], forward_only=False)

    return step, device_clock, pairs


def _octopipe_step(rank: int, world: int, run: Run, microbatches: int, timeout_s: float, hidden: int):
    """OctoPipe's forward_backward_func (what --pipeline-schedule octopipe runs) on the same kind of chunks."""
    from octopipe_plugin.adapters.megatron.schedule import ScheduleOptions, make_forward_backward_func
    from octopipe_plugin.testing.megatron_standin import standin_forward_step
    from octopipe_plugin.executor.clock import DeviceClock

    from octopipe_plugin.executor.standin import PairSleeper

    device_clock, pairs = DeviceClock("off"), PairSleeper(rank)
    shards = _sleep_shards(rank, world, run, device_clock, hidden)
    plan, chunks = _chunks(rank, world, run, _config(world, None, hidden, run.overlap), device_clock, shards, pairs)
    model = [chunks[s] for s in plan.stages_of(rank)]  # the rank's chunks in model order = its vp stages
    for v, m in enumerate(model):
        m.vp_stage = v
    options = ScheduleOptions(timeout_s=timeout_s)

    def rank_shards(*, rank, model, config, report, **_):
        """make_forward_backward_func's shards factory: the rank's SleepShards, reporting through the owner's
        loss report (Megatron's loss dict of the micro-batch, from the stand-in forward step's loss_func)."""
        shards.report = report
        return shards

    forward_backward = make_forward_backward_func(plan, options=options,
                                                  shards=rank_shards if shards is not None else None)

    def step():
        data = [itertools.count() for _ in model]  # the first and the last stage read micro-batch numbers
        forward_backward(forward_step_func=standin_forward_step, data_iterator=data, model=model,
                         num_microbatches=microbatches, seq_length=BOUNDARY_SHAPE[0],
                         micro_batch_size=BOUNDARY_SHAPE[1], forward_only=False)

    return step, device_clock, pairs


LABELS = {"megatron": "megatron", "octopipe": "octopipe", "octopipe-split": "octopipe with splits"}


def main(argv=None) -> int:
    """Plan every schedule, run them on stand-ins, print measured and simulated figures."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if not args.stand_in:
        print("error: only --stand-in runs here (real layers need GPUs: see this script's docstring)",
              file=sys.stderr)
        return 2
    try:
        cluster = resolve_cluster(args.cluster)
        links = resolve_cluster(args.links) if args.links else None
        model = resolve_model(args.model, gpu=cost_gpu(cluster, args.gpu))
        # tuned and predicted with this host's per-message costs at the run's ranks per core (a split head's
        # statistics fan-out is most of a shard rank's messages: issue 36)
        options = standin_sim_options(args, cluster.num_devices)
        mode = "moe" if args.moe_overlap else "memory" if args.memory_levers else None
        if mode is not None:  # where memory decides what runs: the plans fit what `octopipe plan` keeps usable
            from octopipe_plugin.headroom import DEFAULT, parse_headroom, with_headroom

            cluster = with_headroom(cluster, parse_headroom(DEFAULT))
        if mode is not None and args.split_plan:
            raise OctoPipeError(f"--{'moe-overlap' if mode == 'moe' else 'memory-levers'} runs plans without split "
                                f"layers (megatron-core's combined step runs none; the memory case compares "
                                f"recompute); drop --split-plan")
        split = None
        if mode == "moe":
            model, base, ours = moe_plans(model, cluster, args, options)
        elif mode == "memory":
            base, ours = memory_plans(model, cluster, args, options)
        else:
            base = megatron_plan(model, cluster, args.microbatches, args.megatron_vp)
            ours, split = octopipe_plans(model, cluster, args, options)
    except OctoPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scale = args.target_ms / simulate(model, cluster, base, detail=False).step_time_ms
    # wall clock: the model's bytes travel over this host's links, so transfers keep the cluster's own times
    fast = host_links(cluster, links) if args.clock == "wall" else scaled_cluster(cluster, scale)
    plans = {"megatron": base, "octopipe": ours, **({"octopipe-split": split} if split is not None else {})}
    # a split head's hand-over is one summable stamp with a slot per rank: every boundary is at least that wide
    shape = boundary_shape(args.clock, model, split_numel(cluster.num_devices) if split is not None else 0)
    # the plans' memory choices are slept in the stand-in stages (stand_in_stages), not applied to the chunks: they
    # hold no Megatron layers to checkpoint (adapters/megatron/memory.py runs them in GPTModel chunks)
    runs = [Run(label=label, plan_doc=plan_to_dict(replace(plan, memory=())),
                stages=stand_in_stages(model, plan, scale, fast, shape),
                shards=standin_shards(scaled_model(model, scale), plan, fast) if plan.splits else (),
                overlap=mode == "moe")
            for label, plan in plans.items()]
    sim = {label: simulated_ms(model, plan, scale, fast, options) for label, plan in plans.items()}
    if check_standin_scale(args, [(label, plan, sim[label]) for label, plan in plans.items()]):
        return 2
    print(f"model {model.name}: {model.num_layers} layers, cluster {args.cluster}, {args.microbatches} micro-batches, "
          f"costs x{scale:.3g} (stand-ins, {args.clock} clock), load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    what = {"moe": "combined 1F1B under --overlap-moe-expert-parallel-comm",
            "memory": "interleaved 1F1B with full recompute (every layer)"}.get(mode, "interleaved 1F1B")
    print(f"megatron: {what}, {base.num_stages // base.num_devices} virtual stages per rank, even split"
          + (f", {len(base.pairs)} overlapped pairs" if mode == "moe" else ""))
    print(f"octopipe: {ours.num_stages} stages, stage->rank {[st.device for st in ours.stages]}"
          + (f", {len(ours.pairs)} overlapped pairs" if mode == "moe" else "")
          + (f", {_describe_memory(ours)}" if mode == "memory" else ""))
    if mode is not None:
        peaks = {label: max(simulate(model, cluster, plan, detail=False).peak_memory_bytes) / 2**30
                 for label, plan in plans.items()}
        print(f"simulated peak memory: megatron {peaks['megatron']:.1f} GiB, octopipe {peaks['octopipe']:.1f} GiB of "
              f"{cluster.usable_memory_bytes / 2**30:.1f} GiB usable")
    if split is not None:
        print(f"octopipe with splits: {split.num_stages} stages, stage->rank {[st.device for st in split.stages]}, "
              f"{_describe_splits(split)}")
    elif args.splits == "auto" and mode is None:
        print("octopipe with splits: none (the split-aware tuner kept the plan without splits)")
    if args.clock == "wall":
        print(f"transfers: boundaries of {shape[2] * 8 / 2**20:.2f} MiB over gloo, predicted with "
              f"{args.links or args.cluster}'s links unscaled")
    measured, busy = measure(runs, args.microbatches, args.clock, args.timeout)
    if args.per_rank:
        _per_rank(model, fast, plans, scale, options, measured, busy)
    tokens = args.microbatches * _tokens_per_microbatch(model)
    for label in plans:
        real_ms = measured[label] / scale  # the stand-ins sleep `scale` times the modelled GPU time
        print(f"{LABELS[label]:9s} measured step {measured[label]:8.1f} ms  simulated {sim[label]:8.1f} ms  "
              f"tokens/s {tokens / (measured[label] / 1000.0):,.0f} (on the modelled GPUs: step {real_ms:.1f} ms, "
              f"{tokens / (real_ms / 1000.0):,.0f} tokens/s)")
    if mode is not None:  # against the framework's own best schedule for the case
        print(f"measured gain {measured['megatron'] / measured['octopipe']:.2f}x "
              f"(simulated {sim['megatron'] / sim['octopipe']:.2f}x)")
        return 0
    print(f"measured speedup {measured['megatron'] / measured['octopipe']:.2f}x "
          f"(simulated {sim['megatron'] / sim['octopipe']:.2f}x)")
    if split is not None:
        print(f"measured split gain {measured['octopipe'] / measured['octopipe-split']:.2f}x "
              f"(simulated {sim['octopipe'] / sim['octopipe-split']:.2f}x)")
    return 0


def _per_rank(model, fast_cluster, plans, scale: float, options, measured, busy) -> None:
    """Per rank of every run: the work its device slept and the rest of the step it waited (for an input that had
    not landed, or a host that reached its action late), measured beside the simulator's per device."""
    for label, plan in plans.items():
        whole = plan.splits or plan.pairs or plan.memory
        res = simulate(scaled_model(model, scale) if whole else None, fast_cluster, plan, options,
                       costs=scaled_costs(model, plan, scale), detail=True)
        print(f"{LABELS[label]}: per rank, busy / waiting ms measured (simulated) of the step "
              f"{measured[label]:.1f} ({res.step_time_ms:.1f})")
        for r, b in enumerate(busy[label]):
            sb = res.busy_ms[r]
            print(f"  rank {r:2d}  busy {b:8.1f} ({sb:8.1f})  waiting {measured[label] - b:8.1f} "
                  f"({res.step_time_ms - sb:8.1f})")


def _describe_memory(plan) -> str:
    """'memory choices: recompute on 0-11, selective:mlp on 12-13' (or none)."""
    from octopipe_plugin.formats.memory import describe_choices

    return f"memory choices: {describe_choices(plan.memory)}" if plan.memory else "no memory choices"


def _describe_splits(plan) -> str:
    """'layer 34 over 16 ranks (shares 0.031-0.073)' per split layer."""
    return ", ".join(f"layer {sp.layer} over {len(sp.devices)} ranks (shares {min(sp.shares):.3f}-"
                     f"{max(sp.shares):.3f})" for sp in plan.splits)


def _tokens_per_microbatch(model) -> int:
    arch = (model.meta or {}).get("arch") or {}
    return int(arch.get("seq_len", 1)) * int(arch.get("micro_batch_size", 1))


if __name__ == "__main__":
    sys.exit(main())
