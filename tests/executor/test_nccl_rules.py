"""The NCCL-rules checker: every shipped, tuned and random plan survives NCCL with the eager warm-up; the
lazy communicators' cycle of 1F1B-like plans is found without it (no processes, no GPU)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from octopipe_plugin.errors import DeadlockError
from octopipe_plugin.executor import check_runnable, lowered_plan
from octopipe_plugin.executor.nccl_rules import check_nccl_rules, replay
from octopipe_plugin.testing.plans import make_plan, placement, sample_schedule
from octopipe_plugin.schedules.registry import SCHEDULES, stage_devices_for


def builtin(name: str, p: int, m: int, v: int | None = None):
    spec = SCHEDULES[name]
    devs = stage_devices_for(name, p, spec.stages_for(v))
    return make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(len(devs))], num_devices=p,
                     num_microbatches=m, schedule=spec.generate(devs, p, m))


def _programs(plan, prefetch: int = 2):
    return [lowered_plan(plan, r, prefetch).program for r in range(plan.num_devices)]


def _configs():
    """(name, p, m, v) for every built-in schedule at 2, 4 and 8 ranks, at its smallest and a larger m."""
    out = []
    for name, spec in SCHEDULES.items():
        for p in (2, 4, 8):
            v = spec.stages_per_device or 2  # interleaved schedules with 2 stages per device
            least = spec.min_microbatches(p, v)
            for m in sorted({least, 2 * least + 1}):
                try:
                    spec.check(p, m, v)
                except Exception:  # e.g. a round-count rule: not a configuration it serves
                    continue
                out.append((name, p, m, v))
    return out


@pytest.mark.parametrize("name,p,m,v", _configs())
def test_every_builtin_schedule_survives_nccl_with_the_eager_warm_up(name, p, m, v):
    plan = builtin(name, p, m, v)
    check_nccl_rules(plan)  # the executor's own path: per-direction communicators, warmed eagerly
    for host_waits in (True, False):  # host-blocking waits, and waits as stream dependencies
        for prefetch in (0, 2):
            assert replay(_programs(plan, prefetch), host_waits=host_waits).ok


@pytest.mark.parametrize("name,p", [("1f1b", 2), ("1f1b", 4), ("1f1b", 8), ("zb-h1", 4), ("gpipe", 4)])
def test_lazy_communicators_deadlock_1f1b_like_plans(name, p):
    plan = builtin(name, p, 2 * p)
    with pytest.raises(DeadlockError) as err:
        check_nccl_rules(plan, eager=False)
    msg, stuck = str(err.value), err.value.stuck
    assert "eager_comms=True" in msg
    # the cycle: rank r blocks creating the GRAD direction with r+1 while r+1 waits on r's ACT direction
    # (blocked creating it at its first receive, or, GPipe, waiting for an activation r can no longer send)
    assert any(stuck.get(r, "").startswith(f"creating communicator r{r + 1}->r{r}") and "GRAD" in stuck[r]
               and f"ACT {r}F" in stuck.get(r + 1, "") and f"from r{r}" in stuck[r + 1] for r in range(p - 1)), msg
    with pytest.raises(DeadlockError):
        check_runnable(plan, nccl=True, eager_comms=False)
    check_runnable(plan, nccl=True)


def test_one_communicator_for_both_directions_deadlocks_even_when_created():
    # why each direction has its own group: rank 0's GRAD receive heads the shared queue before its ACT send
    plan = builtin("1f1b", 2, 4)
    result = replay(_programs(plan), pair_groups=False, eager=True)
    assert not result.ok and set(result.stuck) == {0, 1}


def _tuned(p: int, m: int, seed: int):
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.formats import Layer, Model
    from octopipe_plugin.tuner import tune

    layers = tuple(Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + (i % 4) * 0.7, bwd_ms=1.2 + (i % 3) * 0.5,
                         wgrad_ms=0.9, state_bytes=1 << 20, activation_bytes=1 << 20, output_bytes=1 << 20)
                   for i in range(12))
    cluster = replace(zero_cost_cluster(p), memory_bytes=1 << 40)
    return tune(Model(name="nccl12", layers=layers), cluster, m, time_budget_s=10, iterations=30, seed=seed).plan


@pytest.mark.parametrize("p,m", [(2, 5), (3, 6), (4, 8)])
def test_tuned_plans_survive_nccl_with_the_eager_warm_up(p, m):
    plan = _tuned(p, m, seed=p)
    check_nccl_rules(plan)
    assert replay(_programs(plan), host_waits=False).ok


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.integers(2, 8), v=st.integers(1, 3), m=st.integers(1, 8),
       kind=st.sampled_from(["looped", "v", "arbitrary"]), prefetch=st.integers(0, 3))
def test_random_plans_survive_nccl_with_the_eager_warm_up(seed, p, v, m, kind, prefetch):
    rng = random.Random(seed)
    devs = placement(kind, p * v, p, rng)
    plan = make_plan(stage_devices=devs, bounds=[(i, i + 1) for i in range(p * v)], num_devices=p,
                     num_microbatches=m, schedule=sample_schedule(devs, p, m, rng))
    check_runnable(plan)
    for host_waits in (True, False):
        assert replay(_programs(plan, prefetch), host_waits=host_waits).ok
