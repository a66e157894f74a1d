"""Every refusal of issue 2 names the file, the JSON path and what was expected; the CLI exits 2 with no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe_plugin.cli import main
from octopipe_plugin.errors import FormatError
from octopipe_plugin.formats import read_cluster, read_model, read_plan

ROOT = Path(__file__).resolve().parents[2]


def _model_doc() -> dict:
    layer = {"name": "l", "kind": "dense", "fwd_ms": 1.0, "bwd_ms": 1.0, "wgrad_ms": 1.0, "state_bytes": 10,
             "activation_bytes": 10, "output_bytes": 10}
    return {"format": "octopipe-model/1", "name": "m", "layers": [dict(layer), dict(layer)]}


def _plan_doc() -> dict:
    return {"format": "octopipe-plan/1", "model": "m", "num_devices": 2, "num_microbatches": 1,
            "stages": [{"layers": [0, 1], "device": 0}, {"layers": [1, 2], "device": 1}],
            "schedule": [["0F0", "0B0"], ["1F0", "1B0"]]}


def _cluster_doc() -> dict:
    return {"format": "octopipe-cluster/1", "num_devices": 8, "devices_per_node": 8, "memory_bytes": 1 << 30,
            "intra_node": {"bandwidth_gb_per_s": 200, "latency_us": 10}}


def _spoil(doc: dict, path: list, value) -> dict:
    """Set (or delete, for value=...) the item at `path` inside a deep copy of doc."""
    doc = json.loads(json.dumps(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


MODEL_CASES = [  # (spoiled path, value, JSON path named, expectation named)
    (["layers", 1, "fwd_ms"], ..., "$.layers[1].fwd_ms", "field is missing"),
    (["name"], ..., "$.name", "field is missing"),
    (["layers", 0, "state_bytes"], "big", "$.layers[0].state_bytes", "expected an integer"),
    (["layers", 0, "fwd_ms"], "fast", "$.layers[0].fwd_ms", "expected a number"),
    (["layers", 1, "bwd_ms"], -0.5, "$.layers[1].bwd_ms", "a finite number in [0, 1e+07]"),
    (["layers", 0, "activation_bytes"], -1, "$.layers[0].activation_bytes", "an integer in 0..1.126e+15"),
    (["layers", 0, "fwd_ms"], float("nan"), "$.layers[0].fwd_ms", "a finite number in [0, 1e+07], got nan"),
    (["layers", 0, "state_bytes"], 10**400, "$.layers[0].state_bytes", "got an integer of about 400 digits"),
    (["format"], "octopipe-model/2", "$.format", "major version 1"),
    (["layers"], [], "$.layers", "non-empty"),
]


PLAN_CASES = [
    (["stages", 1, "layers"], [2, 3], "$.stages[1].layers[0]", "ranges are consecutive"),
    (["stages", 0, "layers"], [1, 1], "$.stages[0].layers[0]", "cover the layers"),
    (["schedule", 0, 1], "0X0", "$.schedule[0][1]", "an action like '3F12'"),
    (["schedule", 1, 0], "F1", "$.schedule[1][0]", "an action like '3F12'"),
    (["num_microbatches"], "two", "$.num_microbatches", "expected an integer"),
    (["num_devices"], ..., "$.num_devices", "field is missing"),
    (["format"], "octopipe-plan/3.1", "$.format", "major version 1"),
    (["schedule", 1], ["1F0"], "$.schedule", "complete schedule"),
]


def test_plan_whose_stages_stop_short_of_the_model_is_refused(tmp_path):
    file = tmp_path / "short.json"
    file.write_text(json.dumps(_plan_doc()))
    with pytest.raises(FormatError) as info:
        read_plan(file, num_layers=5)
    assert "$.stages[1].layers[1]" in str(info.value) and "5 (the model's layer count)" in str(info.value)


CLUSTER_CASES = [
    (["memory_bytes"], ..., "$.memory_bytes", "field is missing"),
    (["intra_node", "bandwidth_gb_per_s"], "fast", "$.intra_node.bandwidth_gb_per_s", "expected a number"),
    (["intra_node", "latency_us"], -3, "$.intra_node.latency_us", "in [0, 1e+06]"),
    (["intra_node", "bandwidth_gb_per_s"], 0, "$.intra_node.bandwidth_gb_per_s", "in (0, 1e+06]"),
    (["num_devices"], 10**9, "$.num_devices", "an integer in 1..4096, got 1000000000"),
    (["memory_bytes"], 2**60, "$.memory_bytes", "an integer in 1048576..1.126e+15"),
    (["gpu"], "V100", "$.gpu", "a GPU of the cost model"),
    (["format"], "octopipe-cluster/2", "$.format", "major version 1"),
]


DOCUMENTS = {  # document kind -> (valid document, reader)
    "model": (_model_doc, read_model),
    "plan": (_plan_doc, lambda file: read_plan(file, num_layers=2)),
    "cluster": (_cluster_doc, read_cluster),
}


@pytest.mark.parametrize("kind,path,value,json_path,expected", [
    pytest.param(kind, *case, id=f"{kind}-{case[2]}-{case[3]}")
    for kind, cases in (("model", MODEL_CASES), ("plan", PLAN_CASES), ("cluster", CLUSTER_CASES)) for case in cases
])
def test_bad_document_is_refused_with_file_path_and_expectation(tmp_path, kind, path, value, json_path, expected):
    make_doc, read = DOCUMENTS[kind]
    file = tmp_path / f"bad_{kind}.json"
    file.write_text(json.dumps(_spoil(make_doc(), path, value)))
    with pytest.raises(FormatError) as info:
        read(file)
    msg = str(info.value)
    assert str(file) in msg and json_path in msg and expected in msg
    assert info.value.path == json_path


def test_unparsable_json_names_line_and_column(tmp_path):
    file = tmp_path / "broken.json"
    file.write_text('{"format": "octopipe-model/1",\n "name": }')
    with pytest.raises(FormatError) as info:
        read_model(file)
    assert str(file) in str(info.value) and "line 2" in str(info.value)


@pytest.mark.parametrize("path,value,json_path,expected", MODEL_CASES[:5])
def test_cli_refuses_bad_model_file_in_one_line(tmp_path, capsys, path, value, json_path, expected):
    file = tmp_path / "bad_model.json"
    file.write_text(json.dumps(_spoil(_model_doc(), path, value)))
    assert main(["model", str(file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(file) in err and json_path in err and expected in err


def test_cli_bad_file_exits_nonzero_without_traceback_in_a_real_process(tmp_path):
    file = tmp_path / "bad_model.json"
    file.write_text(json.dumps(_spoil(_model_doc(), ["format"], "octopipe-model/2")))
    proc = subprocess.run([sys.executable, "-m", "octopipe_plugin", "model", str(file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "$.format" in proc.stderr and str(file) in proc.stderr


@pytest.mark.parametrize("ranges, message", [
    ([(0, 3), (5, 8)], "stage 1 starts at layer 5, stage 0 ends at 3"),
    ([(1, 3), (3, 8)], "stage 0 starts at layer 1"),
    ([(0, 4), (4, 3), (3, 8)], "stage 1 ends at layer 3 before it starts at 4"),
])
def test_plan_built_in_code_with_a_gap_or_overlap_is_refused(ranges, message):
    from octopipe_plugin.errors import PlanError
    from octopipe_plugin.formats import Plan, Stage, validate_plan
    from octopipe_plugin.actions import B, F

    stages = tuple(Stage(start=a, end=b, device=i) for i, (a, b) in enumerate(ranges))
    sched = tuple((F(i, 0), B(i, 0)) for i in range(len(ranges)))
    plan = Plan(model="m", num_devices=len(ranges), num_microbatches=1, stages=stages, schedule=sched)
    with pytest.raises(PlanError, match=message):
        validate_plan(plan)
