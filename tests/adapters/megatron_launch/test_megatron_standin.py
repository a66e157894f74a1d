"""Stand-in Megatron chunks: a MegatronModule around the core's SleepLayers, each layer's F, I and W slept once."""

import time

import pytest
import torch

from octopipe_plugin.testing.megatron_standin import BOUNDARY_SHAPE, StandInStage, standin_chunk_class
from octopipe_plugin.executor.clock import DeviceClock
from octopipe_plugin.testing.sleep_layer import DTYPE, SleepLayer, stamp

pytestmark = [pytest.mark.framework, pytest.mark.timeout(120)]
F, I, W = 2.0, 3.0, 5.0


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=BOUNDARY_SHAPE[2], num_attention_heads=1,
                             pipeline_dtype=DTYPE, params_dtype=DTYPE)


def test_a_middle_chunk_runs_its_sleep_layers_on_the_pipeline_input():
    clock = DeviceClock("device")
    t0 = time.time()
    clock.start(t0)
    spec = StandInStage(stage=1, layers=((F, I, W),) * 2, hop_in_ms=20.0, hop_out_ms=0.0, first=False, last=False)
    chunk = standin_chunk_class()(_config(), spec, clock)
    assert all(isinstance(layer, SleepLayer) for layer in chunk.layers)
    x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True)
    with torch.no_grad():
        x.view(-1)[0] = t0
    chunk.set_input_tensor([x])
    out = chunk()
    assert out.shape == BOUNDARY_SHAPE and stamp(out) >= t0 + 0.020 + 2 * F / 1000 - 1e-6
    out.sum().backward()
    assert clock.busy_s == pytest.approx(2 * (F + I + W) / 1000) and x.grad is not None


def test_an_empty_chunk_still_hands_its_input_on():
    clock = DeviceClock("off")
    spec = StandInStage(stage=0, layers=(), hop_in_ms=0.0, hop_out_ms=0.0, first=True, last=False)
    out = standin_chunk_class()(_config(), spec, clock)()
    assert out.shape == BOUNDARY_SHAPE and out.requires_grad
