"""Print the simulator's speed: actions simulated per second, and the time of a 16 x 64 x 2 plan.

Run: PYTHONPATH=. python benchmarks/sim_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import time

from octopipe_plugin.formats import Cluster, Layer, Link, Model
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import SimOptions, simulate, stage_costs


def _model(num_layers: int) -> Model:
    """A uniform decoder of `num_layers` layers with realistic byte counts, so transfers cost something."""
    layer = dict(kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=1 << 30,
                 activation_bytes=1 << 28, output_bytes=1 << 25)
    return Model(name="bench", layers=tuple(Layer(name=f"l{i}", **layer) for i in range(num_layers)))


def _cluster(n: int) -> Cluster:
    return Cluster(num_devices=n, devices_per_node=8, memory_bytes=80 << 30,
                   intra_node=Link(bandwidth_gb_per_s=200, latency_us=10),
                   inter_node=Link(bandwidth_gb_per_s=25, latency_us=20))


def _time(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls, in ms (the minimum is the least noisy figure)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000.0


def main() -> None:
    """Print one line per (schedule, switches, detail) case; costs are folded once unless the line says so."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    devices, mbs = 16, 64
    model, cluster = _model(64), _cluster(devices)
    print(f"plan: {devices} devices x {mbs} micro-batches x 2 stages per device (target < 20 ms)")
    for name in ("interleaved-1f1b", "combined-1f1b", "zb-v", "dualpipev"):
        plan = build_plan(model, name, devices, mbs, 2)
        costs = stage_costs(model, plan.stages)
        n_actions = sum(len(row) for row in plan.schedule)
        for label, opts in (("reference", SimOptions()),
                            ("contention+no-overlap+launch", SimOptions(contention=True, overlap=False,
                                                                      launch_ms=0.005))):
            for detail in (False, True):
                ms = _time(lambda: simulate(model, cluster, plan, opts, costs=costs, detail=detail), args.repeat)
                print(f"{name:17s} {label:29s} detail={detail!s:5s} {n_actions:6d} actions "
                      f"{ms:7.2f} ms  {n_actions / ms * 1000:10.0f} actions/s")
        ms = _time(lambda: simulate(model, cluster, plan), args.repeat)
        print(f"{name:17s} {'reference, stage costs folded':29s} detail=True  {n_actions:6d} actions {ms:7.2f} ms")


if __name__ == "__main__":
    main()
