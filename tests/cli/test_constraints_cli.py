"""`octopipe plan` / `simulate` with --memory-headroom and the constraint options, through the real CLI."""

from __future__ import annotations

import json

import pytest

from octopipe_plugin.actions import RULES
from octopipe_plugin.cli import main
from octopipe_plugin.formats import Cluster, Layer, Link, Model, read_plan, write_cluster, write_model
from octopipe_plugin.schedules.placement import Placement, place_stages
from octopipe_plugin.simulator import simulate

GIB = 2**30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cons")
    layers = [Layer(name="emb", kind="embedding", fwd_ms=0.2, bwd_ms=0.1, wgrad_ms=0.3, state_bytes=GIB,
                    activation_bytes=GIB, output_bytes=2**20)]
    layers += [Layer(name=f"l{i}", kind="dense", fwd_ms=1.0 + (i % 3), bwd_ms=1.0 + (i % 3), wgrad_ms=1.0,
                     state_bytes=GIB, activation_bytes=GIB, output_bytes=2**20) for i in range(13)]
    layers += [Layer(name="head", kind="lm_head", fwd_ms=4.0, bwd_ms=4.0, wgrad_ms=4.0, state_bytes=2 * GIB,
                     activation_bytes=GIB, output_bytes=2**20)]
    model = Model(name="cons-model", layers=tuple(layers))
    cl = Cluster(num_devices=4, devices_per_node=2, memory_bytes=40 * GIB,
                 intra_node=Link(bandwidth_gb_per_s=400, latency_us=1),
                 inter_node=Link(bandwidth_gb_per_s=50, latency_us=5))
    mpath, cpath = tmp / "model.json", tmp / "cluster.json"
    write_model(model, mpath)
    write_cluster(cl, cpath)
    return model, cl, str(mpath), str(cpath), tmp


def _plan(capsys, files, *extra, expect=0):
    _, _, mpath, cpath, _ = files
    rc = main(["plan", "--model", mpath, "--cluster", cpath, "--microbatches", "8", "--iterations", "40",
               "--no-progress", *extra])
    out, err = capsys.readouterr()
    assert rc == expect, err
    return out if expect == 0 else err


def _plan_json(capsys, files, *extra):
    return json.loads(_plan(capsys, files, "--json", *extra))


@pytest.mark.parametrize("options", [
    ["--placement", "looped"],
    ["--placement", "v", "--max-stages-per-device", "2"],
    ["--uniform-stages-per-device", "--max-stages-per-device", "3"],
    ["--no-split-backward"],
    ["--placement", "looped", "--uniform-stages-per-device", "--no-split-backward"],
])
def test_plans_keep_to_the_constraint_options(capsys, files, tmp_path, options):
    model, cl, *_ = files
    out_plan = tmp_path / "plan.json"
    doc = _plan_json(capsys, files, "-o", str(out_plan), *options)
    plan = read_plan(out_plan, model.num_layers)
    devices = [st.device for st in plan.stages]
    counts = [devices.count(d) for d in range(cl.num_devices)]
    if "--placement" in options:
        kind = options[options.index("--placement") + 1]
        assert devices == place_stages(Placement(kind), cl.num_devices, len(devices))
    if "--max-stages-per-device" in options:
        assert max(counts) <= int(options[options.index("--max-stages-per-device") + 1])
    if "--uniform-stages-per-device" in options:
        assert len(set(counts)) == 1
    if "--no-split-backward" in options:
        # every stage action an F or a B (a split head's shard actions, actions.RULES side set, may be there too)
        assert {a.kind.value for row in plan.schedule for a in row if RULES[a.kind].side is None} <= {"F", "B"}
        notes = {r["label"]: r["note"] for r in doc["comparison"]}
        for name in ("zb-h1 (balanced)", "zb-v (balanced)"):
            assert "excluded by" in notes[name] and "--no-split-backward" in notes[name], notes[name]
        assert "excluded" not in notes["1f1b (balanced)"]
    assert doc["constraints"]["placement"] == (options[options.index("--placement") + 1]
                                               if "--placement" in options else "any")


