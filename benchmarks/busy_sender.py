"""Giving the core up after posting a send (executor/comm.py `give_way`) against not: step times side by side on gloo.

Usage: PYTHONPATH=. python benchmarks/busy_sender.py [--devices 2] [--microbatches 8] [--steps 12]

A gloo sender that computes on at once after posting a message keeps gloo's device-loop thread,
which writes most messages, from a core (profile/overheads.py measures the delay per message).
Same plans, same processes, the executor with `yield_after_send` on and off alternating step by
step (load drift hits both alike), on the toy model's real layers sized like benchmarks/fidelity.py's
(hidden 256, 256 tokens: 262 KB per message). A step's time is the slowest rank's; the table
prints the median per setting and on/off (below 1.0: giving way is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from octopipe_plugin.executor import ExecutorOptions, PipelineExecutor  # noqa: E402
from octopipe_plugin.executor.launch import init_gloo, spawn  # noqa: E402
from octopipe_plugin.formats import plan_from_dict, plan_to_dict  # noqa: E402
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for  # noqa: E402
from octopipe_plugin.testing.checks import toy_runner  # noqa: E402
from octopipe_plugin.testing.plans import make_plan, random_bounds  # noqa: E402
from octopipe_plugin.testing.toy import ToySpec, build_layers  # noqa: E402

from exchange_lanes import alternating_step_ms  # noqa: E402  (the same side-by-side timing loop)

SPEC = ToySpec(hidden=256, seq=256, batch=1, dtype=torch.float32,
               layers=("in", "mlp", "attn", "mlp", "attn", "mlp", "attn", "mlp", "attn", "head"))
PLANS = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2))
SETTINGS = (True, False)


def worker(rank: int, world: int, port: int, docs: list[dict], steps: int, out: str) -> None:
    """One rank: per plan, alternate giving way and not step by step; write the step times."""
    init_gloo(rank, world, port, timeout_s=120)
    rows = []
    for doc in docs:
        plan = plan_from_dict(doc["plan"])
        exs = {y: PipelineExecutor(plan, toy_runner(SPEC, build_layers(SPEC), plan, rank),
                                   options=ExecutorOptions(timeout_s=120, yield_after_send=y)) for y in SETTINGS}
        for ex in exs.values():  # warm-up: connections, allocator
            ex.run_step()
        times = {str(y): ms for y, ms in alternating_step_ms(exs, steps).items()}  # JSON keys
        rows.append({"label": doc["label"], "times": times})
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main(argv=None) -> int:
    """Run every plan both ways; print the table and the load average."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    p, m = args.devices, args.microbatches
    rng = random.Random(0)
    docs = []
    for name, v in PLANS:
        devs = stage_devices_for(name, p, v)
        plan = make_plan(stage_devices=devs, bounds=random_bounds(len(SPEC.layers), len(devs), rng),
                         num_devices=p, num_microbatches=m, schedule=SCHEDULES[name].generate(devs, p, m))
        docs.append({"label": name, "plan": plan_to_dict(plan)})
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="octopipe-busy-sender-") as out:
        spawn(worker, p, docs, args.steps, out)
        with open(os.path.join(out, "times.json"), encoding="utf-8") as fh:
            rows = json.load(fh)
    print(f"gloo, {p} ranks, {m} micro-batches, {args.steps} steps per setting (median of the slowest rank); "
          f"load average {before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"{'plan':<18} {'give way ms':>12} {'no yield ms':>12} {'on/off':>8}")
    ratios = []
    for r in rows:
        on, off = (statistics.median(r["times"][str(y)]) for y in SETTINGS)
        ratios.append(on / off)
        print(f"{r['label']:<18} {on:12.1f} {off:12.1f} {on / off:8.3f}")
    print(f"geometric mean on/off: {statistics.geometric_mean(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
