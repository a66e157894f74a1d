"""scripts/gpu_check.sh's CPU-runnable parts: setup choice, plans, prediction, and one run on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from octopipe_plugin.executor import gpu_check
from octopipe_plugin.testing.toy import ToySpec


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


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_check_runs_on_cpu_tensors(capsys):
    assert gpu_check.main(["--device", "cpu", "--ranks", "2", "--steps", "1", "--plans", "zb-v,tuned"]) == 0
    out = capsys.readouterr().out
    assert "backend gloo, 2 ranks on cpu" in out
    assert out.count(" ok ") == 2 and "FAIL" not in out
