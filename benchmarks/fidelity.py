"""How far the simulator is from reality: real small models through the executor against its prediction.

Usage: PYTHONPATH=. python benchmarks/fidelity.py [--microbatches 8] [--steps 16] [--stat p25|median|mean]
       [--repeats 10] [--round-samples 1] [--sample-runs 8] [--flush-mb N] [--models dense,moe,heavy-head]
       [--no-blocked] [--no-keep-heap] [--no-gc] [--pin] [--json PATH]

Three real (small) models built from plain-torch layers (octopipe_plugin/profile/torch_layers.py):
a dense Llama-style transformer, one whose decoder layers are MoE (top-2 of 8 experts plus a
shared one), and one with a heavy LM head (large vocabulary). Each distinct layer is profiled on
this machine with one thread (octopipe_plugin.profile: F, I and W with the executor's split
backward, and the fused backward B that plans without the split are charged), by both ranks at once;
the link between the two local ranks is measured by a gloo ping-pong. The tuner plans from a first
profile. Then the runs go in rounds: each round takes the profile's samples of every distinct layer
(round-robin over them; a sample is the mean of `--sample-runs` calls back to back, as a step sums many, each
call timed after a write over twice the last-level cache, `--flush-mb`: in a stage, a layer's weights and inputs
were pushed out of the caches by the stage's other layers and micro-batches) and then one step of each plan
(1F1B, interleaved 1F1B with two stages per device, ZB-V, 1F1B on Megatron's split, the tuner's plan), through the executor on 2 local processes,
one thread each (this machine has 2 cores), placed by the OS (`--pin` binds each process, its gloo threads
included, to a core of its own, as one rank per GPU: it kept the close pairs apart under load, but on a quiet
machine each rank's gloo threads then take their CPU from its own compute thread; README has the runs), the
plans in an order that changes each round (a Williams design: each
plan first, and behind each other plan, equally often; `_order`). A slow spell of the
shared machine so lands on the profile as on the steps. Each round's steps and samples are divided by the
round's speed (`round_speeds`: the machine's speed moves by 10-25% from one round to the next, in all of a
round's steps at once; `--no-blocked` keeps the raw figures); the prediction is simulated from the samples of
all rounds, and the steps and the profile are summed up by one statistic (`--stat`, default the lower
quartile, see profile/timing.py STATISTICS: interference only adds time, so the low quantile leaves the
preempted steps and samples out). The ranks keep glibc's heap (`keep_heap`, as a GPU's caching allocator
keeps its blocks: with glibc's defaults a step's new tensors take fresh pages while the profile's reuse the
last call's; `--no-keep-heap`). The header prints the load average and the CPU time the hypervisor
stole during the run (/proc/stat); per plan, `step IQR` is the inter-quartile range of its steps over
their median, `+/- 90%` the half-width of the 90% bootstrap interval of the measured figure (a pair measured
closer than that is not decided by the run), `preempt/step` the ranks' involuntary context switches per step (the OS took the core) and
`threads ms` the CPU time per step of each rank's threads other than the one running the actions (gloo's).
The executor's own host costs per action kind and per
message are measured too (octopipe_plugin/profile/overheads.py, as `octopipe profile --overheads`
does), and every plan gets a second, overhead-aware prediction (the simulator charging them; the
tuner plans with them). `ranking kept` means: every pair of plans predicted more than 3% apart is
measured in the same order; a broken pair says in how many rounds the two were measured the predicted
way (both ran in each round, one after the other). `busy dev` is the rank furthest off in time spent inside
its actions against the simulator's busy time for its device: compute alone, so a deviation with a small busy dev
is time lost between the actions (waiting, the host, other processes on the cores). Last lines, one per prediction:
`plain: worst deviation X.X% over N plans, ranking kept: yes|no` and the same for `overhead-aware`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from octopipe_plugin.costs import load_arch  # noqa: E402
from octopipe_plugin.costs.arch import layer_plan  # noqa: E402
from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor  # noqa: E402
from octopipe_plugin.executor.interface import TensorMeta  # noqa: E402
from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.executor.torch_stage import TorchStages  # noqa: E402
from octopipe_plugin.formats import Cluster, Link, plan_from_dict, plan_to_dict  # noqa: E402
from octopipe_plugin.formats.model import model_from_dict, model_to_dict  # noqa: E402
from octopipe_plugin.profile import ProfileSettings  # noqa: E402
from octopipe_plugin.profile.arch_profile import arch_layers, profile_arch  # noqa: E402
from octopipe_plugin.profile.measure import LayerProfile, measure_layer  # noqa: E402
from octopipe_plugin.profile.profiler import profiled_layer  # noqa: E402
from octopipe_plugin.profile.timing import STATISTICS, summarise  # noqa: E402
from octopipe_plugin.profile.device import device_name  # noqa: E402
from octopipe_plugin.profile.overheads import OverheadSettings, format_overheads, measure_overheads  # noqa: E402
from octopipe_plugin.profile.torch_layers import builders, token_input  # noqa: E402
from octopipe_plugin.formats.overheads import overheads_from_dict, overheads_to_dict  # noqa: E402
from octopipe_plugin.schedules.registry import build_plan  # noqa: E402
from octopipe_plugin.simulator import SimOptions, simulate  # noqa: E402
from octopipe_plugin.tuner.search import tune  # noqa: E402

DEVICES = 2  # no more processes than cores
APART = 0.03  # plans predicted further apart than this must be measured in the same order ("ranking kept")
COMMON = dict(hidden=256, ffn=704, heads=8, kv_heads=2, head_dim=0, seq_len=256, micro_batch_size=1, tp=1, dp=1,
              num_layers=8, vocab=4096, dtype_bytes=4)
MODELS = {
    "dense": ("llama3-8b", COMMON),
    "moe": ("deepseek-v3-mini", {**COMMON, "num_experts": 8, "top_k": 2, "shared_experts": 1, "moe_ffn": 352,
                                 "first_dense_layers": 1, "moe_layer_freq": 1, "mtp_depth": 0}),
    "heavy-head": ("llama3-8b", {**COMMON, "vocab": 16384}),
}


def arch_of(label: str):
    """The small architecture of one benchmark model."""
    base, fields = MODELS[label]
    return dataclasses.replace(load_arch(base, **fields), name=label)


def build_layers(arch) -> list[torch.nn.Module]:
    """Every layer of the model in order, seeded so every rank builds the same weights."""
    make = builders(arch)
    torch.manual_seed(0)
    return [make[kind]() for _, kind in layer_plan(arch)]


# ---------------------------------------------------------------- everything inside the two ranks

def _ping_pong(rank: int, nbytes: int, rounds: int = 25) -> float:
    """Median round-trip seconds of an `nbytes` message between ranks 0 and 1."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    samples = []
    for i in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 5:
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def measure_link(rank: int, nbytes: int) -> Link:
    """Latency and bandwidth of one transfer between the two local gloo ranks (ping-pong medians)."""
    small = 4
    rtt_small, rtt_big = _ping_pong(rank, small), _ping_pong(rank, nbytes)
    per_byte = max((rtt_big - rtt_small) / 2 / nbytes, 1e-12)
    return Link(bandwidth_gb_per_s=1.0 / per_byte / 1e9, latency_us=rtt_small / 2 * 1e6)


