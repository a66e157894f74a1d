"""MoE overlap benchmark: what overlapped F&B pairs buy a DeepSeek-class model with expert parallelism.

For each case (deepseek-v3-mini, EP 8, M = 2D on h100x16: the EP group inside a node, its all-to-alls on
NVLink; and inside two nodes, `ep_nodes` 2, its all-to-alls on the inter-node link as DeepSeek-V3's
cross-node EP) it tunes the plan with pairs (the model's MoE layers carry their dispatch / combine
all-to-all phases, so the tuner pairs where the simulator says it pays; split layers considered) and
the best plan without pairs (the same tuner on the same model with the phases taken out: unpaired
plans price the same either way, every all-to-all exposed), and prices the two built-ins that hide the
all-to-all: DualPipeV (its overlapped F&B steps as pairs) and Megatron's combined 1F1B
(`--overlap-moe-expert-parallel-comm`, every v and both splits, the fastest that fits). Per case:

    overlap gain X over the best plan without pairs, Y over DualPipeV, Z over Megatron combined 1F1B (simulated)
    dryrun measured X' (simulated X)

The dry run runs both tuned plans on 16 local processes with sleeping stand-ins (executor/standin.py:
each action sleeps its scaled cost; a pair sleeps its compute phases on the rank's thread and its
all-to-all phases on a link thread, so what it hides is measured, not assumed) and compares the
measured ratio of their steps with the simulated one. The figure measures the executor's mechanics of
ordering and hiding on this host, not a GPU's kernels or an all-to-all's real time. Each plan runs
`--repeats` times at a scaled step of `--target-s` seconds and the fastest run counts: on a loaded host
a sleeping stand-in only wakes late, so noise lengthens a step and never shortens it.

Also per case: each plan's step taken apart (device means: compute, the all-to-all it waits on, idle),
and the bound of the gain: the plan without pairs with every all-to-all free (`--bound`: also a plan
tuned for the model with free all-to-alls, which no paired plan can beat).

    PYTHONPATH=. python benchmarks/moe_overlap.py
    PYTHONPATH=. python benchmarks/moe_overlap.py --budget 60 --no-dryrun --bound
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace

from octopipe_plugin.costs import resolve_cluster
from octopipe_plugin.costs.analytic import build_model
from octopipe_plugin.costs.zoo import load_arch
from octopipe_plugin.errors import OctoPipeError, PlanError
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.pairs import hidden_ms, stage_phases
from octopipe_plugin.simulator.split import without_split_layers
from octopipe_plugin.tuner.split import tune_split

CASES = (("h100x16, EP 8 in a node", "h100x16", 1), ("h100x16, EP 8 over 2 nodes", "h100x16", 2))


def without_phases(model):
    """The model with every layer's phases taken out: the same unpaired prices, nothing a pair could hide."""
    return replace(model, layers=tuple(replace(layer, phases=()) for layer in model.layers))


def best_builtin(model, cluster, name: str, m: int, vs=(1, 2, 3, 4)):
    """(step ms, v, split) of the fastest fitting run of built-in `name`, or None."""
    best = None
    for v in vs:
        for split in ("megatron", "balanced"):
            try:
                plan = build_plan(model, name, cluster.num_devices, m, stages_per_device=v, split=split)
            except (PlanError, OctoPipeError):
                continue
            res = simulate(model, cluster, plan, detail=False)
            if max(res.peak_memory_bytes) <= cluster.usable_memory_bytes and (best is None or res.step_time_ms < best[0]):
                best = (res.step_time_ms, v, split)
    return best


def a2a_free(model):
    """The model with every all-to-all free (each layer's comm phases taken out of its times): what no plan with
    pairs can beat, the bound of what pairing gains."""
    def free(layer):
        cf, cb = layer.comm_ms
        return replace(layer, fwd_ms=layer.fwd_ms - cf, bwd_ms=layer.bwd_ms - cb, phases=())
    return replace(model, layers=tuple(free(layer) for layer in model.layers))


def step_parts(model, cluster, plan) -> tuple[float, float, float, float]:
    """(step, compute, exposed all-to-all, idle) in ms, each a mean over the devices (simulated): a device's step is
    its compute, the all-to-all time it waits on (an unpaired action's comm phases, a pair's comm less what the
    pair hides) and its idle time."""
    res = simulate(model, cluster, plan, detail=True)
    phases = stage_phases(without_split_layers(model, plan.splits), plan.stages)
    firsts, seconds = {a for a, _ in plan.pairs}, {b for _, b in plan.pairs}

    def comm(a) -> float:
        if phases is None or a.rule.side is not None or a.kind.value not in "FBI":
            return 0.0
        return sum(ms for on_link, ms in phases.of(a.kind, a.stage) if on_link)

    busy = exposed = 0.0
    for row in res.timeline:
        for a, start, end in row:
            if a in seconds:
                continue  # a pair's second half is shown over the pair: counted with its first
            busy += end - start
            if a not in firsts:
                exposed += comm(a)
    exposed += sum(comm(f) + comm(b) - hidden_ms(phases, f, b) for f, b in plan.pairs)
    nd = plan.num_devices
    step = res.step_time_ms
    return step, (busy - exposed) / nd, exposed / nd, step - busy / nd


