"""Where the fidelity gap comes from: every action's span inside the executor against the profile's figure.

Usage: PYTHONPATH=. python benchmarks/action_costs.py [--models dense,moe,heavy-head] [--steps 4]
       [--plans 1f1b,zb-v,...] [--clock wall|cpu] [--no-keep-heap] [--pin] [--deferral-only] [--no-deferral]

`--clock cpu` takes the profile and every action's span in the thread's CPU time: on a shared, loaded
machine the wall clock mostly measures the OS scheduler, CPU time still compares an action with its
profile (the step itself stays wall clock). The ranks keep glibc's heap (no trim, fixed mmap
threshold: fidelity.keep_heap, as fidelity.py runs them, since a GPU's caching allocator keeps its
blocks too); `--no-keep-heap` runs glibc's defaults, to see what fresh pages cost. Per action it also
counts page faults and the garbage collector's time.

Part 1 (the executor): the fidelity models and plans (benchmarks/fidelity.py) run on 2 local gloo
ranks, one thread each, plans interleaved step by step. For every (plan, stage, kind) the median span
of its actions in the executor's timeline (the runner call alone: receive waits are outside it) is
printed beside what the simulator charges for it (the profile's layers summed; B = I + W) and, for B,
the profile's own fused-backward figure. Per plan: the measured step, the simulator's prediction, the
simulator replayed with the executor's own per-(stage, kind) mean spans, the step rebuilt from its own
spans under the simulator's rule (what is left against the measured step is waiting and host gaps, not
compute), each rank's busy time measured and predicted, the wall span / CPU time of its actions, and
the messages a rank waited for: the observed hop (consumer start less producer end) against the model's.

Part 2 (deferral, hypothesis b): on each rank at once, a stage of two decoder layers, timing I and
W right after the forward (as the profiler does) against the same I and W run after k other
micro-batches' F and I (as ZB-V and the tuned plans run them), and B right after F against B after k
other forwards (as 1F1B runs it); samples interleaved, medians printed with the (I + W) / B ratio.
Print the load average: on a shared machine compare only figures of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fidelity as fid  # noqa: E402  (the models, plans, runner and link of the fidelity benchmark)

from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor  # noqa: E402
from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.executor.split_backward import backward_input, backward_weight  # noqa: E402
from octopipe_plugin.formats import Cluster, plan_from_dict, plan_to_dict  # noqa: E402
from octopipe_plugin.formats.model import model_from_dict, model_to_dict  # noqa: E402
from octopipe_plugin.profile import ProfileSettings  # noqa: E402
from octopipe_plugin.profile.arch_profile import profile_arch  # noqa: E402
from octopipe_plugin.profile.measure import _fused_backward, measure_layer  # noqa: E402
from octopipe_plugin.profile.torch_layers import builders, hidden_input, token_input  # noqa: E402
from octopipe_plugin.simulator import simulate  # noqa: E402
from octopipe_plugin.actions import RULES, Flow, Kind  # noqa: E402
from octopipe_plugin.simulator.costs import hop_times, stage_costs  # noqa: E402

KINDS = ("F", "B", "I", "W")


# ---------------------------------------------------------------- part 1: the executor's own spans

def _profile(label: str, args) -> tuple[object, list[float]]:
    """Both ranks profile at once; the mean model and the mean fused-B ms of every layer."""
    arch = fid.arch_of(label)
    settings = ProfileSettings(device="cpu", warmup=2, repeats=args.repeats, use_cache=False, progress=False)
    res = profile_arch(arch, builders(arch), settings=settings)
    fused = [p.fused.median_ms if p is not None else 0.0 for p in res.profiles]
    got = [None] * fid.DEVICES
    dist.all_gather_object(got, (model_to_dict(res.model), fused))
    model = fid._mean_model([model_from_dict(d) for d, _ in got])
    return model, [statistics.fmean(col) for col in zip(*(f for _, f in got))]


def _plans(rank: int, model, cluster, args) -> list[tuple[str, object]]:
    box = [None]
    if rank == 0:
        plans = fid.plans_for(model, cluster, args.microbatches, args.tune_s)
        box[0] = [(n, plan_to_dict(p)) for n, p in plans]
    dist.broadcast_object_list(box, src=0)
    want = set(args.plans.split(",")) if args.plans else None
    return [(n, plan_from_dict(p)) for n, p in box[0] if want is None or n.split(" (")[0] in want]


def _faults() -> int:
    """Minor page faults of this process so far (memory the kernel had to map and zero on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _GcClock:
    """Thread CPU ms spent in Python's garbage collector so far (gc.callbacks bracket every collection)."""

    def __init__(self):
        self.ms, self._t0 = 0.0, None
        gc.callbacks.append(self._hook)

    def _hook(self, phase, info):
        if phase == "start":
            self._t0 = time.thread_time()
        elif self._t0 is not None:
            self.ms += 1000 * (time.thread_time() - self._t0)
            self._t0 = None


GC = _GcClock()


def _instrument(runner, log: list) -> None:
    """Wrap the runner's action methods (this instance only): each call appends (page faults, thread CPU ms,
    of which ms in the garbage collector)."""
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        orig = getattr(runner, name)

        @functools.wraps(orig)  # the executor reads the signature (whether it takes last_backward)
        def call(*a, _orig=orig, **kw):
            f0, c0, g0 = _faults(), time.thread_time(), GC.ms
            try:
                return _orig(*a, **kw)
            finally:
                log.append((_faults() - f0, 1000 * (time.thread_time() - c0), GC.ms - g0))

        setattr(runner, name, call)


class _CpuClock:
    """Stands in for the `time` module inside profile/timing.py: the profiler's Timer then reads this thread's
    CPU time, so the profile and the executor's spans are both free of the shared machine's descheduling."""

    perf_counter = staticmethod(time.thread_time)


def _run_plans(rank: int, label: str, plans, args) -> list[list[tuple[float, list, int]]]:
    """Per plan, per timed step: (step ms, [(stage, kind, ms, page faults, mb, start s, end s)], step page faults)."""
    arch = fid.arch_of(label)
    layers = fid.build_layers(arch)
    runs = []
    for _, plan in plans:
        runner = fid._runner(arch, layers, plan, rank)
        log: list[int] = []
        _instrument(runner, log)
        runs.append((runner, PipelineExecutor(plan, runner, options=ExecutorOptions(timeout_s=900)), log))
    out: list[list] = [[] for _ in plans]
    if args.no_gc:  # the collector off during the steps (collected between rounds), as Megatron's --manual-gc runs
        gc.disable()
    staged: list[dict] = [{} for _ in plans]  # per plan: (stage, kind) -> the stage profiled whole, per round
    for i in range(args.warmup + args.steps):
        if args.stage_profile and i >= args.warmup:
            for k, (runner, _, _) in enumerate(runs):  # between rounds: the same load as the steps around them
                for s, mod in runner.modules.items():
                    x = (token_input(arch) if s == 0 else hidden_input(arch, torch.float32))(torch.device("cpu"))
                    p = measure_layer(mod, x, torch.device("cpu"), warmup=1, repeats=2)
                    for kind, t in (("F", p.fwd), ("I", p.bwd), ("W", p.wgrad), ("B", p.fused)):
                        staged[k].setdefault(f"{s} {kind}", []).append(t.median_ms)
                    for q in mod.parameters():
                        q.grad = None
        for k, (runner, ex, log) in enumerate(runs):
            for p in (q for mod in runner.modules.values() for q in mod.parameters()):
                p.grad = None
            log.clear()
            dist.barrier()
            f0 = _faults()
            t = time.perf_counter()
            res = ex.run_step()
            dist.barrier()
            f1 = _faults()
            if i >= args.warmup:
                acts = [(a.stage, a.kind.value, cpu if args.clock == "cpu" else 1000 * (t1 - t0), n, a.microbatch,
                         t0, t1, g, cpu) for (a, t0, t1), (n, cpu, g) in zip(res.timeline, log, strict=True)]
                out[k].append((1000 * (time.perf_counter() - t), acts, f1 - f0))
        if args.no_gc:
            gc.collect()
    gc.enable()
    return [(steps, {key: statistics.median(v) for key, v in st.items()}) for steps, st in zip(out, staged)]


def _waits(plan, timelines: list[list]) -> dict:
    """What one step's cross-device messages really cost: per message the consumer waited for, its start less
    the producer's end (the observed hop: transfer, wake-up, receive); and each rank's idle time between actions."""
    ns = plan.num_stages
    dev = [st.device for st in plan.stages]
    ends = {}
    for tl in timelines:
        for s, kind, _, _, mb, t0, t1, *_ in tl:
            flow = Flow.ACT if kind == "F" else Flow.GRAD if kind in ("B", "I") else None
            if flow is not None:
                ends[(s, flow, mb)] = t1
    hops, idle, lost = [], [], [0.0] * len(timelines)
    for r, tl in enumerate(timelines):
        idle.append(1000 * sum(b[5] - a[6] for a, b in zip(tl, tl[1:])))
        for a, b in zip(tl, tl[1:]):
            s, kind, mb, t0 = b[0], Kind(b[1]), b[4], b[5]
            rule = RULES[kind]
            if rule.receives is None:
                continue
            src = s - rule.receives.step
            if not 0 <= src < ns or dev[src] == dev[s]:
                continue
            made = ends.get((src, rule.receives, mb))
            if made is not None and made > a[6]:  # the consumer was idle when the message was produced
                hops.append(1000 * (t0 - made))
                lost[r] += 1000 * (t0 - made)
    return {"blocked": len(hops), "hop_median_ms": statistics.median(hops) if hops else 0.0,
            "hop_max_ms": max(hops) if hops else 0.0, "lost_ms": lost, "idle_ms": idle}


def _reconstruct(plan, timelines: list[list], hop_ms: list) -> float:
    """One step rebuilt from its own action spans under the simulator's rule (each device in its order, an
    action starting when its input is there: the producer's end plus the modelled hop across devices).

    Against the measured step it says how much the step lost outside the actions (waiting, host gaps); against
    the prediction, how much the actions' spans differ from the profile's charges.
    """
    ns = plan.num_stages
    dev = [st.device for st in plan.stages]
    hops = hop_times_of(plan, hop_ms)
    done: dict[tuple, float] = {}
    clock = [0.0] * len(timelines)
    pos = [0] * len(timelines)
    total = sum(len(tl) for tl in timelines)
    finished = 0
    while finished < total:
        moved = False
        for r, tl in enumerate(timelines):
            while pos[r] < len(tl):
                s, kind, ms, _, mb, *_ = tl[pos[r]]
                rule = RULES[Kind(kind)]
                ready = clock[r]
                if rule.receives is not None:
                    src = s - rule.receives.step
                    if 0 <= src < ns:
                        made = done.get((src, rule.receives, mb))
                        if made is None:
                            break
                        ready = max(ready, made + (hops[min(s, src)] if dev[src] != dev[s] else 0.0))
                clock[r] = ready + ms
                if rule.sends is not None:
                    done[(s, rule.sends, mb)] = clock[r]
                pos[r] += 1
                finished += 1
                moved = True
        if not moved:
            raise RuntimeError("reconstruct: the timelines deadlock (an action order the executor cannot have run)")
    return max(clock)


def hop_times_of(plan, hop_ms: list) -> list[float]:
    """Per boundary s -> s+1 the modelled hop (ms; 0 where both stages share a device)."""
    dev = [st.device for st in plan.stages]
    it = iter(hop_ms)
    return [next(it) if dev[s] != dev[s + 1] else 0.0 for s in range(plan.num_stages - 1)]


def _median_of(values):
    """The median of numbers, or the element-wise median of equal-length lists."""
    values = list(values)
    if isinstance(values[0], list):
        return [statistics.median(col) for col in zip(*values)]
    return statistics.median(values)


def _replay_costs(model, plan, spans: dict) -> object:
    """The plan's StageCosts with F/I/W (or B) of each stage replaced by the executor's median spans."""
    sc = stage_costs(model, plan.stages)
    fwd, bwd, wgrad = list(sc.fwd), list(sc.bwd), list(sc.wgrad)
    for s in range(plan.num_stages):
        if (s, "F") in spans:
            fwd[s] = spans[(s, "F")]
        if (s, "I") in spans or (s, "W") in spans:
            bwd[s], wgrad[s] = spans.get((s, "I"), 0.0), spans.get((s, "W"), 0.0)
        elif (s, "B") in spans:
            bwd[s], wgrad[s] = spans[(s, "B")], 0.0
    return dataclasses.replace(sc, fwd=tuple(fwd), bwd=tuple(bwd), wgrad=tuple(wgrad))


def _report_model(label: str, model, fused: list[float], cluster, plans, gathered) -> dict:
    """Rank 0's summary of one model: the rows printed by `print_model`."""
    out = {"model": label, "plans": []}
    per_rank = [[steps for steps, _ in r] for r in gathered]
    staged = [{} for _ in plans]
    for r in gathered:
        for k, (_, st) in enumerate(r):
            staged[k].update(st)
    for k, (name, plan) in enumerate(plans):
        steps = [statistics.median(r[k][j][0] for r in per_rank) for j in range(len(per_rank[0][k]))]
        spans: dict[tuple[int, str], list[float]] = {}
        faults: dict[tuple[int, str], list[int]] = {}
        gc_ms: dict[tuple[int, str], list[float]] = {}
        busy, step_faults, stretch = [], [], []
        for r in per_rank:
            busy.append(statistics.median(sum(e[2] for e in tl) for _, tl, _ in r[k]))
            step_faults.append(statistics.median(f for _, _, f in r[k]))
            # wall span over CPU time of this rank's actions: > 1 where the thread was kept off its core mid-action
            stretch.append(sum(1000 * (e[6] - e[5]) for _, tl, _ in r[k] for e in tl) /
                           max(1e-9, sum(e[8] for _, tl, _ in r[k] for e in tl)))
            for _, tl, _ in r[k]:
                for s, kind, ms, n, _, _, _, g, _ in tl:
                    spans.setdefault((s, kind), []).append(ms)
                    gc_ms.setdefault((s, kind), []).append(g)
                    faults.setdefault((s, kind), []).append(n)
        med = {key: statistics.median(v) for key, v in spans.items()}
        mean = {key: statistics.fmean(v) for key, v in spans.items()}  # the replay's: a step pays every span
        sc = stage_costs(model, plan.stages)
        prof_b = [sum(fused[st.start:st.end]) for st in plan.stages]
        rows = []
        for (s, kind), ms in sorted(med.items()):
            charged = {"F": sc.fwd[s], "I": sc.bwd[s], "W": sc.wgrad[s], "B": sc.bwd[s] + sc.wgrad[s]}[kind]
            rows.append({"stage": s, "kind": kind, "n": len(spans[(s, kind)]), "charged_ms": charged,
                         "staged_ms": staged[k].get(f"{s} {kind}"),
                         "fused_ms": prof_b[s] if kind == "B" else None, "executor_ms": ms,
                         "faults": statistics.median(faults[(s, kind)]),
                         "gc_ms": statistics.fmean(gc_ms[(s, kind)])})
        waits = [_waits(plan, [r[k][j][1] for r in per_rank]) for j in range(len(per_rank[0][k]))]
        hop_ms = [h for h in hop_times(cluster, [st.device for st in plan.stages], stage_costs(model, plan.stages).output)
                  if h is not None]
        rebuilt = statistics.median(_reconstruct(plan, [r[k][j][1] for r in per_rank], hop_ms)
                                    for j in range(len(per_rank[0][k])))
        sim = simulate(model, cluster, plan)
        replay = simulate(model, cluster, plan, costs=_replay_costs(model, plan, mean), detail=False)
        out["plans"].append({"plan": name, "stages": plan.num_stages, "measured_ms": statistics.median(steps),
                             "predicted_ms": sim.step_time_ms, "replay_ms": replay.step_time_ms,
                             "busy_ms": busy, "step_faults": step_faults, "stretch": stretch,
                             "predicted_busy_ms": list(sim.busy_ms), "rows": rows,
                             "hop_ms": hop_ms, "rebuilt_ms": rebuilt,
                             "waits": {key: _median_of(w[key] for w in waits) for key in waits[0]}})
    return out


def print_model(m: dict) -> None:
    """One model's tables."""
    print(f"\nmodel {m['model']}")
    for p in m["plans"]:
        dev = (p["measured_ms"] - p["predicted_ms"]) / p["predicted_ms"]
        rdev = (p["measured_ms"] - p["replay_ms"]) / p["replay_ms"]
        busy = ", ".join(f"{b:.0f}/{q:.0f}" for b, q in zip(p["busy_ms"], p["predicted_busy_ms"]))
        print(f"  {p['plan']} ({p['stages']} stages): measured {p['measured_ms']:.1f} ms, predicted "
              f"{p['predicted_ms']:.1f} ({100 * dev:+.1f}%), replayed with executor spans {p['replay_ms']:.1f} "
              f"({100 * rdev:+.1f}%), rebuilt step by step from its own spans {p['rebuilt_ms']:.1f} "
              f"({100 * (p['measured_ms'] - p['rebuilt_ms']) / p['rebuilt_ms']:+.1f}%); busy measured/predicted per rank {busy} ms; page faults per step per rank "
              f"{', '.join(f'{f:.0f}' for f in p['step_faults'])}")
        w = p["waits"]
        idle_pred = ", ".join(f"{p['predicted_ms'] - b:.1f}" for b in p["predicted_busy_ms"])
        print(f"    actions' wall span / CPU time per rank: {', '.join(f'{x:.3f}' for x in p['stretch'])}")
        print(f"    messages waited for per step {w['blocked']:.0f}: observed hop median {w['hop_median_ms']:.2f} ms, "
              f"max {w['hop_max_ms']:.2f} (modelled {', '.join(f'{h:.2f}' for h in p['hop_ms'])}); time lost to them "
              f"per rank {', '.join(f'{x:.1f}' for x in w['lost_ms'])} ms; idle between actions per rank "
              f"{', '.join(f'{x:.1f}' for x in w['idle_ms'])} ms (predicted "
              f"{idle_pred} from the simulator)")
        print(f"    {'stage':>5} {'kind':>4} {'n':>4} {'charged ms':>11} {'profile B':>10} {'executor ms':>12}"
              f" {'ratio':>7} {'faults':>7} {'gc ms':>6} {'stage whole':>12} {'exec/whole':>11}")
        for r in p["rows"]:
            fb = f"{r['fused_ms']:.2f}" if r["fused_ms"] is not None else "-"
            ratio = r["executor_ms"] / r["charged_ms"] if r["charged_ms"] > 0 else float("nan")
            print(f"    {r['stage']:>5} {r['kind']:>4} {r['n']:>4} {r['charged_ms']:>11.2f} {fb:>10} "
                  f"{r['executor_ms']:>12.2f} {ratio:>7.3f} {r['faults']:>7.0f} {r['gc_ms']:>6.2f}"
                  + (f" {r['staged_ms']:>12.2f} {r['executor_ms'] / r['staged_ms']:>11.3f}"
                     if r.get("staged_ms") else ""))
        # per kind over the plan: executor total / charged total
        tot = {}
        for r in p["rows"]:
            e, c = tot.get(r["kind"], (0.0, 0.0))
            tot[r["kind"]] = (e + r["executor_ms"] * r["n"], c + r["charged_ms"] * r["n"])
        print("    per kind, executor / charged: " + ", ".join(
            f"{k} {e / c:.3f}" for k, (e, c) in sorted(tot.items()) if c > 0))


# ---------------------------------------------------------------- part 2: deferral

def _deferral(args) -> dict:
    """Medians (ms) of I, W and B of a two-layer stage, right after their forward and deferred behind k others."""
    arch = fid.arch_of("dense")
    make = builders(arch)["dense"]
    torch.manual_seed(0)
    stage = torch.nn.Sequential(make(), make()).train()
    params = [p for p in stage.parameters() if p.requires_grad]
    x0 = hidden_input(arch, torch.float32)(torch.device("cpu"))
    k = args.defer_k

    def fwd():
        x = x0.detach().requires_grad_(True)
        out = stage(x)
        return x, out

    faults: dict[str, list[int]] = {}

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def t_of(fn, what: str = ""):
        f0, t = _faults(), clock()
        r = fn()
        ms = 1000 * (clock() - t)
        faults.setdefault(what, []).append(_faults() - f0)
        return r, ms

    def split_now():
        x, out = fwd()
        g = torch.ones_like(out)
        (_, work), ti = t_of(lambda: backward_input([out], [g], [x], params), "I now")
        _, tw = t_of(lambda: backward_weight(work, "autograd"), "W now")
        return ti, tw

    def split_deferred():
        x, out = fwd()
        g = torch.ones_like(out)
        (_, work), ti = t_of(lambda: backward_input([out], [g], [x], params), "I deferred")
        others = []
        for _ in range(k):  # k other micro-batches' F and I between this I and its W (ZB-V's steady state)
            xo, oo = fwd()
            others.append(backward_input([oo], [torch.ones_like(oo)], [xo], params)[1])
        _, tw = t_of(lambda: backward_weight(work, "autograd"), "W deferred")
        for w in others:
            backward_weight(w, "autograd")
        return ti, tw

    def fused_now():
        x, out = fwd()
        g = torch.ones_like(out)
        return t_of(lambda: _fused_backward(out, g, x, params, "autograd"), "B now")[1]

    def fused_deferred():
        outs = [fwd() for _ in range(k + 1)]  # k other forwards in flight (1F1B's warm-up)
        x, out = outs[0]
        g = torch.ones_like(out)
        tb = t_of(lambda: _fused_backward(out, g, x, params, "autograd"), "B deferred")[1]
        for xo, oo in outs[1:]:
            _fused_backward(oo, torch.ones_like(oo), xo, params, "autograd")
        return tb

    res = {"I now": [], "W now": [], "I deferred": [], "W deferred": [], "B now": [], "B deferred": []}
    for r in range(2 + args.defer_repeats):
        a, b, c, d = split_now(), split_deferred(), fused_now(), fused_deferred()
        if r >= 2:
            res["I now"].append(a[0]), res["W now"].append(a[1])
            res["I deferred"].append(b[0]), res["W deferred"].append(b[1])
            res["B now"].append(c), res["B deferred"].append(d)
        for p in params:
            p.grad = None
    out = {key: statistics.median(v) for key, v in res.items()}
    out.update({f"faults {key}": statistics.median(v) for key, v in faults.items()})
    return out


def print_deferral(per_rank: list[dict], k: int) -> None:
    """Part 2's lines: the mean of the two ranks' medians."""
    m = {key: statistics.fmean(r[key] for r in per_rank) for key in per_rank[0]}
    print(f"\ndeferral (two dense layers, k = {k} other micro-batches between; ms, mean of the ranks' medians)")
    print(f"  right after F : I {m['I now']:.2f}  W {m['W now']:.2f}  I+W {m['I now'] + m['W now']:.2f}  "
          f"B {m['B now']:.2f}  (I+W)/B {(m['I now'] + m['W now']) / m['B now']:.3f}")
    print(f"  deferred      : I {m['I deferred']:.2f}  W {m['W deferred']:.2f}  "
          f"I+W {m['I deferred'] + m['W deferred']:.2f}  B {m['B deferred']:.2f}  "
          f"(I+W)/B {(m['I deferred'] + m['W deferred']) / m['B deferred']:.3f}")
    print(f"  deferred / now: W {m['W deferred'] / m['W now']:.3f}  B {m['B deferred'] / m['B now']:.3f}")
    print("  page faults (median per call): " + "  ".join(
        f"{key[7:]} {m[key]:.0f}" for key in m if key.startswith("faults ")))


# ---------------------------------------------------------------- the ranks

def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    if args.pin:
        fid.pin_to_core(rank)
    init_gloo(rank, world, port, timeout_s=900)
    if args.clock == "cpu":
        from octopipe_plugin.profile import timing

        timing.time = _CpuClock  # this diagnostic's ranks only
    report = {"models": []}
    if not args.no_deferral:
        dist.barrier()
        mine = _deferral(args)
        both = [None] * world
        dist.all_gather_object(both, mine)
        report["deferral"] = both
    if not args.deferral_only:
        link = fid.measure_link(rank, fid.COMMON["seq_len"] * fid.COMMON["hidden"] * 4)
        cluster = Cluster(num_devices=fid.DEVICES, devices_per_node=fid.DEVICES, memory_bytes=16 << 30,
                          intra_node=link, inter_node=link, name="local-gloo")
        for label in [m for m in args.models.split(",") if m]:
            model, fused = _profile(label, args)
            plans = _plans(rank, model, cluster, args)
            mine = _run_plans(rank, label, plans, args)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            if rank == 0:
                report["models"].append(_report_model(label, model, fused, cluster, plans, per_rank))
    if rank == 0:
        with open(os.path.join(out, "report.json"), "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()


def main() -> None:
    """Run both parts and print their tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(fid.MODELS))
    ap.add_argument("--plans", default="", help="comma-separated plan names (default: all five)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10, help="profiler repeats per distinct layer")
    ap.add_argument("--tune-s", type=float, default=10.0)
    ap.add_argument("--defer-k", type=int, default=4)
    ap.add_argument("--defer-repeats", type=int, default=10)
    ap.add_argument("--deferral-only", action="store_true")
    ap.add_argument("--no-deferral", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the profile and every action span in this thread's CPU time (a loaded machine's "
                         "descheduling left out; the step itself stays wall clock)")
    ap.add_argument("--stage-profile", action="store_true",
                    help="between rounds of steps, profile each plan's stages whole (same load as the steps): "
                         "the executor's spans against the very stages measured alone")
    ap.add_argument("--no-gc", action="store_true",
                    help="the ranks' garbage collector off during the steps (collected between rounds)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                    help="each rank bound to a core of its own (as fidelity.py --pin); default: the OS places them")
    ap.add_argument("--keep-heap", action=argparse.BooleanOptionalAction, default=True,
                    help="ranks run with glibc's heap kept (fidelity.keep_heap, as fidelity.py runs them); "
                         "--no-keep-heap: glibc's defaults, to see what fresh pages cost")
    args = ap.parse_args()
    if args.keep_heap:
        fid.keep_heap()
    load0, t0 = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, fid.DEVICES, args, tmp)
        with open(os.path.join(tmp, "report.json"), encoding="utf-8") as fh:
            report = json.load(fh)
    load1 = os.getloadavg()
    print(f"action costs: {fid.DEVICES} local gloo ranks, one thread each, spans in {args.clock} time"
          f"{', pinned' if args.pin else ', not pinned'}{', heap kept' if args.keep_heap else ''}{', collector off in steps' if args.no_gc else ''}; load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after ({time.time() - t0:.0f} s)")
    if "deferral" in report:
        print_deferral(report["deferral"], args.defer_k)
    for m in report["models"]:
        print_model(m)


if __name__ == "__main__":
    main()
