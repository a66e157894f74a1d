"""Per-message against batched exchange (batch_isend_irecv per peer and step) on gloo: step times side by side.

Usage: PYTHONPATH=. python benchmarks/exchange_lanes.py [--devices 4] [--microbatches 8] [--steps 10]

Same plans, same processes, the two exchanges alternating step by step (so load drift on a
shared machine hits both alike). Two workloads: the toy model's real tiny layers
(MLP / attention, float32) and the sleeping stand-in layers of executor/sleep_layer.py
(F, I, W sleeps on a per-rank DeviceClock: no CPU, so the figure shows posting and
waiting, not core contention). A step's time is the slowest rank's; the table prints the
median per exchange and batched / message (below 1.0: batched is faster). Before timing,
both exchanges are run once and their losses compared.
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

from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor  # noqa: E402
from octopipe_plugin.testing.checks import toy_runner  # noqa: E402
from octopipe_plugin.executor.clock import DeviceClock  # noqa: E402
from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.testing.plans import make_plan, random_bounds  # noqa: E402
from octopipe_plugin.testing.sleep_layer import SleepLayer, DTYPE  # noqa: E402
from octopipe_plugin.executor.torch_stage import TorchStages  # noqa: E402
from octopipe_plugin.testing.toy import ToySpec, build_layers, stage_modules  # noqa: E402
from octopipe_plugin.executor.interface import TensorMeta  # noqa: E402
from octopipe_plugin.formats import plan_from_dict, plan_to_dict  # noqa: E402
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for  # noqa: E402

SPEC = ToySpec(hidden=64, seq=32, batch=4, dtype=torch.float32,
               layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))
SLEEP_MS = (2.0, 2.0, 1.5)  # per layer F, I, W
EXCHANGES = ("message", "batched")
PLANS = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2))


def _sleep_runner(plan, rank: int, clock: DeviceClock) -> TorchStages:
    """TorchStages of sleeping layers (one per model layer) on this rank's device clock."""
    f, i, w = SLEEP_MS
    layers = nn.ModuleList([SleepLayer(clock, f, i, w) for _ in SPEC.layers])
    shape = (SPEC.batch, SPEC.seq, SPEC.hidden)
    bounds = [(s.start, s.end) for s in plan.stages]
    return TorchStages(modules=stage_modules(layers, bounds, plan.stages_of(rank)), num_stages=plan.num_stages,
                       num_microbatches=plan.num_microbatches,
                       metas=[TensorMeta(shape=shape, dtype=DTYPE)] * (plan.num_stages - 1),
                       load_input=lambda mb: torch.zeros(shape, dtype=DTYPE),
                       loss_fn=lambda out, mb: out.sum() * 0.0)


def _runner(workload: str, plan, rank: int, clock: DeviceClock):
    if workload == "sleep":
        return _sleep_runner(plan, rank, clock)
    return toy_runner(SPEC, build_layers(SPEC), plan, rank)


def worker(rank: int, world: int, port: int, docs: list[dict], steps: int, out: str) -> None:
    """One rank: for each (workload, plan), alternate the two exchanges step by step; write the step times."""
    init_gloo(rank, world, port, timeout_s=120)
    rows = []
    for doc in docs:
        plan = plan_from_dict(doc["plan"])
        clock = DeviceClock("device")
        exs = {x: PipelineExecutor(plan, _runner(doc["workload"], plan, rank, clock),
                                   options=ExecutorOptions(timeout_s=120, exchange=x)) for x in EXCHANGES}
        losses = {}
        for x, ex in exs.items():  # warm-up (connections, allocator) and the same-result check
            clock.start(time.time())
            losses[x] = ex.run_step().loss
        if losses["message"] is not None and not torch.equal(losses["message"], losses["batched"]):
            raise AssertionError(f"{doc['label']}: batched loss {losses['batched']} != {losses['message']}")
        times = alternating_step_ms(exs, steps, before_step=lambda: clock.start(time.time()))
        rows.append({"label": doc["label"], "workload": doc["workload"], "times": times})
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def alternating_step_ms(exs: dict, steps: int, before_step=None) -> dict:
    """Per executor of `exs`, `steps` step times in ms, the executors taking turns step by step (load drift hits
    all alike); a step's time is its slowest rank's. `before_step` runs right after each step's clock starts."""
    times = {k: [] for k in exs}
    for _ in range(steps):
        for k, ex in exs.items():
            dist.barrier()
            t0 = time.perf_counter()
            if before_step is not None:
                before_step()
            ex.run_step()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            times[k].append(float(took) * 1000.0)
    return times


def main(argv=None) -> int:
    """Run both exchanges on every plan and workload; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    p, m = args.devices, args.microbatches
    rng = random.Random(0)
    docs = []
    for workload in ("toy", "sleep"):
        for name, v in PLANS:
            devs = stage_devices_for(name, p, v)
            plan = make_plan(stage_devices=devs, bounds=random_bounds(len(SPEC.layers), len(devs), rng),
                             num_devices=p, num_microbatches=m, schedule=SCHEDULES[name].generate(devs, p, m))
            docs.append({"label": name, "workload": workload, "plan": plan_to_dict(plan)})
    with tempfile.TemporaryDirectory(prefix="octopipe-exchange-") as out:
        spawn(worker, p, docs, args.steps, out)
        with open(os.path.join(out, "times.json"), encoding="utf-8") as fh:
            rows = json.load(fh)
    print(f"gloo, {p} ranks, {m} micro-batches, {args.steps} steps per exchange (median of the slowest rank)")
    print(f"{'workload':<9} {'plan':<18} {'message ms':>11} {'batched ms':>11} {'batched/message':>16}")
    ratios: dict[str, list[float]] = {}
    for r in rows:
        msg, bat = (statistics.median(r["times"][x]) for x in EXCHANGES)
        ratios.setdefault(r["workload"], []).append(bat / msg)
        print(f"{r['workload']:<9} {r['label']:<18} {msg:11.1f} {bat:11.1f} {bat / msg:16.3f}")
    # the sleep workload uses no CPU: on a shared machine it is the figure load does not blur
    for workload, rs in ratios.items():
        print(f"geometric mean batched/message, {workload}: {statistics.geometric_mean(rs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
