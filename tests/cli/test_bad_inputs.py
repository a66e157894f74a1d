"""A table of bad inputs walked through the real `octopipe` CLI in processes of their own (issue 13).

Each case must exit 2 with exactly one line on stderr, `octopipe CMD: error: ...`, naming the
option or file and what was expected, with no traceback and nothing on stdout, before any
long work: every run has a hard timeout (a hang or a memory blow-up fails the case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe_plugin.costs import named_cluster, resolve_model
from octopipe_plugin.formats import (
    Cluster, Layer, Link, Model, bind_plan, cluster_to_dict, model_to_dict, write_cluster, write_model,
    write_plan,
)
from octopipe_plugin.schedules.registry import build_plan

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120  # a guard against hangs, not a timing assertion: refusals take about a second
GIB = 2**30


def octopipe(*argv: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run `octopipe ARGV` in a fresh interpreter with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", "import sys; from octopipe_plugin.cli import main; sys.exit(main())",
                           *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Good and bad documents for the table, by short name."""
    d = tmp_path_factory.mktemp("bad_inputs")
    llama3 = resolve_model("llama3-8b", "H100")
    out = {"dir": str(d)}

    def put(name: str, text: str) -> None:
        (d / name).write_text(text)
        out[name.replace(".", "_")] = str(d / name)

    plan8 = bind_plan(build_plan(llama3, "1f1b", 8, 8), llama3, named_cluster("h100", 8))
    write_plan(plan8, d / "llama3_h100x8.json")
    out["llama3_h100x8_json"] = str(d / "llama3_h100x8.json")
    plan4 = bind_plan(build_plan(llama3, "1f1b", 4, 4), llama3, named_cluster("h100", 4))
    write_plan(plan4, d / "llama3_h100x4.json")
    out["llama3_h100x4_json"] = str(d / "llama3_h100x4.json")
    wide = bind_plan(build_plan(llama3, "1f1b", 100, 2), llama3)
    write_plan(wide, d / "wide100.json")
    out["wide100_json"] = str(d / "wide100.json")

    model_doc = model_to_dict(llama3)
    put("model_l3.json", json.dumps(model_doc))
    put("no_format.json", json.dumps({k: v for k, v in model_doc.items() if k != "format"}))
    put("empty.yaml", "")
    put("list.json", "[1, 2]")
    put("bad_utf8.json", "")
    (d / "bad_utf8.json").write_bytes(b'{"format": "\xff\xfe"}')
    huge = dict(model_doc, layers=[dict(model_doc["layers"][0], fwd_ms=float("nan"))] + model_doc["layers"][1:])
    put("nan_model.json", json.dumps(huge))
    big_int = json.dumps(dict(model_doc, layers=[dict(model_doc["layers"][0], state_bytes=10**400)]))
    put("bigint_model.json", big_int)

    cl = cluster_to_dict(named_cluster("h100", 8))
    put("nan_bw.json", json.dumps(dict(cl, intra_node={"bandwidth_gb_per_s": float("nan"), "latency_us": 10})))
    put("neg_latency.json", json.dumps(dict(cl, inter_node={"bandwidth_gb_per_s": 50, "latency_us": -1})))
    put("billion_devices.json", json.dumps(dict(cl, num_devices=10**9)))
    put("zero_memory.json", json.dumps(dict(cl, memory_bytes=0)))
    put("v100_cluster.json", json.dumps(dict(cl, gpu="V100")))

    heavy = Model(name="heavy", layers=tuple(
        Layer(name=f"l{i}", kind="dense", fwd_ms=1.0, bwd_ms=1.0, wgrad_ms=1.0, state_bytes=3 * GIB,
              activation_bytes=GIB, output_bytes=2**20) for i in range(8)))
    write_model(heavy, d / "heavy.json")
    out["heavy_json"] = str(d / "heavy.json")
    write_cluster(Cluster(num_devices=4, devices_per_node=4, memory_bytes=2 * GIB,
                          intra_node=Link(bandwidth_gb_per_s=100, latency_us=5),
                          inter_node=Link(bandwidth_gb_per_s=100, latency_us=5), name="small4"), d / "small4.json")
    out["small4_json"] = str(d / "small4.json")
    put("deep.yaml", "base: llama3-8b\nname: deep\nnum_layers: 1100\n")
    put("huge.yaml", "base: llama3-8b\nname: huge\nhidden: 2147483647\nheads: 1\nkv_heads: 1\nffn: 2147483647\n")
    put("deep3000.yaml", "base: llama3-8b\nname: deep3000\nnum_layers: 3000\n")
    os.makedirs(d / "a_folder", exist_ok=True)
    out["a_folder"] = str(d / "a_folder")
    return out


