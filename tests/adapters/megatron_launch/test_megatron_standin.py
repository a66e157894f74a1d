"""Stand-in layers of the Megatron benchmark: F, I and W each sleep their own cost once, transfers wait."""

import time

import pytest
import torch

from octopipe_plugin.adapters.megatron.standin import BOUNDARY_SHAPE, DTYPE, StandInLayer, _stamp
from octopipe_plugin.executor.clock import DeviceClock
from octopipe_plugin.executor.split_backward import backward_input, backward_weight

pytestmark = pytest.mark.timeout(60)
F, I, W = 2.0, 3.0, 5.0


def chain(clock, n=3):
    layers = [StandInLayer(clock, F, I, W) for _ in range(n)]
    x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True)
    out = x
    for layer in layers:
        out = layer(out)
    return x, out, [layer.weight for layer in layers]


def test_fused_backward_runs_input_and_weight_work_once_each():
    clock = DeviceClock("device")
    clock.start(time.time())
    x, out, _ = chain(clock)
    assert clock.busy_s == pytest.approx(3 * F / 1000)
    out.sum().backward()
    assert clock.busy_s == pytest.approx(3 * (F + I + W) / 1000)


def test_split_backward_runs_i_at_i_and_w_at_w_nothing_twice():
    # the executor's own split (the one OctoPipe's Megatron schedule uses): I walks the input path only
    clock = DeviceClock("device")
    clock.start(time.time())
    x, out, weights = chain(clock)
    (dx,), work = backward_input([out], [torch.ones_like(out)], [x], weights)
    assert dx is not None and clock.busy_s == pytest.approx(3 * (F + I) / 1000)
    backward_weight(work)
    assert clock.busy_s == pytest.approx(3 * (F + I + W) / 1000)
    assert all(w.grad is not None for w in weights)


def test_a_boundary_is_not_used_before_its_producer_ended_plus_the_transfer():
    clock = DeviceClock("device")
    t0 = time.time()
    clock.start(t0)
    layer = StandInLayer(clock, F, I, W, hop_in_ms=40.0)
    x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True)
    with torch.no_grad():
        x.view(-1)[0] = t0 + 0.01  # the producer ended 10 ms after t0
    y = layer(x)
    # not before (producer end + transfer) + F: the simulator's rule; a loaded host may only make it later
    assert _stamp(y) >= t0 + 0.010 + 0.040 + F / 1000 - 1e-6
    assert time.time() >= t0 + 0.05
