"""Periodic steady state: grown schedules equal the generators' own, and the tuner's long plans are sound."""

from __future__ import annotations

import pytest

from octopipe_plugin.formats import validate_plan
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.compare import best_builtin_ms
from octopipe_plugin.tuner.listsched import Policy, Split
from octopipe_plugin.tuner.periodic import extend_schedule, scale_policy
from octopipe_plugin.tuner.search import search_count

from tuner_helpers import cluster, hetero_model

CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("interleaved-zb", 1), ("zb-v", 2)]


@pytest.mark.parametrize("name,v", CASES)
@pytest.mark.parametrize("target", [20, 24, 44])
def test_grown_builtin_equals_the_generators_own_order(name, v, target):
    """The generator at the larger count is the oracle: warm-up, repeated steady state and cool-down."""
    model = hetero_model(16)
    short = build_plan(model, name, 4, 16, stages_per_device=v, split="balanced")
    full = build_plan(model, name, 4, target, stages_per_device=v, split="balanced")
    assert extend_schedule(short.schedule, 16, target) == full.schedule


def test_no_steady_state_gives_none():
    """A row whose order never repeats (all forwards, then all backwards: GPipe) is not grown by guesswork."""
    model = hetero_model(8)
    short = build_plan(model, "gpipe", 2, 6, split="balanced")
    assert extend_schedule(short.schedule, 6, 12) is None


def test_fewer_microbatches_than_built_is_refused():
    model = hetero_model(8)
    short = build_plan(model, "1f1b", 2, 8, split="balanced")
    assert extend_schedule(short.schedule, 8, 4) is None
    assert extend_schedule(short.schedule, 8, 8) is short.schedule


def test_scale_policy_grows_only_the_unlimited_entries():
    pol = Policy(depth=(8, 3), split=(Split.AUTO, Split.FUSED), w_limit=(16, 2))
    big = scale_policy(pol, 8, 32)
    assert big.depth == (32, 3) and big.w_limit == (64, 2) and big.split == pol.split


@pytest.fixture(scope="module")
def long_run():
    model, cl = hetero_model(14), cluster(4, memory_gib=40)
    m = 40  # ten per device: the search runs at four per device and grows its best to 40
    assert search_count(m, 4) == 16
    return model, cl, m, tune(model, cl, m, iterations=60, seed=3)


def test_long_plan_is_valid_fits_and_replays(long_run):
    model, cl, m, r = long_run
    assert r.plan.num_microbatches == m
    validate_plan(r.plan, model.num_layers)
    res = simulate(model, cl, r.plan)
    assert res.step_time_ms == pytest.approx(r.step_ms, abs=1e-6)
    assert max(res.peak_memory_bytes) <= cl.memory_bytes
    assert r.step_ms <= best_builtin_ms(r.baselines) + 1e-9


def test_long_run_baselines_are_simulated_at_the_full_count(long_run):
    """Each built-in's figures are those of its own full-count plan, not of the short one."""
    model, cl, m, r = long_run
    for b in r.baselines:
        if b.outcome is None or b.name == "dualpipev":
            continue
        plan = build_plan(model, b.name, 4, m, stages_per_device=b.stages_per_device, split=b.split)
        assert simulate(model, cl, plan, detail=False).step_time_ms == pytest.approx(b.outcome.step_ms, abs=1e-6)


def test_long_run_is_deterministic(long_run):
    model, cl, m, r = long_run
    again = tune(model, cl, m, iterations=60, seed=3)
    assert again.plan.stages == r.plan.stages and again.plan.schedule == r.plan.schedule