def test_table_names_the_constraints_and_what_they_exclude(capsys, files):
    text = _plan(capsys, files, "--placement", "looped", "--max-stages-per-device", "1")
    assert "constraints    --placement looped --max-stages-per-device 1" in text
    zbv = next(line for line in text.splitlines() if line.startswith("zb-v (balanced)"))
    assert "excluded by --placement looped, --max-stages-per-device 1" in zbv
    inter = next(line for line in text.splitlines() if line.startswith("interleaved-1f1b (balanced)"))
    assert "excluded" not in inter and " 1 " in inter  # the best run the constraints allow: v = 1


def test_headroom_is_kept_and_simulate_confirms_it(capsys, files, tmp_path):
    model, cl, mpath, cpath, _ = files
    free = _plan_json(capsys, files, "--memory-headroom", "0")
    top = max(free["peak_memory_bytes"])
    kept_gib = (cl.memory_bytes - top) / GIB + 1.0  # one GiB less than the unconstrained plan needs
    out_plan = tmp_path / "lean.json"
    lean = _plan_json(capsys, files, "--memory-headroom", f"{kept_gib}GiB", "-o", str(out_plan))
    assert lean["memory_headroom_bytes"] == int(round(kept_gib * GIB))
    assert max(lean["peak_memory_bytes"]) <= lean["usable_memory_bytes"] < top
    plan = read_plan(out_plan, model.num_layers)
    assert max(simulate(model, cl, plan).peak_memory_bytes) <= lean["usable_memory_bytes"]
    # the simulator, told the same headroom, says it fits; the first plan fits only without it
    assert main(["simulate", "--model", mpath, "--cluster", cpath, "--plan", str(out_plan), "--memory-headroom",
                 f"{kept_gib}GiB", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert all(d["fit"] == "yes" for d in rep["devices"])
    assert main(["simulate", "--model", mpath, "--cluster", cpath, "--plan", str(out_plan), "--memory-headroom",
                 f"{(cl.memory_bytes - max(rep['devices'][d]['peak_memory_bytes'] for d in range(4))) / GIB + 0.5}",
                 ]) == 0
    text = capsys.readouterr().out
    assert "fits only without headroom" in text and "free GiB" in text and "GiB headroom" in text


def test_builtins_that_fit_only_without_headroom_say_so(capsys, files):
    _, cl, *_ = files
    free = _plan_json(capsys, files, "--memory-headroom", "0")
    gpipe = next(r for r in free["comparison"] if r["label"] == "gpipe (megatron)")
    assert gpipe["fits"]
    kept = (cl.memory_bytes - gpipe["peak_bytes"]) / GIB + 0.25
    text = _plan(capsys, files, "--memory-headroom", f"{kept}GiB")
    line = next(ln for ln in text.splitlines() if ln.startswith("gpipe (megatron)"))
    assert " NO " in line and f"fits only without the {kept:.1f} GiB headroom" in line
    assert "GiB usable of 40.0 GiB" in text


def test_default_headroom_is_8_percent_and_explained(capsys, files):
    doc = _plan_json(capsys, files)
    assert doc["memory_headroom_bytes"] == int(40 * GIB * 0.08)
    assert main(["plan", "-h"]) == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert "Default 8%" in helptext and "NCCL" in helptext and "CUDA context" in helptext


@pytest.mark.parametrize("options, fragment", [
    (["--memory-headroom", "lots"], "argument --memory-headroom: 'lots': expected GiB"),
    (["--memory-headroom", "45"], "leaves nothing of the 40.0 GiB"),
    (["--placement", "zigzag"], "argument --placement: invalid choice"),
    (["--max-stages-per-device", "0"], "argument --max-stages-per-device: expected an integer"),
])
def test_bad_options_are_one_line(capsys, files, options, fragment):
    err = _plan(capsys, files, *options, expect=2)
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