SIM = ["simulate", "--model", "llama3-8b", "--cluster", "h100x8"]
SIM_1F1B = SIM + ["--schedule", "1f1b"]
PLAN = ["plan", "--model", "llama3-8b", "--cluster", "h100x8", "--no-progress"]
DRY = ["dryrun", "{llama3_h100x8_json}", "--model", "llama3-8b"]

CASES = [  # (id, argv with {file} placeholders, fragments the one error line must contain)
    # sizes that grew memory or hung (issue 13)
    ("stages-per-device-1e9", SIM + ["--schedule", "interleaved-1f1b", "--microbatches", "8",
                                     "--stages-per-device", "1000000000"],
     ["argument --stages-per-device", "1..64", "got 1000000000"]),
    ("devices-1e9", SIM_1F1B + ["--microbatches", "8", "--devices", "1000000000"], ["argument --devices", "1..4096"]),
    ("cluster-name-1e9", ["simulate", "--model", "llama3-8b", "--cluster", "h100x1000000000", "--schedule", "1f1b",
                          "--microbatches", "8"], ["--cluster h100x1000000000: expected 1..4096 devices"]),
    ("simulate-microbatches-1e9", SIM_1F1B + ["--microbatches", "1000000000"], ["argument --microbatches", "1..1000000"]),
    ("simulate-too-large", ["simulate", "--model", "llama3-8b", "--cluster", "h100x1000", "--schedule", "1f1b",
                            "--microbatches", "1000000"], ["1,000 stages x 1,000,000 micro-batches", "400,000",
                                                           "use at most 400 micro-batches"]),
    ("plan-microbatches-1e9", PLAN + ["--microbatches", "1000000000", "--time-budget", "5"],
     ["argument --microbatches", "1..1000000"]),
    ("plan-microbatches-1e6", PLAN + ["--microbatches", "1000000", "--time-budget", "5"],
     ["8,000,000 device micro-batches", "262,144", "at most 32,768"]),
    ("plan-1000-devices-34-layers", ["plan", "--model", "llama3-8b", "--cluster", "h100x1000", "--microbatches", "16",
                                     "--time-budget", "5", "--no-progress"],
     ["--cluster h100x1000", "1000 devices", "34 layers", "at most 34 devices"]),
    ("plan-1000-devices-1e6-microbatches", ["plan", "--model", "{deep_yaml}", "--cluster", "h100x1000",
                                            "--microbatches", "1000000", "--time-budget", "5", "--no-progress"],
     ["--time-budget 5 s", "1102 layers on 1000 devices", "raise --time-budget"]),
    ("plan-split-table-too-large", ["plan", "--model", "{deep3000_yaml}", "--cluster", "h100x1000", "--microbatches",
                                    "16", "--time-budget", "86400", "--no-progress"],
     ["3,002 layers x 1,000 devices", "2,000,000", "at most 666 devices"]),
    ("simulate-balanced-split-too-large", ["simulate", "--model", "{deep_yaml}", "--cluster", "h100x4096",
                                           "--schedule", "interleaved-1f1b", "--stages-per-device", "2",
                                           "--microbatches", "16", "--split", "balanced"],
     ["--split balanced", "8,192 stages", "use --split megatron"]),
    # numbers that are not finite or out of range
    ("dryrun-target-0", DRY + ["--target-s", "0"], ["argument --target-s", "[0.01, 600] s", "got 0"]),
    ("dryrun-target-negative", DRY + ["--target-s", "-2"], ["argument --target-s", "got -2"]),
    ("dryrun-target-nan", DRY + ["--target-s", "nan"], ["argument --target-s", "finite", "got nan"]),
    ("dryrun-time-scale-nan", DRY + ["--time-scale", "nan"], ["argument --time-scale", "got nan"]),
    ("dryrun-time-scale-0", DRY + ["--time-scale", "0"], ["argument --time-scale", "(0, 1e+06]"]),
    ("dryrun-timeout-nan", DRY + ["--timeout", "nan"], ["argument --timeout", "got nan"]),
    ("dryrun-timeout-tiny", DRY + ["--timeout", "0.001"], ["argument --timeout", "[1, 86400] s"]),
    ("dryrun-step-longer-than-timeout", DRY + ["--target-s", "30", "--timeout", "5"],
     ["scaled step lasts 30 s", "5 s timeout", "raise --timeout"]),
    ("dryrun-scale-too-long", DRY + ["--time-scale", "1000"], ["more than the 600 s a dry run allows"]),
    ("simulate-launch-nan", SIM_1F1B + ["--microbatches", "8", "--launch-us", "nan"], ["argument --launch-us", "got nan"]),
    ("simulate-launch-inf", SIM_1F1B + ["--microbatches", "8", "--launch-us", "inf"], ["argument --launch-us", "got inf"]),
    ("simulate-launch-negative", SIM_1F1B + ["--microbatches", "8", "--launch-us", "-1"], ["argument --launch-us"]),
    ("simulate-devices-0", SIM_1F1B + ["--microbatches", "8", "--devices", "0"], ["argument --devices", "got 0"]),
    ("simulate-devices-text", SIM_1F1B + ["--microbatches", "eight"], ["argument --microbatches", "got 'eight'"]),
    ("simulate-more-devices-than-cluster", SIM_1F1B + ["--microbatches", "8", "--devices", "16"],
     ["--devices 16", "has only 8"]),
    ("plan-time-budget-0", PLAN + ["--microbatches", "8", "--time-budget", "0"], ["argument --time-budget", "(0, 86400]"]),
    ("plan-time-budget-nan", PLAN + ["--microbatches", "8", "--time-budget", "nan"], ["argument --time-budget", "nan"]),
    ("plan-time-budget-inf", PLAN + ["--microbatches", "8", "--time-budget", "inf"], ["argument --time-budget", "inf"]),
    ("plan-seed-negative", PLAN + ["--microbatches", "8", "--seed", "-1"], ["argument --seed", "got -1"]),
    ("plan-iterations-negative", PLAN + ["--microbatches", "8", "--iterations", "-5"], ["argument --iterations"]),
    ("model-seq-len-0", ["model", "llama3-8b", "--seq-len", "0"], ["argument --seq-len", "got 0"]),
    ("model-tp-text", ["model", "llama3-8b", "--tp", "two"], ["argument --tp", "got 'two'"]),
    ("model-unknown-gpu", ["model", "llama3-8b", "--gpu", "V100"], ["--gpu V100: unknown GPU 'V100'", "A100"]),
    ("simulate-unknown-gpu", SIM_1F1B + ["--microbatches", "8", "--gpu", "V100"], ["unknown GPU 'V100'"]),
    ("cluster-unknown-gpu-name", ["simulate", "--model", "llama3-8b", "--cluster", "v100x8", "--schedule", "1f1b",
                                  "--microbatches", "8"], ["--cluster v100x8: unknown GPU 'v100'"]),
    # output paths checked before any work
    ("plan-o-missing-folder", PLAN + ["--microbatches", "16", "-o", "/no/such/dir/p.json"],
     ["-o /no/such/dir/p.json", "folder /no/such/dir does not exist"]),
    ("plan-png-missing-folder", PLAN + ["--microbatches", "16", "--png", "/no/such/dir/p.png"],
     ["--png /no/such/dir/p.png", "does not exist"]),
    ("plan-o-is-folder", PLAN + ["--microbatches", "16", "-o", "{a_folder}"], ["is a folder", "expected a file name"]),
    ("simulate-trace-missing-folder", SIM_1F1B + ["--microbatches", "8", "--trace", "/no/such/t.json"], ["--trace"]),
    ("simulate-save-plan-folder", SIM_1F1B + ["--microbatches", "8", "--save-plan", "{a_folder}"],
     ["--save-plan", "is a folder"]),
    ("profile-repeats-huge", ["profile", "llama3-8b", "--repeats", "1000000000"], ["argument --repeats", "1..10000"]),
    ("profile-o-missing-folder", ["profile", "llama3-8b", "-o", "/no/such/p.json"], ["-o /no/such/p.json"]),
    ("model-o-missing-folder", ["model", "llama3-8b", "-o", "/no/such/m.json"], ["-o /no/such/m.json"]),
    # plans bound to their model and cluster
    ("simulate-plan-for-other-model", ["simulate", "--model", "llama2-7b", "--cluster", "h100x8", "--plan",
                                       "{llama3_h100x8_json}"],
     ["made for model 'llama3-8b' (34 layers), not --model llama2-7b", "octopipe plan --model llama2-7b"]),
    ("dryrun-plan-for-other-model", ["dryrun", "{llama3_h100x8_json}", "--model", "llama2-7b"],
     ["made for model 'llama3-8b'", "not --model llama2-7b"]),
    ("simulate-plan-fewer-devices", ["simulate", "--model", "llama3-8b", "--cluster", "h100x8", "--plan",
                                     "{llama3_h100x4_json}"], ["is for 4 devices", "h100x8 has 8", "--devices 4"]),
    ("dryrun-plan-fewer-devices", ["dryrun", "{llama3_h100x4_json}", "--model", "llama3-8b", "--cluster", "h100x8"],
     ["is for 4 devices", "has 8"]),
    ("dryrun-too-many-processes", ["dryrun", "{wide100_json}", "--model", "llama3-8b"],
     ["100 devices", "at most 64", "octopipe simulate"]),
    ("simulate-plan-with-microbatches", ["simulate", "--model", "llama3-8b", "--cluster", "h100x8", "--plan",
                                         "{llama3_h100x8_json}", "--microbatches", "4"],
     ["--microbatches applies to --schedule"]),
    # documents: misleading messages of the issue, and more
    ("model-file-without-format", SIM_1F1B[:2] + ["{no_format_json}", "--cluster", "h100x8", "--schedule", "1f1b",
                                                  "--microbatches", "8"],
     ["no_format.json: field $.format", "octopipe-model/1", "add \"format\""]),
    ("plan-given-as-model", ["simulate", "--model", "{llama3_h100x8_json}", "--cluster", "h100x8", "--schedule",
                             "1f1b", "--microbatches", "8"],
     ["field $.format", "octopipe-model/1", "this is a plan file", "--plan FILE"]),
    ("model-file-given-as-plan", ["simulate", "--model", "llama3-8b", "--cluster", "h100x8", "--plan",
                                  "{model_l3_json}"], ["$.format", "'octopipe-plan/1'", "this is an octopipe-model file",
                                                       "pass it to --model"]),
    ("empty-yaml-model", ["model", "{empty_yaml}"], ["empty.yaml: field $", "the file is empty"]),
    ("list-json-model", ["model", "{list_json}"], ["list.json: field $", "got a list"]),
    ("bad-utf8-model", ["model", "{bad_utf8_json}"], ["bad_utf8.json: field $", "UTF-8"]),
    ("unknown-zoo-model", ["simulate", "--model", "llama9", "--cluster", "h100x8", "--schedule", "1f1b",
                           "--microbatches", "8"], ["--model llama9: unknown model", "expected a zoo name"]),
    ("unknown-cluster-name", ["simulate", "--model", "llama3-8b", "--cluster", "eight-gpus", "--schedule", "1f1b",
                              "--microbatches", "8"], ["--cluster eight-gpus: unknown cluster", "h100x8"]),
    ("missing-model-file", ["model", "missing.yaml"], ["missing.yaml: field $", "a readable file"]),
    ("nan-cost-model", SIM_1F1B[:2] + ["{nan_model_json}", "--cluster", "h100x8", "--schedule", "1f1b",
                                       "--microbatches", "8"], ["$.layers[0].fwd_ms", "finite", "got nan"]),
    ("huge-int-model", ["model", "{bigint_model_json}"], ["$.layers[0].state_bytes", "about 400 digits"]),
    ("huge-architecture", ["model", "{huge_yaml}"], ["huge.yaml: field $", "at most 1e+07 ms and 1 PiB", "check hidden"]),
    ("cluster-nan-bandwidth", ["simulate", "--model", "llama3-8b", "--cluster", "{nan_bw_json}", "--schedule", "1f1b",
                               "--microbatches", "8"], ["$.intra_node.bandwidth_gb_per_s", "got nan"]),
    ("cluster-negative-latency", ["simulate", "--model", "llama3-8b", "--cluster", "{neg_latency_json}", "--schedule",
                                  "1f1b", "--microbatches", "8"], ["$.inter_node.latency_us", "[0, 1e+06]"]),
    ("cluster-billion-devices", ["plan", "--model", "llama3-8b", "--cluster", "{billion_devices_json}",
                                 "--microbatches", "8"], ["$.num_devices", "1..4096", "got 1000000000"]),
    ("cluster-zero-memory", ["simulate", "--model", "llama3-8b", "--cluster", "{zero_memory_json}", "--schedule",
                             "1f1b", "--microbatches", "8"], ["$.memory_bytes", "got 0"]),
    ("cluster-unknown-gpu-field", ["simulate", "--model", "llama3-8b", "--cluster", "{v100_cluster_json}",
                                   "--schedule", "1f1b", "--microbatches", "8"], ["$.gpu", "got 'V100'"]),
    ("nothing-fits-in-gib", ["plan", "--model", "{heavy_json}", "--cluster", "{small4_json}", "--microbatches", "4",
                             "--iterations", "10", "--no-progress"],
     ["no plan fits the 2.0 GiB per device", "GiB", "recompute", "more devices", "--tp"]),
]