def plans_for(model, cluster: Cluster, m: int, tune_s: float, options=None) -> list[tuple[str, object]]:
    """1F1B, interleaved 1F1B (2 stages per device), ZB-V on the balanced split, 1F1B on Megatron's, the tuned plan.

    The tuner plans with `options` (the measured overheads), as `octopipe plan --overheads` does.
    """
    out = [("1f1b", build_plan(model, "1f1b", DEVICES, m, split="balanced")),
           ("interleaved-1f1b", build_plan(model, "interleaved-1f1b", DEVICES, m, stages_per_device=2,
                                           split="balanced")),
           ("zb-v", build_plan(model, "zb-v", DEVICES, m, split="balanced")),
           ("1f1b megatron-split", build_plan(model, "1f1b", DEVICES, m, split="megatron"))]
    tuned = tune(model, cluster, m, time_budget_s=tune_s, seed=0, options=options)
    out.append((f"tuned ({tuned.source})", tuned.plan))
    return out


def _runner(arch, layers, plan, rank: int) -> TorchStages:
    ns = plan.num_stages
    mods = {s: torch.nn.Sequential(*layers[plan.stages[s].start:plan.stages[s].end]) for s in plan.stages_of(rank)}
    act = TensorMeta(shape=(arch.micro_batch_size, arch.seq_len, arch.hidden), dtype=torch.float32)
    metas = tuple(act if s < ns - 1 else TensorMeta(shape=(), dtype=torch.float32) for s in range(ns))
    tokens = token_input(arch)
    return TorchStages(modules=mods, num_stages=ns, num_microbatches=plan.num_microbatches, metas=metas,
                       load_input=lambda mb: tokens(torch.device("cpu")),
                       loss_fn=lambda out, mb: out)  # the LM head already returns the mean token loss