def main(argv=None) -> int:
    """Print each case's gains (simulated) and the dry run's measured ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=30.0, help="tuner time budget per tune, seconds (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-dryrun", action="store_true", help="simulated figures only")
    ap.add_argument("--bound", action="store_true", help="also tune the model with its all-to-alls free (the bound)")
    ap.add_argument("--target-s", type=float, default=8.0,
                    help="the scaled step a dry run sleeps through (s; longer sleeps: a loaded host's wake-up delays "
                         "weigh less)")
    ap.add_argument("--repeats", type=int, default=2, help="dry runs per plan, the fastest kept (default 2)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    base = load_arch("deepseek-v3-mini")
    for label, cluster_name, ep_nodes in CASES:
        cluster = resolve_cluster(cluster_name)
        d = cluster.num_devices
        m = 2 * d
        model = build_model(replace(base, ep=8, ep_nodes=ep_nodes), cluster.gpu or "H100")
        t0 = time.monotonic()
        paired = tune_split(model, cluster, m, time_budget_s=args.budget, seed=args.seed)
        t1 = time.monotonic()
        flat = tune_split(without_phases(model), cluster, m, time_budget_s=args.budget, seed=args.seed)
        t2 = time.monotonic()
        plain = simulate(model, cluster, flat.plan, detail=False).step_time_ms
        step = paired.step_ms
        dpv = best_builtin(model, cluster, "dualpipev", m, vs=(2,))
        comb = best_builtin(model, cluster, "combined-1f1b", m)
        print(f"{label}: M={m}; tuned with pairs {step:.1f} ms ({len(paired.plan.pairs)} pairs, "
              f"{len(paired.plan.splits)} split layers, {t1 - t0:.0f} s), best without pairs {plain:.1f} ms "
              f"({t2 - t1:.0f} s); DualPipeV {dpv[0]:.1f} ms, Megatron combined 1F1B {comb[0]:.1f} ms "
              f"(v={comb[1]}, {comb[2]} split)")
        parts = {name: step_parts(model, cluster, plan) for name, plan in (("without", flat.plan), ("with", paired.plan))}
        for name, (st, comp, a2a, idle) in parts.items():
            print(f"  step {name} pairs {st:.1f} ms = compute {comp:.1f} + exposed all-to-all {a2a:.1f} + idle "
                  f"{idle:.1f} (device means; all-to-all {a2a / st:.1%} of the step)")
        free = a2a_free(model)
        bound = simulate(free, cluster, flat.plan, detail=False).step_time_ms
        line = f"  all-to-all free (the bound of the gain): the plan without pairs {bound:.1f} ms ({plain / bound:.3f})"
        if args.bound:
            tuned = tune_split(free, cluster, m, time_budget_s=args.budget, seed=args.seed).step_ms
            line += f", tuned for it {tuned:.1f} ms ({plain / tuned:.3f})"
        print(line)
        print(f"  overlap gain {plain / step:.3f} over the best plan without pairs, {dpv[0] / step:.3f} over "
              f"DualPipeV, {comb[0] / step:.3f} over Megatron combined 1F1B (simulated)")
        if args.no_dryrun:
            continue
        from octopipe_plugin.executor.dryrun import dry_run

        got = {}
        for name, plan in (("paired", paired.plan), ("unpaired", flat.plan)):
            # a loaded host only lengthens a step of sleeping stand-ins: the fastest of a few runs is the measure
            reps = [dry_run(model, plan, cluster, target_ms=args.target_s * 1000.0,
                            timeout_s=max(120.0, 4.0 * args.target_s)) for _ in range(args.repeats)]
            rep = got[name] = min(reps, key=lambda r: r.measured_ms / r.time_scale)
            print(f"  dry run {name}: measured {rep.measured_ms:.1f} ms, predicted {rep.predicted_ms:.1f} ms "
                  f"({rep.error:+.1%}, scale {rep.time_scale:.3g})")
        # both plans at their own scale: compare each measured step with its prediction, then the ratio
        measured = (got["unpaired"].measured_ms / got["unpaired"].time_scale) / (
            got["paired"].measured_ms / got["paired"].time_scale)
        print(f"  dryrun measured {measured:.3f} (simulated {plain / step:.3f})")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
