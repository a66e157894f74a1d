"""The honest references: the best plan stock Megatron / DeepSpeed run, boundaries refined by a deterministic climb."""

from __future__ import annotations

import time

from octopipe_plugin.schedules.registry import build_plan
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner import tune
from octopipe_plugin.tuner.native import native_best, native_runs

from tuner_helpers import cluster, hetero_model


def test_references_are_native_fitting_and_refined_never_worse():
    model, cl = hetero_model(14), cluster(4, memory_gib=40.0)
    res = tune(model, cl, 8, iterations=20, seed=0)
    for fw, names in (("megatron", {"interleaved-1f1b", "1f1b"}), ("deepspeed", {"1f1b"})):
        plain = native_best(res.baselines, fw)
        runs = native_runs(res.baselines, fw)
        assert plain is not None and {r.schedule for r in runs} <= names
        if fw == "deepspeed":
            assert {r.stages_per_device for r in runs} == {1}
        best = native_best(res.baselines, fw, model, cl, 8)
        assert best.step_ms <= plain.step_ms + 1e-9
        assert best == native_best(res.baselines, fw, model, cl, 8)  # deterministic
        if best.moves:  # the refined boundaries, re-simulated under the same schedule, give the figures
            plan = build_plan(model, best.schedule, 4, 8, stages_per_device=best.stages_per_device,
                              boundaries=list(best.bounds))
            sim = simulate(model, cl, plan)
            assert abs(sim.step_time_ms - best.step_ms) < 1e-6 and max(sim.peak_memory_bytes) == best.peak_bytes
            assert max(sim.peak_memory_bytes) <= cl.usable_memory_bytes


def test_refinements_keep_to_their_action_cap_and_deadline():
    model, cl = hetero_model(14), cluster(4, memory_gib=40.0)
    res = tune(model, cl, 8, iterations=20, seed=0)
    fw = "megatron"
    plain = min(native_runs(res.baselines, fw), key=lambda r: r.step_ms)
    # no actions, or a deadline already passed: every run stands as the built-in ran it
    for kwargs in ({"max_actions": 0}, {"deadline": time.monotonic() - 1.0}):
        got = native_best(res.baselines, fw, model, cl, 8, **kwargs)
        assert got.moves == 0 and got.step_ms == plain.step_ms
    free = native_best(res.baselines, fw, model, cl, 8)
    assert native_best(res.baselines, fw, model, cl, 8, max_actions=float("inf"), deadline=time.monotonic() + 600) == free