def _mean_model(models):
    """The ranks' profiles averaged layer by layer (both ranks profiled at once, as both compute in a step)."""
    first = models[0]
    layers = tuple(dataclasses.replace(
        ls[0], **{f: statistics.fmean(getattr(l, f) for l in ls) for f in ("fwd_ms", "bwd_ms", "wgrad_ms")},
        fused_ratio=_mean_measured(ls, "fused_ratio"), walk_ms_per_node=_mean_measured(ls, "walk_ms_per_node"))
        for ls in zip(*(m.layers for m in models)))
    return dataclasses.replace(first, layers=layers)


def _mean_measured(layers, name: str) -> float | None:
    """The mean of one layer's profiles' optional figure `name` (fused_ratio, walk_ms_per_node; None where none
    measured it)."""
    got = [getattr(l, name) for l in layers if getattr(l, name) is not None]
    return statistics.fmean(got) if got else None


def _profile_both(label: str, args) -> object:
    """Both ranks profile the model at once (as both compute during a step); the layer-wise mean of the two."""
    arch = arch_of(label)
    settings = ProfileSettings(device="cpu", warmup=2, repeats=args.repeats, use_cache=args.cache, progress=False,
                               statistic=args.stat)
    mine = profile_arch(arch, builders(arch), settings=settings).model
    gathered = [None] * DEVICES
    dist.all_gather_object(gathered, model_to_dict(mine))
    return _mean_model([model_from_dict(d) for d in gathered])


def _profile_and_plan(rank: int, label: str, cluster: Cluster, args, options) -> tuple[object, list]:
    """Both ranks profile the model; rank 0 tunes and builds the plans; all ranks get them."""
    model = _profile_both(label, args)
    box = [None]
    if rank == 0:
        plans = plans_for(model, cluster, args.microbatches, args.tune_s, options)
        box[0] = (model_to_dict(model), [(name, plan_to_dict(p)) for name, p in plans])
    dist.broadcast_object_list(box, src=0)  # rank 1 waits here while rank 0 tunes
    doc, plans = box[0]
    return model_from_dict(doc), [(name, plan_from_dict(p)) for name, p in plans]


_PHASES = ("fwd", "bwd", "wgrad", "fused")  # LayerProfile's timed phases: F, I, W, B


