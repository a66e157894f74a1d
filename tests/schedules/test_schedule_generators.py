"""Every built-in generator: valid, deadlock-free plans over awkward configurations; clear refusals."""

from __future__ import annotations

import pytest

from octopipe_plugin.errors import OctoPipeError, PlanError
from octopipe_plugin.formats import Cluster, Layer, Link, Model, validate_plan
from octopipe_plugin.actions import Kind
from octopipe_plugin.schedules.generators import megatron_group_size
from octopipe_plugin.schedules.placement import looped, v_shape
from octopipe_plugin.schedules.registry import SCHEDULES, build_plan, get_schedule
from octopipe_plugin.simulator import simulate


def model(n: int) -> Model:
    layers = [Layer(name="emb", kind="embedding", fwd_ms=0.1, bwd_ms=0.1, wgrad_ms=0.1, state_bytes=10,
                    activation_bytes=1, output_bytes=100)]
    layers += [Layer(name=f"d{k}", kind="dense", fwd_ms=1 + k % 3, bwd_ms=1.5, wgrad_ms=0.5 + k % 2, state_bytes=100,
                     activation_bytes=10, output_bytes=100) for k in range(n)]
    layers.append(Layer(name="head", kind="lm_head", fwd_ms=2, bwd_ms=2, wgrad_ms=2, state_bytes=50,
                        activation_bytes=20, output_bytes=4))
    return Model(name="m", layers=tuple(layers))


CLUSTER = Cluster(num_devices=16, devices_per_node=4, memory_bytes=1 << 40,
                  intra_node=Link(bandwidth_gb_per_s=100, latency_us=5),
                  inter_node=Link(bandwidth_gb_per_s=10, latency_us=20))


def configs():
    for name, spec in SCHEDULES.items():
        vs = [spec.stages_per_device] if spec.stages_per_device else [1, 2, 3]
        for v in vs:
            for p in (1, 2, 3, 4, 5):
                for m in (1, 2, 3, 4, 5, 7, 8, 10, 13):
                    yield name, p, v, m


def _served(name: str, p: int, v: int, m: int) -> bool:
    try:
        get_schedule(name).check(p, m, v)
    except PlanError:
        return False
    return not (name == "interleaved-1f1b" and p == 1 and v > 1)


@pytest.mark.parametrize("split", ["megatron", "balanced"])
def test_every_served_configuration_is_valid_and_deadlock_free(split):
    served = refused = 0
    for name, p, v, m in configs():
        mdl = model(2 * p * v)
        if not _served(name, p, v, m):
            with pytest.raises(PlanError):
                build_plan(mdl, name, p, m, v, split=split)
            refused += 1
            continue
        plan = build_plan(mdl, name, p, m, v, split=split)
        validate_plan(plan, mdl.num_layers)
        assert [st.device for st in plan.stages] == (v_shape(p, v) if get_schedule(name).placement == "v"
                                                     else looped(p, v))
        res = simulate(mdl, CLUSTER, plan, detail=False)  # raises DeadlockError on a bad order
        assert res.step_time_ms > 0
        served += 1
    assert served >= 250 and refused >= 10


@pytest.mark.parametrize("name, p, v, m, why", [
    ("zb-v", 4, 1, 8, "exactly 2 stage"),
    ("dualpipev", 4, 3, 8, "exactly 2 stage"),
    ("dualpipev", 4, 2, 7, "at least 8 micro-batches"),
    ("interleaved-1f1b", 4, 2, 3, "at least 4 micro-batches"),
    ("interleaved-1f1b", 1, 2, 4, "one device"),
    ("combined-1f1b", 4, 2, 3, "at least 4 micro-batches"),
    ("combined-1f1b", 1, 2, 4, "one device"),
    ("1f1b", 4, 2, 8, "exactly 1 stage"),
    ("gpipe", 2, 0, 4, "exactly 1 stage"),
])
def test_refusals_say_why(name, p, v, m, why):
    with pytest.raises(PlanError, match=why):
        build_plan(model(16), name, p, m, v)


def test_generators_refuse_a_foreign_placement():
    spec = get_schedule("zb-v")
    with pytest.raises(PlanError, match="stage->device map"):
        spec.generate(looped(4, 2), 4, 8)
    with pytest.raises(PlanError, match="stage->device map"):
        get_schedule("interleaved-1f1b").generate(v_shape(4, 2), 4, 8)


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(OctoPipeError) as err:
        get_schedule("zb-h3")
    for name in SCHEDULES:
        assert name in str(err.value)


def test_registry_states_requirements():
    for spec in SCHEDULES.values():
        assert spec.requirements and spec.placement in ("looped", "v")
    assert get_schedule("zb-v").stages_per_device == 2 and get_schedule("interleaved-1f1b").stages_per_device is None


def test_split_backward_schedules_use_i_and_w():
    for name, spec in SCHEDULES.items():
        plan = build_plan(model(8), name, 2, 8)
        kinds = {a.kind for row in plan.schedule for a in row}
        assert (Kind.W in kinds) == spec.uses_split_backward, name


def test_build_plan_boundaries_and_splits():
    mdl = model(6)  # 8 layers
    plan = build_plan(mdl, "1f1b", 2, 4, boundaries=[0, 3, 8])
    assert plan.boundaries() == [0, 3, 8] and plan.meta["split"] == "explicit"
    assert build_plan(mdl, "1f1b", 2, 4, boundaries=[(0, 5), (5, 8)]).boundaries() == [0, 5, 8]
    with pytest.raises(PlanError, match="needs 2"):
        build_plan(mdl, "1f1b", 2, 4, boundaries=[0, 8])
    with pytest.raises(PlanError, match="model has 8"):
        build_plan(mdl, "1f1b", 2, 4, boundaries=[0, 3, 7])
    with pytest.raises(OctoPipeError, match="unknown split"):
        build_plan(mdl, "1f1b", 2, 4, split="greedy")
    assert build_plan(mdl, "zb-v", 2, 4).num_stages == 4  # V schedules default to 2 stages per device


def test_megatron_group_size_follows_megatron_rules():
    assert megatron_group_size(4, 8) == 4  # Megatron's default, p
    g = megatron_group_size(4, 10)
    assert 4 <= g <= 10 and (10 % g == 0 or 10 % g >= 4)
    assert megatron_group_size(4, 6) == 6
    with pytest.raises(PlanError):
        megatron_group_size(4, 3)
