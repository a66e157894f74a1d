"""Random plans with random overlapped pairs: refused by name (DeadlockError), or they simulate, lower and run.

Plans come from built-in schedules (their own pairs dropped) and from random valid orders on
looped, V and arbitrary placements; pairs are random adjacent F then B/I of two micro-batches on
one device, or a B/I moved right after such an F (testing/pair_plans.py). A pair waits for both
inputs before either half starts, so pairing can make a plan hang: the simulator's deadlock check
must say so (DeadlockError, both with unit costs and priced). Otherwise the plan simulates on a
model whose layers communicate, every rank lowers (executor.program.build_program, the host
operations of posting.rank_ops) and the NCCL-rules replay finishes; a fixed couple of them
dry-run to the end (gloo, sleeping stand-ins) near their prediction.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.executor import build_program, check_runnable
from octopipe_plugin.executor.dryrun import dry_run, zero_cost_cluster
from octopipe_plugin.executor.nccl_rules import replay
from octopipe_plugin.executor.posting import OpKind, rank_ops
from octopipe_plugin.schedules.registry import SCHEDULES, build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.testing.pair_plans import move_pairs, phased_model, random_pairs
from octopipe_plugin.testing.plans import random_plan

LAYERS = 8
MODEL = phased_model(LAYERS)
BUILTINS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev", "combined-1f1b")


def random_paired_plan(seed: int, source: str, how: str):
    """A random plan of `source` ('builtin' or a placement) with random pairs made `how` ('adjacent' or 'move')."""
    rng = random.Random(seed)
    p = rng.randint(1 if source == "arbitrary" else 2, 3)
    if source == "builtin":
        names = [n for n in BUILTINS if n in SCHEDULES]
        name = names[rng.randrange(len(names))]
        v = SCHEDULES[name].stages_for(None)
        m = rng.randint(max(1, p if name in ("dualpipev", "zb-v", "interleaved-1f1b") else 1), 2 * p + 2)
        try:
            plan = build_plan(MODEL, name, p, m)
        except Exception:  # a count this schedule does not take
            plan = build_plan(MODEL, name, p, 2 * p * v)
        plan = replace(plan, pairs=())
    else:
        ns = rng.randint(p, min(LAYERS, 2 * p)) if source == "arbitrary" else 2 * p
        plan = random_plan(rng, num_devices=p, num_layers=LAYERS, num_stages=ns,
                           num_microbatches=rng.randint(2, 2 * p + 2), placement_kind=source)
    if how == "adjacent":
        return random_pairs(plan, rng, prob=rng.choice((0.3, 0.7, 1.0)))
    return random_pairs(move_pairs(plan, rng, count=rng.randint(1, 4)), rng, prob=0.3)


def _cluster(p: int):
    return replace(zero_cost_cluster(p), memory_bytes=1 << 40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), source=st.sampled_from(["builtin", "looped", "v", "arbitrary"]),
       how=st.sampled_from(["adjacent", "move"]))
def test_random_pairs_are_refused_by_name_or_simulate_and_lower(seed, source, how):
    plan = random_paired_plan(seed, source, how)
    try:
        check_runnable(plan)
    except DeadlockError:
        with pytest.raises(DeadlockError):  # priced, it hangs all the same: deadlock does not depend on durations
            simulate(MODEL, _cluster(plan.num_devices), plan, detail=False)
        return
    sim = simulate(MODEL, _cluster(plan.num_devices), plan)
    assert sim.step_time_ms > 0
    for d, row in enumerate(plan.schedule):  # both halves of a pair over one span on the timeline
        spans = {a: (t0, t1) for a, t0, t1 in sim.timeline[d]}
        for a, b in plan.pairs:
            if a in spans:
                assert spans[a] == spans[b]
    programs = [build_program(plan, r) for r in range(plan.num_devices)]
    for prog in programs:
        assert len(prog.steps) == len(plan.schedule[prog.rank])
        ops = rank_ops(prog)
        assert sum(op.kind is OpKind.COMPUTE for op in ops) == len(prog.steps)
        assert sum(op.overlapped for op in ops) == len(prog.pair_starts)
    assert sum(len(p.pair_starts) for p in programs) == len(plan.pairs)
    got = replay(programs, pair_groups=True, eager=True, host_waits=True)
    assert got.ok, got.stuck


def _runnable_examples(count: int):
    """The first `count` runnable paired plans of a fixed seed sequence (V placements and built-ins, 2 devices)."""
    out = []
    for seed in range(200):
        plan = random_paired_plan(seed, ("v", "builtin")[seed % 2], ("adjacent", "move")[seed // 2 % 2])
        if not plan.pairs or plan.num_devices > 2:
            continue
        try:
            check_runnable(plan)
        except DeadlockError:
            continue
        out.append(plan)
        if len(out) == count:
            break
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_fixed_couple_of_random_paired_plans_dry_run_without_deadlock():
    plans = _runnable_examples(2)
    assert len(plans) == 2
    for plan in plans:
        report = dry_run(MODEL, plan, target_ms=400.0, timeout_s=30.0)
        assert report.messages_checked > 0
        assert abs(report.error) < 0.1, (report.predicted_ms, report.measured_ms, plan.pairs)
