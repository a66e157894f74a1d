"""Overlapped pairs on the dry run's stand-ins: each phase sleeps on its resource, the hiding is measured.

SleepStages.pair sleeps compute phases on the calling thread and communication phases on the
rank's link thread (executor/standin.py), in simulator/pairs.overlap_ms's order; the device
clock charges the pair its measured span (executor/clock.py DeviceClock.overlapped).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from octopipe_plugin.actions import B, F, I
from octopipe_plugin.executor.dryrun import dry_run, scaled_model, zero_cost_cluster
from octopipe_plugin.executor.standin import SleepStages, StandInCosts
from octopipe_plugin.formats import Stage
from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.simulator.pairs import overlap_ms, stage_phases
from octopipe_plugin.testing.pair_plans import phased_model


MOE = phased_model(8)


def _one_stage(model, scale: float):
    stages = (Stage(start=0, end=model.num_layers, device=0),)
    phases = stage_phases(scaled_model(model, scale), stages)
    fwd = sum(lay.fwd_ms for lay in model.layers) * scale
    bwd = sum(lay.bwd_ms for lay in model.layers) * scale
    wgrad = sum(lay.wgrad_ms for lay in model.layers) * scale
    return StandInCosts(fwd=(fwd,), bwd=(bwd,), wgrad=(wgrad,), hop=(0.0,), phases=phases), phases


@pytest.mark.parametrize("kind", ["B", "I"])
def test_a_stand_in_pair_lasts_its_overlapped_phases(kind):
    """One stage that is first and last: F1+B0 (or F1+I0) sleeps overlap_ms of its phases, not their sum."""
    model = phased_model(2)
    costs, phases = _one_stage(model, 2.0)
    second = B(0, 0) if kind == "B" else I(0, 0)
    seq_f, seq_b = phases.of(F(0, 1).kind, 0), phases.of(second.kind, 0)
    want = overlap_ms(seq_f, seq_b)
    whole = sum(ms for _, ms in seq_f) + sum(ms for _, ms in seq_b)
    assert want < 0.8 * whole
    runner = SleepStages(costs=costs, rank=0)
    try:
        tries = []
        for _ in range(3):  # the least of three: a host shared with other jobs may stall one
            runner.start(time.time())
            t0 = time.time()
            out_f, out_b = runner.pair(F(0, 1), None, second, None)
            took = (time.time() - t0) * 1000.0
            tries.append(took)
            assert out_b is None and float(out_f) == 0.0  # the loss of the only stage
            assert runner.device.free == pytest.approx(t0 + took / 1000.0, abs=0.003)
        assert runner.pairs_run == 3
        assert want * 0.98 <= min(tries) <= want * 1.1 + 1.0, (tries, want, whole)
    finally:
        runner.close()


def test_a_stand_in_pair_without_phases_sleeps_both_costs():
    costs = StandInCosts(fwd=(6.0,), bwd=(8.0,), wgrad=(4.0,), hop=(0.0,))
    runner = SleepStages(costs=costs, rank=0)
    tries = []
    for _ in range(3):
        runner.start(time.time())
        t0 = time.time()
        runner.pair(F(0, 1), None, B(0, 0), None)
        tries.append((time.time() - t0) * 1000.0)
    assert 18.0 * 0.98 <= min(tries) <= 18.0 * 1.1 + 1.0, tries


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_dry_run_of_a_paired_plan_meets_its_prediction_and_beats_the_unpaired_one():
    """DualPipeV (its pairs) on a MoE toy model (all-to-alls: half of F, a third of I): the dry run lands
    within the dry run's tolerance of the simulator's prediction, and measurably faster than the same plan
    without pairs (whose dry run also meets its own prediction)."""
    plan = build_plan(MOE, "dualpipev", 2, 6)
    assert len(plan.pairs) >= 8
    unpaired = replace(plan, pairs=())
    cluster = replace(zero_cost_cluster(2), memory_bytes=1 << 40)
    sim_paired = simulate(MOE, cluster, plan).step_time_ms
    sim_unpaired = simulate(MOE, cluster, unpaired).step_time_ms
    assert sim_paired < 0.9 * sim_unpaired
    scale = 1000.0 / sim_unpaired  # the unpaired step lasts 1 s
    paired_run = dry_run(MOE, plan, time_scale=scale)
    unpaired_run = dry_run(MOE, unpaired, time_scale=scale)
    print(f"paired: predicted {paired_run.predicted_ms:.1f} ms, measured {paired_run.measured_ms:.1f} ms "
          f"({100 * paired_run.error:+.2f}%); unpaired: predicted {unpaired_run.predicted_ms:.1f} ms, measured "
          f"{unpaired_run.measured_ms:.1f} ms ({100 * unpaired_run.error:+.2f}%)")
    assert paired_run.predicted_ms == pytest.approx(sim_paired * scale, rel=1e-9)
    assert abs(paired_run.error) < 0.05
    assert abs(unpaired_run.error) < 0.05
    assert paired_run.measured_ms < 0.92 * unpaired_run.measured_ms
