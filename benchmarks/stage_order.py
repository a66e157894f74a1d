"""Does the profile see what a stage sees? One layer timed repeated against the same layers run as a stage runs them.

Usage: PYTHONPATH=. python benchmarks/stage_order.py [--model dense] [--layers 4] [--inflight 4] [--repeats 8]
       [--flush-mb 96] [--keep-heap]

On each of 2 local ranks at once (one thread each, as the fidelity benchmark's ranks), a stage of
`--layers` distinct decoder layers of the model. Per round, interleaved (a busy spell hits every mode):
  repeat  : as the profiler does (profile/measure.py): ONE layer, F, I, W and fused B on the same input,
            back to back: its weights and activations stay in the cache; x layers (the simulator's charge);
  flushed : the same, each timed call after a write over a buffer larger than the last-level cache
            (the caches then hold only the call's own input, re-read after the flush);
  stage   : the stage as a pipeline runs it: F of `--inflight` micro-batches through all layers, then
            the fused B of each (1F1B's warm-up / cool-down), and the same with I then W (split backward);
            every action's span, divided by the stage's layer count.
Printed per kind: median ms per layer of each mode, stage / repeat and stage / flushed; wall over thread CPU
time of the stage's actions (> 1: descheduled mid-action); involuntary context switches per action; the same
three modes in thread CPU time with the page faults per call; the VM's steal time over the run (/proc/stat).
"""

from __future__ import annotations

import argparse
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

import fidelity as fid  # noqa: E402

from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.executor.split_backward import backward_input, backward_weight  # noqa: E402
from octopipe_plugin.profile.measure import _fused_backward  # noqa: E402
from octopipe_plugin.profile.torch_layers import builders, hidden_input  # noqa: E402


def steal_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far (/proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    return vals[7], sum(vals[:8])


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    init_gloo(rank, world, port, timeout_s=600)
    torch.set_num_threads(1)
    arch = fid.arch_of(args.model)
    kind = "moe" if args.model == "moe" else "dense"
    make = builders(arch)[kind]
    torch.manual_seed(rank)
    layers = [make().train() for _ in range(args.layers)]
    one = layers[0]
    params = [[p for p in l.parameters()] for l in layers]
    x0 = hidden_input(arch, torch.float32)(torch.device("cpu"))
    flush_buf = torch.empty(args.flush_mb << 18, dtype=torch.float32)  # 4 bytes each
    res: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    ivcsw: dict[str, list[int]] = {}
    faults: dict[str, list[int]] = {}

    def rec(key, fn):
        ru = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.thread_time(), time.perf_counter()
        r = fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        res.setdefault(key, []).append(1000 * (t1 - t0))
        cpu.setdefault(key, []).append(1000 * (c1 - c0))
        ivcsw.setdefault(key, []).append(ru1.ru_nivcsw - ru.ru_nivcsw)
        faults.setdefault(key, []).append(ru1.ru_minflt - ru.ru_minflt)
        return r

    def flush():
        flush_buf.fill_(1.0)

    def single(tag: str, cold: bool):
        ps = params[0]
        for fused in (False, True):
            x = x0.detach().requires_grad_(True)
            if cold:
                flush(), x.sum()
            o = rec(f"{tag} F", lambda: one(x))
            g = torch.ones_like(o)
            if cold:
                flush(), g.sum()
            if fused:
                rec(f"{tag} B", lambda: _fused_backward(o, g, x, ps, "autograd"))
            else:
                _, work = rec(f"{tag} I", lambda: backward_input([o], [g], [x], ps))
                if cold:
                    flush()
                rec(f"{tag} W", lambda: backward_weight(work, "autograd"))

    def chain(x):
        for l in layers:
            x = l(x)
        return x

    allp = [p for ps in params for p in ps]

    def stage():
        for fused in (False, True):
            ins, outs = [], []
            for _ in range(args.inflight):
                x = x0.detach().requires_grad_(True)
                ins.append(x)
                outs.append(rec("stage F", lambda: chain(x)))
            works = []
            for x, o in zip(ins, outs):
                g = torch.ones_like(o)
                if fused:
                    rec("stage B", lambda: _fused_backward(o, g, x, allp, "autograd"))
                else:
                    works.append(rec("stage I", lambda: backward_input([o], [g], [x], allp))[1])
            for w in works:
                rec("stage W", lambda: backward_weight(w, "autograd"))

    for r in range(2 + args.repeats):
        dist.barrier()
        for fn in (lambda: single("repeat", False), lambda: single("flushed", True), stage):
            fn()
            for p in allp:
                p.grad = None
        if r < 2:
            res.clear(), cpu.clear(), ivcsw.clear(), faults.clear()
    mine = {"ms": {k: statistics.median(v) for k, v in res.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "stretch": {k: sum(res[k]) / max(1e-9, sum(cpu[k])) for k in res},
            "ivcsw": {k: statistics.fmean(v) for k, v in ivcsw.items()},
            "faults": {k: statistics.median(v) for k, v in faults.items()}}
    got = [None] * world
    dist.all_gather_object(got, mine)
    if rank == 0:
        with open(os.path.join(out, "r.json"), "w") as fh:
            json.dump(got, fh)
    dist.destroy_process_group()


def main() -> None:
    """Run the modes on 2 ranks and print per kind the per-layer medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dense", choices=list(fid.MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--flush-mb", type=int, default=96, help="flush buffer size (above the last-level cache)")
    ap.add_argument("--keep-heap", action="store_true",
                    help="ranks keep glibc's heap (no trim, fixed mmap threshold): no fresh pages for new tensors")
    args = ap.parse_args()
    if args.keep_heap:
        fid.keep_heap()
    load0, s0 = os.getloadavg(), steal_jiffies()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, 2, args, tmp)
        with open(os.path.join(tmp, "r.json"), encoding="utf-8") as fh:
            got = json.load(fh)
    s1, load1 = steal_jiffies(), os.getloadavg()
    print(f"stage order: model {args.model}, {args.layers} distinct layers per stage, {args.inflight} micro-batches "
          f"in flight, {args.repeats} rounds{', heap kept' if args.keep_heap else ''}; load {load0[0]:.2f} -> {load1[0]:.2f}; VM steal "
          f"{100 * (s1[0] - s0[0]) / max(1, s1[1] - s0[1]):.2f}% of CPU time over the run")
    n = args.layers
    for r, m in enumerate(got):
        ms = m["ms"]
        print(f" rank {r}   per layer ms: repeat / flushed / stage   stage/repeat  stage/flushed  "
              f"stretch(stage)  ivcsw/action(stage)")
        for k in ("F", "I", "W", "B"):
            rep, fl, st = ms[f"repeat {k}"], ms[f"flushed {k}"], ms[f"stage {k}"] / n
            print(f"   {k}: {rep:7.2f} {fl:7.2f} {st:7.2f}     {st / rep:6.3f}        {st / fl:6.3f}"
                  f"        {m['stretch'][f'stage {k}']:.3f}          {m['ivcsw'][f'stage {k}']:.2f}")
        c = m["cpu"]
        print("   thread CPU ms per layer: repeat / flushed / stage, stage/repeat; page faults per call repeat / stage")
        for k in ("F", "I", "W", "B"):
            rep, fl, st = c[f"repeat {k}"], c[f"flushed {k}"], c[f"stage {k}"] / n
            print(f"   {k}: {rep:7.2f} {fl:7.2f} {st:7.2f}     {st / rep:6.3f}     "
                  f"{m['faults'][f'repeat {k}']:.0f} / {m['faults'][f'stage {k}']:.0f}")


if __name__ == "__main__":
    main()
