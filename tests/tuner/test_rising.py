"""Rising layouts (tuner/rising.py): the tuned stage sizes handed out in ascending order along the pipeline, where
pairs hide communication; nothing changes for models that do not communicate."""

from __future__ import annotations

from dataclasses import replace

from octopipe_plugin.formats import Plan, Stage, validate_plan
from octopipe_plugin.formats.model import Layer, Model, Phase
from octopipe_plugin.simulator import simulate
from octopipe_plugin.tuner.rising import rising_layout, rising_plans
from octopipe_plugin.tuner.split import tune_split

from tuner_helpers import cluster

MIB = 1 << 20


def _moe(phases: bool = True) -> Layer:
    ph = (Phase(name="a", resource="compute", fwd_ms=1, bwd_ms=1), Phase(name="d", resource="comm", fwd_ms=1, bwd_ms=1),
          Phase(name="e", resource="compute", fwd_ms=1, bwd_ms=1), Phase(name="c", resource="comm", fwd_ms=1, bwd_ms=1))
    return Layer(name="moe", kind="moe", fwd_ms=4, bwd_ms=4, wgrad_ms=1, state_bytes=MIB, activation_bytes=MIB,
                 output_bytes=MIB, phases=ph if phases else ())


def _model(n: int = 9, phases: bool = True) -> Model:
    emb = Layer(name="emb", kind="embedding", fwd_ms=0.1, bwd_ms=0.0, wgrad_ms=0.5, state_bytes=MIB,
                activation_bytes=MIB, output_bytes=MIB)
    head = Layer(name="head", kind="lm_head", fwd_ms=6, bwd_ms=6, wgrad_ms=3, state_bytes=MIB, activation_bytes=MIB,
                 output_bytes=MIB)
    return Model(name="moe", layers=(emb,) + (_moe(phases),) * n + (head,))


def _plan(sizes, m: int = 8) -> Plan:
    stages, start = [], 0
    for d, n in enumerate(sizes):
        stages.append(Stage(start=start, end=start + n, device=d))
        start += n
    return Plan(model="moe", num_devices=len(sizes), num_microbatches=m, stages=tuple(stages), schedule=((),) * len(sizes))


def test_rising_layout_sorts_the_inner_stage_sizes_and_keeps_the_ends_and_devices():
    lay = rising_layout(_plan([2, 3, 3, 1, 1, 1]))
    assert lay.bounds == ((0, 2), (2, 3), (3, 4), (4, 7), (7, 10), (10, 11))
    assert lay.devices == (0, 1, 2, 3, 4, 5)


def test_rising_layout_is_none_where_nothing_would_change():
    assert rising_layout(_plan([2, 1, 2, 3, 1])) is None  # already ascending
    assert rising_layout(_plan([1, 3, 1])) is None  # no two inner stages to swap


def test_no_rising_plans_for_a_model_that_does_not_communicate():
    model = _model(phases=False)
    assert rising_plans(model, cluster(6), 8, _plan([2, 3, 3, 1, 1, 1])) == []


def test_rising_plans_are_valid_paired_plans_of_the_rising_layout():
    model, cl = _model(), cluster(6)
    plans = rising_plans(model, cl, 8, _plan([2, 3, 3, 1, 1, 1]))
    assert 0 < len(plans) <= 2
    steps = []
    for plan in plans:
        validate_plan(plan, model.num_layers)
        assert tuple((st.start, st.end) for st in plan.stages) == ((0, 2), (2, 3), (3, 4), (4, 7), (7, 10), (10, 11))
        assert plan.pairs  # list-scheduled with pairing: the heavy late stages pair
        steps.append(simulate(model, cl, plan, detail=False).step_time_ms)
    assert steps == sorted(steps)


def test_the_split_search_tries_rising_layouts_only_where_pairs_hide_communication():
    # 8 MoE layers between embedding and head on 6 devices: the tuned stages of the rest are uneven
    model, cl = _model(8), cluster(6)
    got = tune_split(model, cl, 12, iterations=30, seed=0)
    assert any("rising" in label for label, _, _ in got.tried)
    validate_plan(got.plan, model.num_layers)
    assert simulate(model, cl, got.plan).step_time_ms == got.step_ms <= got.unsplit_ms
    flat = tune_split(_model(8, phases=False), cl, 12, iterations=30, seed=0)
    assert not any("rising" in label for label, _, _ in flat.tried)
