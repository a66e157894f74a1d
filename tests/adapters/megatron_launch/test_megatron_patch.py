"""patches/megatron-core-0.19.2-octopipe.patch applies to the installed megatron/training files and works."""

import json
import os
import shutil
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
PATCH = ROOT / "patches" / "megatron-core-0.19.2-octopipe.patch"
pytestmark = [pytest.mark.framework, pytest.mark.timeout(180)]


def installed_megatron() -> Path:
    """The installed megatron package directory."""
    from octopipe_plugin.adapters.megatron.compat import allow_megatron_training_import

    allow_megatron_training_import()
    import megatron.training  # megatron is a namespace package: locate it through a subpackage

    return Path(megatron.training.__file__).resolve().parents[1]


def test_patch_applies_to_the_installed_release():
    site = installed_megatron().parent
    out = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(PATCH)], cwd=site, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout and "offset" not in out.stdout and "fuzz" not in out.stdout.lower()


def test_patched_megatron_takes_octopipe_arguments_and_schedule(tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(installed_megatron(), copy / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["patch", "-p1", "-i", str(PATCH)], cwd=copy, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    model = model_from_megatron(parse(TINY_GPT, octopipe=False, validate=False))
    write_plan(build_plan(model, "interleaved-zb", 2, 4, stages_per_device=2, boundaries=STAGES), tmp_path / "plan.json")
    job = {"world": 2, "argv": TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                                           "--tokenizer-type", "NullTokenizer",
                                           "--pipeline-schedule", "octopipe", "--octopipe-plan",
                                           str(tmp_path / "plan.json")]}
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_patched_run.py")), json.dumps(job)],
                         capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["megatron"].startswith(str(copy))  # the patched copy ran, not the installed package
    assert got["factory"] == "octopipe_plugin.adapters.megatron.launch"
    assert (got["schedule"], got["layout"], got["vp"]) == ("octopipe", "Et|tt|tt|tL", 2)
