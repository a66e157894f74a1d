"""scripts/gpu_check.sh's CPU-runnable parts: setup choice, plans, prediction, hooks, and the script on CPU tensors."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from octopipe_plugin.testing.toy import ToySpec
from octopipe_plugin.testing import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_setup_uses_nccl_per_gpu_gloo_on_a_shared_gpu_and_cpu_without_one():
    assert gpu_check.choose_setup("auto", 4, gpus=0) == gpu_check.Setup(backend="gloo", device="cpu", world=4,
                                                                         shared_gpu=False)
    one = gpu_check.choose_setup("auto", 4, gpus=1)
    assert (one.backend, one.shared_gpu, one.world) == ("gloo", True, 4)
    assert one.rank_device(3) == torch.device("cuda", 0)
    many = gpu_check.choose_setup("auto", 4, gpus=8)
    assert (many.backend, many.world, many.rank_device(2)) == ("nccl", 4, torch.device("cuda", 2))
    assert gpu_check.choose_setup("cpu", 2, gpus=8).device == "cpu"


def test_plans_and_prediction_from_measured_layer_costs():
    spec = ToySpec(hidden=8, seq=4, batch=2, dtype=torch.float32, layers=gpu_check.CHECK.layers)
    model = gpu_check.layer_costs(spec, torch.device("cpu"), reps=1)
    assert model.num_layers == len(spec.layers) and all(x.fwd_ms > 0 for x in model.layers)
    docs = gpu_check.check_plans(2, model)
    assert [d["label"] for d in docs] == ["1f1b", "interleaved-1f1b", "zb-v", "tuned"]
    from octopipe_plugin.formats import plan_from_dict

    for d in docs:
        pred, serial = gpu_check.predicted_ms(model, plan_from_dict(d["plan"]))
        assert 0 < pred <= serial * 1.0001


def test_a_framework_hook_is_skipped_not_failed_when_its_package_or_hook_is_absent():
    cpu = torch.device("cpu")
    assert gpu_check.hook_check("no_such_package_xyz", "octopipe_plugin.testing.nope", "f", cpu) == (
        "skipped", "not installed (no_such_package_xyz)")
    status, detail = gpu_check.hook_check("torch", "octopipe_plugin.testing.no_such_hook", "one_step", cpu)
    assert status == "skipped" and "hook not provided" in detail


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_script_runs_on_cpu_tensors():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--ranks", "2", "--steps", "1",
                           "--plans", "zb-v,tuned"], cwd=ROOT, capture_output=True, text=True, timeout=380,
                          env={**os.environ, "PYTHON": sys.executable})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "backend gloo, 2 ranks on cpu" in out
    assert "[passed] plan zb-v:" in out and "[passed] plan tuned:" in out, out
    assert "[passed] local stages:" in out and "[skipped] cuda lane self path: needs CUDA" in out, out
    assert "[failed]" not in out, out
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"gpu check: (\d+) passed, 0 failed", last)
    assert m and int(m.group(1)) >= 3, last
