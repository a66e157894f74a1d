"""Plans bound to their model and cluster: refused for another model or device count, warned for cost changes."""

from dataclasses import replace

import pytest

from octopipe_plugin.costs import named_cluster, resolve_model
from octopipe_plugin.errors import PlanError
from octopipe_plugin.formats import (
    bind_plan, check_plan_binding, idle_devices, model_fingerprint, plan_from_dict, plan_to_dict,
)
from octopipe_plugin.schedules.registry import build_plan


@pytest.fixture(scope="module")
def llama3():
    return resolve_model("llama3-8b", "H100")


@pytest.fixture(scope="module")
def bound(llama3):
    plan = build_plan(llama3, "1f1b", 4, 4)
    return bind_plan(plan, llama3, named_cluster("h100", 4))


def test_fingerprint_survives_the_file_round_trip(llama3, bound):
    again = plan_from_dict(plan_to_dict(bound))
    assert check_plan_binding(again, llama3, named_cluster("h100", 4)) == []
    assert model_fingerprint(llama3) == again.meta["fingerprint"]["model"]


def test_another_model_with_the_same_layer_count_is_refused(bound):
    llama2 = resolve_model("llama2-7b", "H100")
    assert llama2.num_layers == bound.stages[-1].end
    with pytest.raises(PlanError, match=r"made for model 'llama3-8b' \(34 layers\), not model 'llama2-7b'"):
        check_plan_binding(bound, llama2)


def test_another_layer_structure_is_refused(llama3, bound):
    renamed = replace(llama3, layers=(replace(llama3.layers[0], kind="vision"),) + llama3.layers[1:])
    with pytest.raises(PlanError, match="layer names or kinds differ"):
        check_plan_binding(bound, renamed)


def test_cost_only_change_is_a_warning_naming_the_difference(bound):
    on_a100 = resolve_model("llama3-8b", "A100")
    warnings = check_plan_binding(bound, on_a100, named_cluster("a100", 4))
    assert any("GPU H100-SXM -> A100-80G" in w and "F+I+W of all layers" in w for w in warnings)
    assert any("made for cluster 'h100x4'" in w and "GPU H100-SXM -> A100-80G" in w for w in warnings)


def test_device_count_mismatch_names_both_counts(llama3, bound):
    with pytest.raises(PlanError, match="is for 4 devices but cluster h100x8 has 8"):
        check_plan_binding(bound, llama3, named_cluster("h100", 8))


def test_plan_without_fingerprint_loads_with_a_warning(llama3):
    old = build_plan(llama3, "1f1b", 4, 4)
    doc = plan_to_dict(old)
    assert "fingerprint" not in doc.get("meta", {})
    warnings = check_plan_binding(plan_from_dict(doc), llama3)
    assert len(warnings) == 1 and "no fingerprint" in warnings[0]


def test_devices_without_layers_are_reported(llama3):
    plan = bind_plan(build_plan(llama3, "1f1b", 40, 2), llama3)
    assert idle_devices(plan) == list(range(33, 39))  # the last stage keeps the LM head
    warnings = check_plan_binding(plan, llama3)
    assert any("6 of 40 devices hold no layers (devices 33..38)" in w for w in warnings)
