"""Tuner at cluster scale: devices x micro-batches on a deep heterogeneous model, one table.

The model (benchmarks/deep_model.py) is Nemotron-H's Mamba / attention / MLP hybrid grown to 194
decoder layers with a DeepSeek-style MoE block every ninth layer and a 256k vocabulary (TP 8).
Each configuration runs in its own process so the peak memory column is that run's alone.

Columns: time until the tuner held a plan at least as fast as the best built-in (the fastest
fitting built-in schedule, simulated at the full micro-batch count); time until it held a plan
within 2% of its final one; final step time over the refined bound (tuner/bounds.py); search
steps; candidates judged (simulated, or timed by the compiled list scheduler) and per second;
the tuner process's peak resident memory; ok: the returned plan validates, fits memory and
replays in the simulator to its reported step time (checked after the run, outside the timings).

    PYTHONPATH=. python benchmarks/tuner_scale.py                       # full grid (long on 2 cores)
    PYTHONPATH=. python benchmarks/tuner_scale.py --devices 8 16 32 --factors 2 4
    PYTHONPATH=. python benchmarks/tuner_scale.py --devices 64 --factors 4 --budget 60
    PYTHONPATH=. python benchmarks/tuner_scale.py --write-model deep.json   # then: octopipe plan --model deep.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEVICES = (8, 16, 32, 64, 128)
FACTORS = (2, 4, 8)


def run_one(devices: int, factor: int, budget: float, seed: int) -> dict:
    """Tune one configuration in this process and collect its figures."""
    from deep_model import deep_model
    from octopipe_plugin.costs import resolve_cluster
    from octopipe_plugin.formats import validate_plan
    from octopipe_plugin.simulator import simulate
    from octopipe_plugin.tuner import tune
    from octopipe_plugin.tuner.bounds import refined_bound
    from octopipe_plugin.tuner.compare import best_builtin_ms

    model, cluster = deep_model(), resolve_cluster(f"h100x{devices}")
    m = factor * devices
    trace = []
    t0 = time.monotonic()

    def progress(p):
        trace.append((time.monotonic() - t0, p.best_ms))

    r = tune(model, cluster, m, time_budget_s=budget, seed=seed, progress=progress)
    elapsed = time.monotonic() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the returned plan, checked outside the tuner: valid, fits memory, replays to its reported step time
    validate_plan(r.plan, model.num_layers)
    res = simulate(model, cluster, r.plan, detail=False)
    sound = (abs(res.step_time_ms - r.step_ms) <= 1e-6 * r.step_ms
             and max(res.peak_memory_bytes) <= cluster.memory_bytes)
    trace.append((elapsed, r.step_ms))
    best = best_builtin_ms(r.baselines)
    rb = refined_bound(model, devices, m)

    def first(limit):
        return next((t for t, ms in trace if ms <= limit * (1 + 1e-9)), None)

    return {"devices": devices, "m": m, "step": r.step_ms, "best_builtin": best, "rb": rb,
            "t_builtin": first(best) if best is not None else None, "t_2pct": first(r.step_ms * 1.02),
            "iterations": r.iterations, "evaluations": r.evaluations, "elapsed": elapsed,
            "evals_per_s": r.evaluations / max(elapsed, 1e-9), "source": r.source, "stopped_by": r.stopped_by,
            "peak_mib": peak_mib, "sound": sound}


def _fmt(x, spec):
    return format(x, spec) if x is not None else "-"


HEADER = (f"{'D':>4} {'M':>5} {'step ms':>9} {'best b-in':>9} {'RB ms':>9} {'/RB':>6} {'t>=b-in':>7} {'t 2%':>6}"
          f" {'steps':>6} {'evals':>5} {'ev/s':>6} {'time s':>6} {'MiB':>6} {'ok':>3}  from")


def line(row: dict) -> str:
    """One table line."""
    if "error" in row:
        return f"{row['devices']:>4} {row['m']:>5}  failed: {row['error']}"
    return (f"{row['devices']:>4} {row['m']:>5} {row['step']:>9.1f} {_fmt(row['best_builtin'], '9.1f'):>9}"
            f" {row['rb']:>9.1f} {row['step'] / row['rb']:>6.3f} {_fmt(row['t_builtin'], '7.1f'):>7}"
            f" {_fmt(row['t_2pct'], '6.1f'):>6} {row['iterations']:>6} {row['evaluations']:>5}"
            f" {row['evals_per_s']:>6.1f} {row['elapsed']:>6.1f} {row['peak_mib']:>6.0f}"
            f" {'yes' if row.get('sound', True) else 'NO':>3}  {row['source']}")


def main(argv=None) -> int:
    """Run the chosen grid, one configuration per process, and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="*", type=int, default=list(DEVICES), help="pipeline devices (8 16 32 64 128)")
    ap.add_argument("--factors", nargs="*", type=int, default=list(FACTORS), help="micro-batches per device (2 4 8)")
    ap.add_argument("--budget", type=float, default=60.0, help="tuner time budget per configuration (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-model", metavar="PATH", help="write the deep model as an octopipe-model/1 file and stop")
    ap.add_argument("--one", nargs=2, type=int, metavar=("DEVICES", "FACTOR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_model:
        from deep_model import deep_model
        from octopipe_plugin.formats import write_model

        write_model(deep_model(), args.write_model)
        print(f"wrote {args.write_model}")
        return 0
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.budget, args.seed)))
        return 0
    print(f"budget {args.budget:g} s per configuration, seed {args.seed}; load average at start "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    print(HEADER, flush=True)
    for d in args.devices:
        for f in args.factors:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(d), str(f), "--budget", str(args.budget),
                   "--seed", str(args.seed)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            try:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                row = {"devices": d, "m": d * f, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            print(line(row), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