@pytest.fixture(scope="module")
def outcomes(files, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every case run once, each in a process of its own forked from one interpreter that imported the CLI
    (cli_forks.py: the imports are paid once, not once per case); the tests below run fresh interpreters."""
    todo = {case: [a.format(**files) if a.startswith("{") else a for a in argv] for case, argv, _ in CASES}
    path = tmp_path_factory.mktemp("bad_input_cases") / "cases.json"
    path.write_text(json.dumps(todo))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("cli_forks.py")), str(path),
                           str(RUN_TIMEOUT_S)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=len(CASES) * RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return {case: subprocess.CompletedProcess(todo[case], rc, out, err)
            for case, (rc, out, err) in json.loads(done.stdout).items()}


@pytest.mark.timeout(len(CASES) * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case,argv,fragments", [pytest.param(i, a, f, id=i) for i, a, f in CASES])
def test_bad_input_is_one_clear_line_and_exit_2(outcomes, case, argv, fragments):
    done = outcomes[case]
    err = done.stderr.strip()
    assert done.returncode == 2, f"rc {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {err[-2000:]}"
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    command = argv[0]
    assert err.startswith(f"octopipe {command}: error: "), err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert done.stdout == ""


def test_a_plan_that_cannot_be_written_at_the_end_is_printed_and_kept(files):
    done = octopipe("plan", "--model", "llama3-8b", "--cluster", "h100x4", "--microbatches", "4", "--iterations", "5",
                    "--no-progress", "-o", "/dev/full")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "OctoPipe plan for llama3-8b" in done.stdout  # the result is printed
    err = done.stderr.strip().splitlines()[-1]
    assert "cannot write /dev/full" in err and "the plan was kept in " in err
    kept = err.split("the plan was kept in ")[1].strip()
    doc = json.loads(Path(kept).read_text())
    os.unlink(kept)
    assert doc["format"] == "octopipe-plan/1" and doc["meta"]["fingerprint"]["model"]["name"] == "llama3-8b"


def test_the_cluster_gpu_sets_the_costs_and_every_command_says_which(files):
    a100 = octopipe("simulate", "--model", "llama3-8b", "--cluster", "a100x8", "--schedule", "1f1b", "--devices", "8",
                    "--microbatches", "16")
    over = octopipe("simulate", "--model", "llama3-8b", "--cluster", "a100x8", "--gpu", "A100-80G", "--schedule",
                    "1f1b", "--devices", "8", "--microbatches", "16")
    h100 = octopipe("simulate", "--model", "llama3-8b", "--cluster", "a100x8", "--gpu", "H100", "--schedule", "1f1b",
                    "--microbatches", "16", "--json")
    assert a100.returncode == over.returncode == h100.returncode == 0, a100.stderr + over.stderr + h100.stderr
    step = [ln for ln in a100.stdout.splitlines() if "step time" in ln]
    assert step == [ln for ln in over.stdout.splitlines() if "step time" in ln]  # the A100 figure, --gpu or not
    assert "costs       analytic, A100-80G (the GPU of cluster a100x8)" in a100.stdout
    report = json.loads(h100.stdout)
    assert report["costs"]["gpu"] == "H100-SXM" and "--gpu" in report["costs"]["why"]
    assert report["step_time_ms"] < float(step[0].split()[2])  # H100 is faster than A100


def test_a_model_file_costed_for_another_gpu_is_flagged(files, tmp_path):
    model_file = tmp_path / "llama3_h100.json"
    write_model(resolve_model("llama3-8b", "H100"), model_file)
    done = octopipe("simulate", "--model", str(model_file), "--cluster", "a100x8", "--schedule", "1f1b",
                    "--microbatches", "8")
    assert done.returncode == 0, done.stderr
    assert "was costed for H100-SXM but cluster a100x8 is A100-80G" in done.stderr
    assert "model file" in done.stdout and "H100-SXM" in done.stdout
