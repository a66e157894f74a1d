"""Memory levers benchmark: what per-layer recompute and offload, chosen by the tuner, buy at long sequences.

For gemma3 at 32k sequence and deepseek-v3-mini at 8k, on h100x8 and h100x16 (M = 2D, 8% headroom: what
`octopipe plan` keeps free), it tunes the plan with memory choices (`tune(memory=AUTO)`: recompute, selective
recompute and offload where the simulator says a faster schedule then fits; tuner/memory_choices.py) and the best
plan without them (the same tuner and seed, `memory=NONE`), and prices Megatron's interleaved 1F1B with full
recompute (the model costed with `recompute: true`, every v of 1-4 and both splits, the fastest that fits). Per case:

    memory choices gain X over the best plan without them, Y over Megatron I-1F1B with full recompute (simulated);
    peak P of C GiB

(C: device memory less the headroom), then which stages got which choices, and with `--bound` the plan tuned as
if memory were unlimited: no memory choice can gain more than that over the plan without them. With `--dryrun`
the first tuned plan with choices (where none has any: gemma3 at 64k on h100x8, where memory binds and the tuner
takes selective recompute) runs on one local process per device with sleeping stand-ins that hold its scaled
activation bytes (executor/standin_memory.py):

    dryrun: step predicted P ms, measured M ms (E%); measured peak within E%

    PYTHONPATH=. python benchmarks/memory_levers.py
    PYTHONPATH=. python benchmarks/memory_levers.py --budget 10 --bound
"""

from __future__ import annotations

import argparse
import logging
import math
from collections import Counter
from dataclasses import replace

from octopipe_plugin.costs import resolve_cluster
from octopipe_plugin.costs.analytic import build_model
from octopipe_plugin.costs.zoo import load_arch
from octopipe_plugin.errors import OctoPipeError, PlanError
from octopipe_plugin.headroom import parse_headroom, with_headroom
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.memory_choices import AUTO, NONE

CASES = (("gemma3", 32768), ("deepseek-v3-mini", 8192))
CLUSTERS = ("h100x8", "h100x16")
GIB = float(1 << 30)


def megatron_full_recompute(arch, cluster, m: int):
    """(step ms, v, split) of the fastest fitting Megatron interleaved 1F1B (v = 1: 1F1B) of the model costed with
    full recompute, or None."""
    model = build_model(replace(arch, recompute=True), cluster.gpu or "H100")
    best = None
    for v in (1, 2, 3, 4):
        for split in ("megatron", "balanced"):
            try:
                plan = build_plan(model, "interleaved-1f1b", cluster.num_devices, m, stages_per_device=v, split=split)
            except (PlanError, OctoPipeError):
                continue
            res = simulate(model, cluster, plan, detail=False)
            if max(res.peak_memory_bytes) <= cluster.usable_memory_bytes and (best is None or res.step_time_ms < best[0]):
                best = (res.step_time_ms, v, split)
    return best


def stage_choices(plan) -> list[str]:
    """Per stage with choices: 'stage s [a,b)@d: 3 recompute, 1 selective:layernorm'."""
    memory = dict(plan.memory)
    out = []
    for s, st in enumerate(plan.stages):
        got = Counter(memory[i].text for i in range(st.start, st.end) if i in memory)
        if got:
            what = ", ".join(f"{n} {t}" for t, n in sorted(got.items()))
            out.append(f"stage {s} [{st.start},{st.end})@{st.device}: {what}")
    return out


