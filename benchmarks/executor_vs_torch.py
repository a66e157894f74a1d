"""Our executor against torch.distributed.pipelining's _PipelineScheduleRuntime: same plans, modules, machine.

Usage: PYTHONPATH=. python benchmarks/executor_vs_torch.py [--devices 4] [--microbatches 8] [--steps 5]

For each schedule the plan is exported as torch's compute-only CSV (lowered by torch's
comm passes) and run by both executors, alternating, inside the same gloo processes.
Two workloads: real tiny compute (the toy MLP/attention model, float32) and stand-in
layers that sleep a set F / I / W time (no CPU, so the ratio shows executor overhead
and scheduling, not core contention). Prints the median step time of each and
ours / torch (below 1.0: ours is faster). Before timing, both executors' gradients are
checked against a single-process reference step (same modules, same data).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from octopipe_plugin.errors import PlanError  # noqa: E402
from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor  # noqa: E402
from octopipe_plugin.testing.checks import toy_runner  # noqa: E402
from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.testing.plans import make_plan, random_bounds, sample_schedule  # noqa: E402
from octopipe_plugin.testing.torch_interop import torch_runtime  # noqa: E402
from octopipe_plugin.testing.toy import ToySpec, build_layers, microbatch, reference_step, stage_modules  # noqa: E402
from octopipe_plugin.formats import plan_from_dict, plan_to_dict  # noqa: E402
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for  # noqa: E402

SPEC = ToySpec(hidden=64, seq=32, batch=4, dtype=torch.float32,
               layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))
SLEEP_MS = (2.0, 2.0, 1.5)  # per layer F, I, W


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd` ms in forward and `bwd` ms in backward."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        """Sleep fwd ms, pass x on."""
        ctx.bwd = bwd
        time.sleep(fwd / 1000.0)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        """Sleep bwd ms, pass the gradient on."""
        time.sleep(ctx.bwd / 1000.0)
        return g, None, None


class SleepLayer(nn.Module):
    """Stand-in layer: input path sleeps F then I; a parameter path sleeps W, so split backward splits it."""

    def __init__(self, hidden: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(hidden, dtype=SPEC.dtype))

    def forward(self, x):
        """x (slept F, I) + w (slept W)."""
        f, i, w = SLEEP_MS
        return _Sleep.apply(x, f, i) + _Sleep.apply(self.w, 0.0, w)


def build(mode: str) -> nn.ModuleList:
    """The model of a workload: the toy model, or one sleeping stand-in per toy layer."""
    if mode == "real":
        return build_layers(SPEC)
    return nn.ModuleList([SleepLayer(SPEC.hidden) for _ in SPEC.layers])


def plan_docs(p: int, m: int, in_order: bool = True) -> list[dict]:
    """One plan per built-in schedule plus a random irregular one, uniform stages."""
    docs = []
    n = len(SPEC.layers)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2),
                    ("dualpipev", 2), ("random", 2)):
        rng = random.Random(7)
        if name == "random":
            devs = [s % p for s in range(p * v)]
            rng.shuffle(devs)
            # torch's runtime keeps per-stage losses positionally: keep each stage in micro-batch order
            sched = sample_schedule(devs, p, m, rng, in_order=in_order)
        else:
            devs = stage_devices_for(name, p, v)
            try:
                sched = SCHEDULES[name].generate(devs, p, m)
            except PlanError as exc:  # e.g. DualPipeV with fewer than 2p micro-batches
                print(f"skipped {name}: {exc}")
                continue
        ns = len(devs)
        bounds = [(round(s * n / ns), round((s + 1) * n / ns)) for s in range(ns)]
        if any(a == b for a, b in bounds):
            bounds = random_bounds(n, ns, rng)
        doc = plan_to_dict(make_plan(stage_devices=devs, bounds=bounds, num_devices=p, num_microbatches=m,
                                     schedule=sched))
        doc["meta"] = {"label": name}
        docs.append(doc)
    return docs


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _run_torch(runtime, plan, rank: int):
    m = plan.num_microbatches
    mine = plan.stages_of(rank)
    kwargs = {}
    args = ()
    if 0 in mine:
        args = (torch.cat([microbatch(SPEC, mb)[0] for mb in range(m)]),)
    if plan.num_stages - 1 in mine:
        kwargs = {"target": torch.cat([microbatch(SPEC, mb)[1] for mb in range(m)]), "losses": []}
    runtime.step(*args, **kwargs)


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _zero(mods) -> None:
    for p in mods.parameters():
        p.grad = None


def _grads_match(plan, layers: nn.ModuleList, ref: nn.ModuleList, rank: int) -> bool:
    """Whether this rank's gradients equal the single-process reference's."""
    for s in plan.stages_of(rank):
        st = plan.stages[s]
        for i in range(st.start, st.end):
            for a, b in zip(layers[i].parameters(), ref[i].parameters()):
                if a.grad is None or not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6):
                    return False
    return True


def _all_ranks(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _bench_plan(rank: int, plan, mode: str, steps: int, tmp: str):
    m = plan.num_microbatches
    bounds = [(s.start, s.end) for s in plan.stages]
    mine = plan.stages_of(rank)
    ours_layers, their_layers = build(mode), build(mode)
    ours = PipelineExecutor(plan, toy_runner(SPEC, ours_layers, plan, rank), options=ExecutorOptions(timeout_s=120))
    runtime = torch_runtime(plan, stage_modules(their_layers, bounds, mine), _loss, rank,
                            os.path.join(tmp, f"{plan.meta['label']}-{mode}-{rank}.csv"))
    ours.run_step()
    _run_torch(runtime, plan, rank)
    ref = build(mode)
    reference_step(SPEC, ref, m)
    correct = (_all_ranks(_grads_match(plan, ours_layers, ref, rank)),
               _all_ranks(_grads_match(plan, their_layers, ref, rank)))
    t_ours, t_torch = [], []
    for _ in range(steps):
        _zero(ours_layers)
        _zero(their_layers)
        t_ours.append(_timed(ours.run_step))
        t_torch.append(_timed(lambda: _run_torch(runtime, plan, rank)))
    return t_ours, t_torch, correct


def worker(rank: int, world: int, port: int, docs: list[dict], modes: list[str], steps: int, out: str) -> None:
    """Spawn target: benchmark every plan in every mode; rank 0 writes the medians."""
    init_gloo(rank, world, port, timeout_s=300)
    rows = []
    for mode in modes:
        for doc in docs:
            plan = plan_from_dict(doc)
            t_ours, t_torch, correct = _bench_plan(rank, plan, mode, steps, out)
            rows.append({"schedule": doc["meta"]["label"], "mode": mode, "ours_ms": 1000 * statistics.median(t_ours),
                         "torch_ms": 1000 * statistics.median(t_torch), "ours_ok": correct[0],
                         "torch_ok": correct[1]})
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> None:
    """Parse arguments, run the benchmark on local processes, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="real,sleep")
    ap.add_argument("--any-order", action="store_true",
                    help="let the random plan run a stage's micro-batches out of order (torch's runtime may then "
                         "fail, or silently compute wrong gradients: see the last column)")
    args = ap.parse_args()
    docs = plan_docs(args.devices, args.microbatches, in_order=not args.any_order)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args.devices, docs, args.modes.split(","), args.steps, tmp)
        with open(os.path.join(tmp, "results.json"), encoding="utf-8") as fh:
            rows = json.load(fh)
    print(f"{args.devices} ranks (gloo, one host), {args.microbatches} micro-batches, median of {args.steps} steps; "
          f"sleep stand-in F/I/W = {SLEEP_MS} ms per layer")
    print(f"{'schedule':18s} {'workload':8s} {'ours ms':>9s} {'torch ms':>9s} {'ours/torch':>11s}  "
          f"gradients vs single-process reference (ours, torch)")
    ok = {True: "ok", False: "WRONG"}
    for r in rows:
        print(f"{r['schedule']:18s} {r['mode']:8s} {r['ours_ms']:9.1f} {r['torch_ms']:9.1f} "
              f"{r['ours_ms'] / r['torch_ms']:11.3f}  {ok[r['ours_ok']]}, {ok[r['torch_ok']]}")


if __name__ == "__main__":
    main()
