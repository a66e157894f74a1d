"""The frameworks install with the project and still expose the hook points the adapters will use.

No skip on a missing package: CI must fail if megatron-core or DeepSpeed is absent.
"""

import inspect

import pytest

pytestmark = pytest.mark.framework


def test_megatron_core_schedule_entry_point():
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    fn = pipeline_parallel.get_forward_backward_func
    assert callable(fn)
    params = inspect.signature(schedules.forward_backward_pipelining_with_interleaving).parameters
    for name in ("forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only"):
        assert name in params


def test_deepspeed_pipeline_hooks():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule

    assert hasattr(PipelineModule, "_partition_layers")
    assert hasattr(PipelineEngine, "_INSTRUCTION_MAP")
    for name in ("ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad"):
        assert hasattr(schedule, name)
    import torch

    spec = LayerSpec(torch.nn.Linear, 4, out_features=2)
    assert spec.typename is torch.nn.Linear and spec.module_args == (4,) and spec.module_kwargs == {"out_features": 2}


def test_core_never_imports_a_framework():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "octopipe_plugin"
    for path in root.rglob("*.py"):
        if "adapters" in path.parts or "testing" in path.parts:  # testing/: the stand-ins build framework chunks
            continue
        text = path.read_text()
        assert "import megatron" not in text and "from megatron" not in text, path
        assert "import deepspeed" not in text and "from deepspeed" not in text, path