def main(argv=None) -> int:
    """Print each case's gains (simulated), its peak and its stages' choices."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=30.0, help="tuner time budget per tune, seconds (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bound", action="store_true", help="also tune with unlimited memory (what no lever can beat)")
    ap.add_argument("--dryrun", action="store_true", help="dry-run one tuned plan with memory choices")
    ap.add_argument("--target-s", type=float, default=3.0, help="the scaled step a dry run sleeps through (s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    xs, ys, ok, chosen = [], [], True, None
    for name, seq in CASES:
        arch = replace(load_arch(name), seq_len=seq)
        for cluster_name in CLUSTERS:
            cluster = with_headroom(resolve_cluster(cluster_name), parse_headroom("8%"))
            d = cluster.num_devices
            m = 2 * d
            model = build_model(arch, cluster.gpu or "H100")
            with_ = tune(model, cluster, m, time_budget_s=args.budget, seed=args.seed, memory=AUTO)
            without = tune(model, cluster, m, time_budget_s=args.budget, seed=args.seed, memory=NONE)
            mega = megatron_full_recompute(arch, cluster, m)
            res = simulate(model, cluster, with_.plan, detail=False)
            peak = max(res.peak_memory_bytes)
            x = without.step_ms / with_.step_ms
            y = mega[0] / with_.step_ms if mega else float("nan")
            xs.append(x)
            ys.append(y)
            ok &= peak <= cluster.usable_memory_bytes
            print(f"{name} {seq // 1024}k on {cluster_name} (M={m}): with choices {with_.step_ms:.1f} ms, without "
                  f"{without.step_ms:.1f} ms, Megatron I-1F1B full recompute "
                  + (f"{mega[0]:.1f} ms (v={mega[1]}, {mega[2]} split)" if mega else "does not fit"))
            print(f"  memory choices gain {x:.3f} over the best plan without them, {y:.3f} over Megatron I-1F1B "
                  f"with full recompute (simulated); peak {peak / GIB:.1f} of {cluster.usable_memory_bytes / GIB:.1f} GiB")
            if with_.plan.memory and chosen is None:
                chosen = (model, cluster, with_.plan)
            for line in stage_choices(with_.plan) or ["no memory choice pays"]:
                print(f"    {line}")
            if args.bound:
                free = tune(model, replace(cluster, memory_bytes=1 << 50), m, time_budget_s=args.budget,
                            seed=args.seed)
                print(f"  unlimited memory {free.step_ms:.1f} ms: no memory choice gains more than "
                      f"{without.step_ms / free.step_ms:.3f} here")
    geo = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
    print(f"geometric mean: gain {geo(xs):.3f} over the best plan without choices, {geo(ys):.3f} over Megatron "
          f"I-1F1B with full recompute; every peak under capacity - headroom: {'yes' if ok else 'NO'}")
    if args.dryrun:
        dryrun(chosen, args)
    return 0


def dryrun(chosen, args) -> None:
    """Dry-run a tuned plan with memory choices (`chosen`, else gemma3 64k on h100x8's) and print the comparison."""
    from octopipe_plugin.executor.dryrun import dry_run

    if chosen is None:
        cluster = with_headroom(resolve_cluster("h100x8"), parse_headroom("8%"))
        model = build_model(replace(load_arch("gemma3"), seq_len=65536), cluster.gpu or "H100")
        res = tune(model, cluster, 2 * cluster.num_devices, time_budget_s=args.budget, seed=args.seed, memory=AUTO)
        chosen = (model, cluster, res.plan)
        print(f"gemma3 64k on h100x8 (M=16): tuned with choices {res.step_ms:.1f} ms")
        for line in stage_choices(res.plan) or ["no memory choice"]:
            print(f"    {line}")
    model, cluster, plan = chosen
    rep = dry_run(model, plan, cluster, target_ms=args.target_s * 1000.0, timeout_s=max(60.0, 10 * args.target_s))
    print(f"dryrun: step predicted {rep.predicted_ms:.1f} ms, measured {rep.measured_ms:.1f} ms "
          f"({100 * rep.error:+.2f}%); measured peak within {100 * rep.peak_error:.1f}% (predicted "
          f"{', '.join(f'{p / 2**20:.1f}' for p in rep.predicted_peak_bytes)} MiB, measured "
          f"{', '.join(f'{m / 2**20:.1f}' for m in rep.measured_peak_bytes)} MiB at bytes x {rep.byte_scale:.3g})")


if __name__ == "__main__":
    raise SystemExit(main())