class RoundProfile:
    """The model's distinct layers profiled a few samples at a time, in the rounds between the steps.

    A slow spell of a shared machine then lands on the profile as on the steps it is compared with, and the
    samples of all rounds are summed up by the same statistic as the steps (profile/timing.py STATISTICS).
    """

    def __init__(self, arch, samples_per_round: int, runs_per_sample: int = 1, flush_bytes: int = 0):
        planned = arch_layers(arch, builders(arch), impl="torch", dtype=torch.float32)
        reps = {}
        for p in planned:
            if p is not None:
                reps.setdefault(p.kind, p)
        torch.manual_seed(0)
        self.kinds = {k: (rep.build(), rep.example_input(torch.device("cpu"))) for k, rep in reps.items()}
        self.n = samples_per_round
        self.runs = runs_per_sample
        self.flush = flush_bytes
        self.kept = 0  # rounds whose samples are kept
        self.first: dict[str, LayerProfile] = {}  # each kind's first sample (its sizes)
        self.ms: dict[str, dict[str, list[float]]] = {k: {f: [] for f in _PHASES} for k in self.kinds}

    def round_totals(self) -> list[float]:
        """Each kept round's samples summed over the kinds and phases (to compare with the round's speed)."""
        per = [sum(v[j] for ph in self.ms.values() for v in ph.values()) for j in range(self.kept * self.n)]
        return [sum(per[r * self.n:(r + 1) * self.n]) for r in range(self.kept)]

    def sample(self, keep: bool) -> None:
        """One round's samples of every distinct layer (kept when `keep`, else a warm-up)."""
        self.kept += keep
        for _ in range(self.n):
            for k, (mod, x) in self.kinds.items():  # round-robin over the kinds, as a stage runs its layers
                # W's walk per node below is the first profile's (a difference of medians: one sample is noise)
                prof = measure_layer(mod, x, torch.device("cpu"), warmup=0, repeats=self.runs, walk_nodes=0,
                                     flush_bytes=self.flush)
                if keep:
                    self.first.setdefault(k, prof)
                    for f in _PHASES:
                        # the mean of the runs back to back: a sample that, like a step, sums many calls
                        self.ms[k][f].append(getattr(prof, f).mean_ms)

    def model(self, base, statistic: str, speeds: list[float] | None = None):
        """`base` with each measured kind's times from this rank's samples of every round, by `statistic`; each
        round's samples divided by that round's speed first (`speeds`, round_speeds: as its steps are)."""
        speeds = speeds or [1.0] * self.kept
        got = {k: dataclasses.replace(self.first[k], **{
            f: summarise([ms / speeds[j // self.n] for j, ms in enumerate(v)]) for f, v in self.ms[k].items()})
            for k in self.first}
        layers = tuple(dataclasses.replace(profiled_layer(l.name, l.kind, got[l.kind], statistic),
                                           state_bytes=l.state_bytes, activation_bytes=l.activation_bytes,
                                           output_bytes=l.output_bytes, graph_nodes=l.graph_nodes,
                                           walk_ms_per_node=l.walk_ms_per_node)
                       if l.kind in got else l for l in base.layers)
        return dataclasses.replace(base, layers=layers)


def round_speeds(times: list[list[float]]) -> list[float]:
    """Each round's speed: the geometric mean over the plans of the round's step against the plan's median step.

    Every plan steps once a round, so a slow spell of the shared machine that lasts a round (the VM's speed moves
    by 10-25% from one round to the next here, quiet or not) shows in all of its steps at once; dividing each
    round's steps and profile samples by it leaves each plan's own spread (blocking, as in a designed experiment).
    """
    rounds = len(times[0])
    medians = [statistics.median(ts) for ts in times]
    return [math.exp(statistics.fmean(math.log(ts[r] / m) for ts, m in zip(times, medians) if m > 0))
            for r in range(rounds)]


def _switches() -> tuple[int, int]:
    """This process's (voluntary, involuntary) context switches so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_nvcsw, ru.ru_nivcsw


def _order(i: int, n: int) -> list[int]:
    """Round i's order of the n plans: row i of a Williams design (its rows in turn), in which every plan comes
    first, and follows every other plan, equally often over the rows (n rows, 2n for odd n). A plain rotation kept
    each plan behind the same one in every round but the one it opened, so whatever a step leaves behind (the heap,
    the caches, the collector's garbage) always fell on the same next plan."""
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:  # 0, 1, n-1, 2, n-2, ...
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:  # odd n: the reversed rows balance the pairs
        rows += [row[::-1] for row in rows]
    return rows[i % len(rows)]


def pin_to_core(rank: int) -> None:
    """Bind this rank's process to core `rank` (of the cores it may use), before gloo starts its threads so they
    inherit it: one rank per core, as one rank per GPU, so a waking thread of one rank is never placed on the
    core another rank computes on (the scheduler's wake-up placement otherwise puts it beside its waker)."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    if args.pin:
        pin_to_core(rank)
    init_gloo(rank, world, port, timeout_s=900)
    torch.set_num_threads(1)
    link = measure_link(rank, COMMON["seq_len"] * COMMON["hidden"] * 4)
    cluster = Cluster(num_devices=DEVICES, devices_per_node=DEVICES, memory_bytes=16 << 30, intra_node=link,
                      inter_node=link, name="local-gloo")
    # the executor's own costs, measured on these two ranks as `octopipe profile --overheads` does
    overheads = measure_overheads(OverheadSettings(use_cache=args.cache))
    aware = SimOptions(overheads=overheads)
    report = {"link": [link.latency_us, link.bandwidth_gb_per_s], "overheads": overheads_to_dict(overheads),
              "models": []}
    for label in [m for m in args.models.split(",") if m]:
        model, plans = _profile_and_plan(rank, label, cluster, args, aware)
        arch = arch_of(label)
        layers = build_layers(arch)
        runs = []
        for _, plan in plans:
            runner = _runner(arch, layers, plan, rank)
            runs.append((runner, PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=900))))
        rounds = RoundProfile(arch, args.round_samples, args.sample_runs, args.flush_mb << 20)
        if args.no_gc:  # the collector off during the timed steps, collected after each round (Megatron's --manual-gc)
            gc.disable()
        times: list[list[float]] = [[] for _ in plans]
        busy: list[list[float]] = [[] for _ in plans]  # this rank's time inside its actions, per step
        switches: list[list[int]] = [[] for _ in plans]  # this rank's involuntary context switches, per step
        others: list[list[float]] = [[] for _ in plans]  # CPU ms of this rank's other threads (gloo's), per step
        # rounds: the profile's samples, then one step of every plan (_order), so a busy spell of the shared
        # machine hits the profile and every plan alike
        for i in range(args.warmup + args.steps):
            dist.barrier()
            rounds.sample(keep=i >= args.warmup)
            for k in _order(i, len(runs)):
                runner, ex = runs[k]
                for p in (q for mod in runner.modules.values() for q in mod.parameters()):
                    p.grad = None
                dist.barrier()
                c0, p0, m0 = _switches()[1], time.process_time(), time.thread_time()
                t = time.perf_counter()
                res = ex.run_step()
                dist.barrier()
                if i >= args.warmup:
                    times[k].append(1000 * (time.perf_counter() - t))
                    busy[k].append(1000 * sum(t1 - t0 for _, t0, t1 in res.timeline))
                    switches[k].append(_switches()[1] - c0)
                    others[k].append(1000 * ((time.process_time() - p0) - (time.thread_time() - m0)))
            if args.no_gc:
                gc.collect()
        gc.enable()
        speeds = round_speeds(times) if args.blocked else [1.0] * args.steps
        blocked = [[t / v for t, v in zip(ts, speeds)] for ts in times]
        # the prediction's profile: this rank's samples of every round, then the ranks' mean (both computed at once)
        every = [None] * DEVICES
        mine = (model_to_dict(rounds.model(model, args.stat, speeds)),
                [_stat([b / v for b, v in zip(bs, speeds)], args.stat) for bs in busy],
                [statistics.fmean(c) for c in switches], [statistics.fmean(c) for c in others])
        dist.all_gather_object(every, mine)
        model = _mean_model([model_from_dict(d) for d, *_ in every])
        rows = []
        for k, ((name, plan), ts) in enumerate(zip(plans, times)):
            sim = simulate(model, cluster, plan)
            rows.append({"plan": name, "stages": plan.num_stages, "steps_ms": ts, "blocked_ms": blocked[k],
                         "measured_ms": _stat(blocked[k], args.stat),
                         "predicted_ms": sim.step_time_ms,
                         "aware_ms": simulate(model, cluster, plan, aware, detail=False).step_time_ms,
                         "busy_ms": [every[r][1][k] for r in range(DEVICES)], "predicted_busy_ms": list(sim.busy_ms),
                         "switches": [every[r][2][k] for r in range(DEVICES)],
                         "other_threads_ms": [every[r][3][k] for r in range(DEVICES)]})
        report["models"].append({"model": model_to_dict(model), "rows": rows, "speeds": speeds,
                                 "profile_rounds": rounds.round_totals()})
    if rank == 0:
        with open(os.path.join(out, "report.json"), "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()


def flush_mb_default(fallback_mb: int = 64) -> int:
    """Twice the last-level cache of this machine's first CPU in MB (sysfs), `fallback_mb` where it is not told."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(base) if e.startswith("index")]  # beside them: uevent, a file
    except OSError:
        return fallback_mb
    best = 0
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size"), encoding="ascii") as fh:
                size = fh.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:])
            if scale:
                best = max(best, int(size[:-1]) * scale)
        except (OSError, ValueError):
            continue
    return max(1, 2 * best >> 20) if best else fallback_mb


def keep_heap() -> None:
    """Ranks spawned from now on keep glibc's heap: no trim, a fixed mmap threshold above the tensors' sizes.

    By default glibc maps each large block afresh and unmaps it when freed. The profiler's calls each reuse the
    block the last one freed, while a step holds several micro-batches' activations, so its new tensors take fresh
    pages (one decoder layer's F here: 30% slower with 3 other forwards' graphs alive; the same with the heap kept).
    A GPU's caching allocator keeps its blocks, so a CPU run that is to tell about a GPU's is made to as well.
    """
    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40),
                      MALLOC_TOP_PAD_=str(64 << 20))  # read by glibc when each rank starts


def _stat(samples: list[float], statistic: str) -> float:
    """The samples' figure by `statistic` (the profile's rule: profile/timing.py)."""
    return summarise(samples).at(statistic)


def steal_jiffies() -> tuple[int, int]:
    """(steal, all) jiffies of every CPU since boot (/proc/stat): the time the hypervisor ran something else."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            vals = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return vals[7], sum(vals)


def _correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation of two equally long series (0 where either is constant)."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return 0.0


def ranking(rows: list[dict], key: str) -> list[str]:
    """Plan labels, fastest first."""
    return [r["plan"] for r in sorted(rows, key=lambda r: r[key])]


def order_broken(rows: list[dict], key: str, apart: float = APART) -> list[tuple[str, str]]:
    """Pairs (predicted faster, predicted slower) more than `apart` apart by `key` that were measured the other way."""
    out = []
    for a in rows:
        for b in rows:
            if a[key] * (1 + apart) < b[key] and a["measured_ms"] > b["measured_ms"]:
                out.append((a["plan"], b["plan"]))
    return out


def stat_interval(samples: list[float], statistic: str, draws: int = 400, seed: int = 0) -> float:
    """Half-width of the 90% bootstrap interval of the samples' `statistic`, over that statistic (how precisely
    the rounds pin the plan's step: pairs measured closer than this are not decided by the run)."""
    rng = random.Random(seed)
    got = sorted(_stat([rng.choice(samples) for _ in samples], statistic) for _ in range(draws))
    mid = _stat(samples, statistic)
    return (got[int(0.95 * (draws - 1))] - got[int(0.05 * (draws - 1))]) / 2 / mid if mid > 0 else 0.0


def paired_wins(rows: list[dict], a: str, b: str) -> int:
    """In how many rounds plan `a` stepped faster than plan `b` (the rounds ran both, one after the other)."""
    ta = next(r["steps_ms"] for r in rows if r["plan"] == a)
    tb = next(r["steps_ms"] for r in rows if r["plan"] == b)
    return sum(x < y for x, y in zip(ta, tb))


def main() -> None:
    """Profile, plan, run, and print measured against predicted step time per model and plan."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16,
                    help="timed rounds: each one the profile's samples, then one step of every plan (order: _order)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--stat", choices=STATISTICS, default="p25",
                    help="the figure taken of the steps and of the profile's samples alike (p25: the lower quartile, "
                         "which leaves out the steps other processes slowed down; median; mean: what a sum of many "
                         "actions adds up to, see profile/timing.py STATISTICS)")
    ap.add_argument("--round-samples", type=int, default=1,
                    help="profile samples per distinct layer in each round (the prediction's profile)")
    ap.add_argument("--sample-runs", type=int, default=8,
                    help="runs of a layer back to back that one round's sample is the mean of: a step sums dozens of "
                         "calls, so its low quantile over the rounds sits near the calls' mean, and a sample of one "
                         "call each round would, by the same statistic, charge each call below its mean")
    ap.add_argument("--flush-mb", type=int, default=flush_mb_default(),
                    help="MB written over before each timed call of the round samples (default: twice this machine's "
                         "last-level cache; 0: none): a stage's layer finds its weights and inputs out of the caches, "
                         "as the stage's other layers and micro-batches ran in between")
    ap.add_argument("--repeats", type=int, default=10,
                    help="profiler repeats per distinct layer before the runs (the profile the tuner plans with)")
    ap.add_argument("--tune-s", type=float, default=10.0, help="tuner time budget per model (seconds)")
    ap.add_argument("--cache", action="store_true", help="reuse cached profiles (default: measure under today's load)")
    ap.add_argument("--no-gc", action="store_true",
                    help="Python's garbage collector off between the steps too, collected after each round (the "
                         "executor already pauses it inside each step: ExecutorOptions.pause_gc)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                    help="each rank (its gloo threads included) bound to a core of its own (os.sched_setaffinity), "
                         "as one rank per GPU; default --no-pin: the OS places the ranks' threads (see the docstring)")
    ap.add_argument("--keep-heap", action=argparse.BooleanOptionalAction, default=True,
                    help="ranks (profile and runs alike) keep glibc's heap (keep_heap), as a GPU's caching allocator "
                         "keeps its blocks; --no-keep-heap: glibc's defaults")
    ap.add_argument("--blocked", action=argparse.BooleanOptionalAction, default=True,
                    help="divide each round's steps and profile samples by the round's speed (round_speeds) before "
                         "the statistic; --no-blocked: the raw figures")
    ap.add_argument("--json", metavar="PATH", help="also write the ranks' report (every step of every plan) there")
    args = ap.parse_args()
    if args.keep_heap:
        keep_heap()
    load0, t0, steal0 = os.getloadavg(), time.time(), steal_jiffies()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, DEVICES, args, tmp)
        with open(os.path.join(tmp, "report.json"), encoding="utf-8") as fh:
            report = json.load(fh)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh)
    load1, steal1 = os.getloadavg(), steal_jiffies()
    stat = {"p25": "lower quartile", "median": "median", "mean": "mean"}[args.stat]
    print(f"fidelity: {DEVICES} local ranks (gloo), one thread each"
          f"{' (pinned, a core each)' if args.pin else ' (not pinned: the OS places their threads)'}"
          f"{' (heap kept)' if args.keep_heap else ''}"
          f"{' (collector off in steps)' if args.no_gc else ''}, {args.microbatches} micro-batches; "
          f"{args.steps} rounds after {args.warmup}, each: {args.round_samples} profile sample(s) of every distinct "
          f"layer (each the mean of {args.sample_runs} runs back to back, each after a {args.flush_mb} MB flush; "
          f"both ranks at once), then one step of every plan (a Williams design's order); the {stat} of the "
          f"rounds taken of the steps and of the profile alike"
          f"{', each round divided by its speed (blocked)' if args.blocked else ''}")
    if args.stat == "p25":
        print("  why the lower quartile: other processes and the hypervisor only ever add time to a step or a "
              "sample, so the low quantile of interleaved rounds estimates the undisturbed run and leaves the "
              "preempted ones out; a quartile, unlike the minimum, stays steady over a dozen rounds")
    elif args.stat == "mean":
        print("  why the mean: a step is the sum of its actions (and waits), so its mean is the sum of their means; "
              "a low quantile of short samples, summed, falls short of the same quantile of their sum")
    torch.set_num_threads(1)  # the thread count each rank ran with (part of the device name)
    steal = 100 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
    print(f"machine: {device_name(torch.device('cpu'))} per rank, {os.cpu_count()} cores; load average "
          f"{load0[0]:.2f} before, {load1[0]:.2f} after ({time.time() - t0:.0f} s); CPU time stolen by the "
          f"hypervisor during the run {steal:.2f}% (/proc/stat)")
    lat, bw = report["link"]
    print(f"link (gloo ping-pong): latency {lat:.0f} us, bandwidth {bw:.2f} GB/s")
    print(format_overheads(overheads_from_dict(report["overheads"])))
    worst, n, kept = {"predicted_ms": 0.0, "aware_ms": 0.0}, 0, {"predicted_ms": True, "aware_ms": True}
    for entry in report["models"]:
        model, rows = model_from_dict(entry["model"]), entry["rows"]
        kinds = {}
        for l in model.layers:
            kinds.setdefault(l.kind, l)
        desc = ", ".join(f"{k} {l.fwd_ms:.1f}/{l.bwd_ms:.1f}/{l.wgrad_ms:.1f}/"
                         f"{(l.bwd_ms + l.wgrad_ms) * (l.fused_ratio or 1.0):.1f}" for k, l in kinds.items())
        print(f"\nmodel {model.name}: {model.num_layers} layers; profiled F/I/W/B ms: {desc}")
        speeds, totals = entry["speeds"], entry["profile_rounds"]
        if args.blocked:
            print(f"  round speeds {min(speeds):.3f}-{max(speeds):.3f} (steps and samples divided by them); the "
                  f"profile's samples per round follow them: correlation {_correlation(speeds, totals):+.2f}")
        print(f"  {'plan':<28}{'stages':>7}{'predicted ms':>14}{'aware ms':>10}{'measured ms':>13}{'deviation':>11}"
              f"{'aware dev':>11}{'step IQR':>10}{'+/- 90%':>9}{'busy dev':>10}{'preempt/step':>14}{'threads ms':>12}")
        for r in rows:
            devs = {key: (r["measured_ms"] - r[key]) / r[key] for key in worst}
            worst = {key: max(worst[key], abs(devs[key])) for key in worst}
            n += 1
            spread = summarise(r["blocked_ms"]).spread  # inter-quartile range over the median
            # the rank whose time inside its actions is furthest from the simulator's busy time (compute alone,
            # no waiting): where this is small and the deviation is not, the step lost its time between actions
            busy = max(((b - q) / q for b, q in zip(r["busy_ms"], r["predicted_busy_ms"]) if q > 0), key=abs)
            print(f"  {r['plan']:<28}{r['stages']:>7}{r['predicted_ms']:>14.1f}{r['aware_ms']:>10.1f}"
                  f"{r['measured_ms']:>13.1f}{100 * devs['predicted_ms']:>+10.1f}%{100 * devs['aware_ms']:>+10.1f}%"
                  f"{100 * spread:>9.1f}%{100 * stat_interval(r['blocked_ms'], args.stat):>8.1f}%{100 * busy:>+9.1f}%{statistics.fmean(r['switches']):>14.1f}"
                  f"{statistics.fmean(r['other_threads_ms']):>12.1f}")
        print(f"  ranking by measured      : {' < '.join(ranking(rows, 'measured_ms'))}")
        for key, label in (("predicted_ms", "predicted"), ("aware_ms", "overhead-aware")):
            broken = order_broken(rows, key)
            kept[key] = kept[key] and not broken
            said = "kept" if not broken else "broken: " + ", ".join(
                f"{a} < {b} (measured so in {paired_wins(rows, a, b)} of {args.steps} rounds)" for a, b in broken)
            print(f"  ranking by {label:<14}: {' < '.join(ranking(rows, key))}  (pairs > {100 * APART:.0f}% apart "
                  f"{said})")
    load = os.getloadavg()
    print(f"\nload average now {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)")
    for key, label in (("predicted_ms", "plain"), ("aware_ms", "overhead-aware")):
        print(f"{label}: worst deviation {100 * worst[key]:.1f}% over {n} plans, ranking kept: "
              f"{'yes' if kept[key] else 'no'}")


if __name__ == "__main__":
    main()
