"""examples/megatron/launch.py runs a Megatron-LM script from its checkout with OctoPipe's hooks installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe_plugin.adapters.megatron.graph import model_from_megatron
from octopipe_plugin.formats import write_plan
from octopipe_plugin.schedules.registry import build_plan

from launch_helpers import TINY_GPT, parse

ROOT = Path(__file__).resolve().parents[3]
STAGES = [(0, 2), (2, 4), (4, 6), (6, 8)]  # non-uniform in layers: E+t, t+t, t+t, t+L
pytestmark = [pytest.mark.framework, pytest.mark.timeout(400)]

# A stand-in for a Megatron-LM checkout's pretrain script: its argument flow is pretrain_gpt.py's in
# 0.19.2 (its own extra_args_provider, parse_and_validate_args) and it imports a sibling module.
SCRIPT = '''
import json, subprocess, sys
from megatron.training.arguments import parse_and_validate_args
import megatron.core.parallel_state as ps
import megatron.training.arguments as arguments
import megatron.training.training as training
from tiny_builders import NAME
from octopipe_plugin.adapters.megatron import hooks

def add_own_args(parser):
    parser.add_argument("--own-flag", type=int, default=0)
    return parser

if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=add_own_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    print("RESULT " + json.dumps({"name": NAME, "own": args.own_flag, "schedule": getattr(args, "pipeline_schedule", None),
                                  "layout": args.pipeline_model_parallel_layout,
                                  "vp": args.virtual_pipeline_model_parallel_size,
                                  "factory": training.get_forward_backward_func.__module__,
                                  "parse_args_wrapped": hasattr(arguments.parse_args, "__wrapped__"),
                                  "get_model_wrapped": hasattr(training.get_model, "__wrapped__"),
                                  "first_stage": ps.is_pipeline_first_stage.__module__,
                                  "installed": [line.split(":")[0] for line in hooks.installed()],
                                  # a process the run starts (as the dist-checkpoint writer does) on Python 3.11
                                  "child_has_override": subprocess.run([sys.executable, "-c",
                                                                        "from typing import override"]).returncode == 0}))
'''


def checkout(tmp_path) -> Path:
    root = tmp_path / "Megatron-LM"
    root.mkdir()
    (root / "pretrain_tiny.py").write_text(SCRIPT)
    (root / "tiny_builders.py").write_text("NAME = 'tiny'\n")
    return root


def launch_all(runs, tmp_path, timeout=300):
    """[(argv, world)] -> their CompletedProcesses: each `launch.py ARGV` a process of its own, all started at once
    (each is one single-threaded interpreter importing Megatron: side by side they use the host's cores, one after
    the other one core); each still killed after `timeout` seconds (a hang fails its test)."""
    procs = []
    try:
        for argv, world in runs:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(world), "RANK": "0"}
            cmd = [sys.executable, str(ROOT / "examples/megatron/launch.py"), *argv]
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                env=env, cwd=tmp_path)))
        out = []
        for cmd, proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
        return out
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def result(out):
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def test_launcher_runs_the_checkout_script_with_octopipe_arguments(tmp_path):
    root = checkout(tmp_path)
    model = model_from_megatron(parse(TINY_GPT, octopipe=False, validate=False))
    write_plan(build_plan(model, "interleaved-zb", 2, 4, stages_per_device=2, boundaries=STAGES), tmp_path / "plan.json")
    run = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--own-flag", "7"]
    # the script path given directly; a plan for another pipeline size stops start-up with one message
    good, bad = launch_all([(["--megatron-lm", str(root), "pretrain_tiny.py", *run, "--pipeline-schedule", "octopipe",
                              "--octopipe-plan", str(tmp_path / "plan.json")], 2),
                            ([str(root / "pretrain_tiny.py"), *run[:-6], "--pipeline-model-parallel-size", "1",
                              "--global-batch-size", "4", "--pipeline-schedule", "octopipe",
                              "--octopipe-plan", str(tmp_path / "plan.json")], 1)], tmp_path)
    got = result(good)
    assert got == {"name": "tiny", "own": 7, "schedule": "octopipe", "layout": "Et|tt|tt|tL", "vp": 2,
                   "factory": "octopipe_plugin.adapters.megatron.launch",
                   "parse_args_wrapped": True, "get_model_wrapped": False,  # a looped plan: no model hook
                   "first_stage": "megatron.core.parallel_state",
                   "installed": ["megatron.training.arguments.parse_args",
                                 "megatron.training.training.get_forward_backward_func"],
                   "child_has_override": True}
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "does not match this run: it has 2 devices but --pipeline-model-parallel-size is 1" in bad.stderr


def test_default_schedule_runs_touch_nothing_of_megatron(tmp_path):
    """--pipeline-schedule default (given or not): Megatron's own names, no patch installed."""
    root = checkout(tmp_path)
    run = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--own-flag", "3"]
    spellings = ([], ["--pipeline-schedule", "default"], ["--pipeline-schedule=default"])
    *runs, bad = launch_all([(["--megatron-lm", str(root), "pretrain_tiny.py", *run, *extra], 2) for extra in spellings]
                            + [(["--megatron-lm", str(root), "pretrain_tiny.py", *run, "--octopipe-plan", "p.json"], 2)],
                            tmp_path)
    for out in runs:
        got = result(out)
        assert got["installed"] == [] and got["own"] == 3 and got["layout"] is None and got["child_has_override"]
        assert got["factory"] == "megatron.core.pipeline_parallel.schedules"
        assert not got["parse_args_wrapped"] and not got["get_model_wrapped"]
        assert got["first_stage"] == "megatron.core.parallel_state"
    # OctoPipe's own options without its schedule: one line, no traceback
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--octopipe-plan configure OctoPipe's schedule; add --pipeline-schedule octopipe" in bad.stderr
