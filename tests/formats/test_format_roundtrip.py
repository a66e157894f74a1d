"""Model, cluster and plan documents survive write -> read unchanged (JSON and YAML)."""

import json

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe_plugin.costs import resolve_cluster, resolve_model
from octopipe_plugin.formats import (
    Layer, Model, Plan, Stage, model_from_dict, model_to_dict, plan_to_dict, read_cluster, read_model, read_plan,
    write_cluster, write_model, write_plan,
)
from octopipe_plugin.actions import parse_schedule


def test_zoo_model_round_trips_with_branches_and_meta(tmp_path):
    model = resolve_model("vlm", "H100")
    path = tmp_path / "vlm.json"
    write_model(model, path)
    back = read_model(path)
    assert back == model
    assert back.inputs and back.meta["arch"]["vision_layers"] == 24


def test_model_reads_from_yaml(tmp_path):
    model = resolve_model("llama2-7b", "A100")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(model_to_dict(model)))
    assert read_model(path) == model


def test_cluster_round_trips(tmp_path):
    cluster = resolve_cluster("h100x16")
    path = tmp_path / "c.json"
    write_cluster(cluster, path)
    assert read_cluster(path) == cluster
    assert resolve_cluster(str(path)) == cluster


def _two_stage_plan() -> Plan:
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]]
    return Plan(model="toy", num_devices=2, num_microbatches=2,
                stages=(Stage(start=0, end=3, device=0), Stage(start=3, end=5, device=1)),
                schedule=parse_schedule(rows), predicted={"step_time_ms": 12.5})


def test_plan_round_trips(tmp_path):
    plan = _two_stage_plan()
    path = tmp_path / "p.json"
    write_plan(plan, path)
    back = read_plan(path, num_layers=5)
    assert back == plan
    assert json.loads(path.read_text())["schedule"][1][1] == "1I0"
    assert plan_to_dict(back) == plan_to_dict(plan)


_costs = st.floats(min_value=0, max_value=1e4, allow_nan=False, allow_infinity=False)
_sizes = st.integers(min_value=0, max_value=1 << 40)
_layers = st.builds(Layer, name=st.text(min_size=1, max_size=8), kind=st.sampled_from(["dense", "moe", "mamba"]),
                    fwd_ms=_costs, bwd_ms=_costs, wgrad_ms=_costs, state_bytes=_sizes, activation_bytes=_sizes,
                    output_bytes=_sizes)


@settings(max_examples=40, deadline=None)
@given(st.lists(_layers, min_size=1, max_size=6))
def test_any_model_round_trips_through_json(layers):
    model = Model(name="m", layers=tuple(layers))
    assert model_from_dict(json.loads(json.dumps(model_to_dict(model)))) == model
