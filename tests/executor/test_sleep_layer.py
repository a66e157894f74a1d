"""The sleeping stand-in layer of both benchmarks and its DeviceClock: F, I and W each sleep once, transfers wait."""

import time

import pytest
import torch

from octopipe_plugin.executor import clock as clock_module
from octopipe_plugin.executor.clock import DeviceClock
from octopipe_plugin.testing.sleep_layer import DTYPE, SleepLayer, stamp
from octopipe_plugin.executor.split_backward import backward_input, backward_weight

pytestmark = pytest.mark.timeout(60)
F, I, W = 2.0, 3.0, 5.0
BOUNDARY_SHAPE = (1, 1, 4)  # the Megatron stand-in chunks' boundary


def chain(clock, n=3):
    layers = [SleepLayer(clock, F, I, W) for _ in range(n)]
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
    layer = SleepLayer(clock, F, I, W, hop_in_ms=40.0)
    x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True)
    with torch.no_grad():
        x.view(-1)[0] = t0 + 0.01  # the producer ended 10 ms after t0
    y = layer(x)
    # not before (producer end + transfer) + F: the simulator's rule; a loaded host may only make it later
    assert stamp(y) >= t0 + 0.010 + 0.040 + F / 1000 - 1e-6
    assert time.time() >= t0 + 0.05


def test_a_layer_keeps_the_activation_shape_and_sizes_its_parameter():
    # DeepSpeed's `parameters` partition counts parameters: the knob must reach the layer
    clock = DeviceClock("off")
    layer = SleepLayer(clock, F, I, W, numel=37, param_dtype=torch.float32)
    x = torch.zeros(2, 8, dtype=DTYPE, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == DTYPE and layer.weight.numel() == 37
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (37,) and layer.weight.grad.dtype == torch.float32


class FakeHost:
    """A host clock whose every sleep wakes `late` seconds after its deadline (a loaded scheduler)."""

    def __init__(self, late: float):
        self.now, self.late = 1000.0, late

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds + self.late


def test_oversleeping_is_taken_back_but_a_late_host_is_charged(monkeypatch):
    host = FakeHost(late=0.0004)
    monkeypatch.setattr(clock_module, "time", host)  # the clock module's view of the host clock only
    clock = DeviceClock("device")
    clock.start(host.now)
    t0 = host.now
    for _ in range(100):  # 100 actions of 1 ms: their oversleeps do not add up on the device
        end = clock.work(1.0)
    assert end == pytest.approx(t0 + 0.100)
    assert host.now - end == pytest.approx(0.0004)  # the host trails by one oversleep only
    host.now += 0.005  # the host reaches the next 1 ms action 5 ms late: the device waits for it
    end = clock.work(1.0)
    assert end == pytest.approx(t0 + 0.105)
    assert clock.busy_s == pytest.approx(0.101)


def test_wall_clock_waits_for_no_stamped_arrival_and_charges_the_host(monkeypatch):
    # wall mode: the input is there when the host received it (the payload travelled); its cost runs from now
    host = FakeHost(late=0.0)
    monkeypatch.setattr(clock_module, "time", host)
    clock = DeviceClock("wall")
    clock.start(host.now)
    t0 = host.now
    end = clock.work(1.0, ready_at=t0 + 5.0)  # a stamp 5 s ahead, as the device clock would wait for
    assert end == pytest.approx(t0 + 0.001)
    host.now += 0.005  # a late host is charged in full: nothing hides it
    assert clock.work(1.0) == pytest.approx(t0 + 0.007)


def test_out_shape_sends_the_boundary_size_and_hands_back_the_input_shape():
    # a Megatron chunk on the wall clock: inner layers small, the last makes the boundary of the model's bytes
    clock = DeviceClock("off")
    big = (1, 1, 1024)
    x = torch.zeros(big, dtype=DTYPE, requires_grad=True)  # received: the boundary's size
    inner = SleepLayer(clock, F, I, W, out_shape=BOUNDARY_SHAPE)
    last = SleepLayer(clock, F, I, W, out_shape=big)
    h = inner(x)
    y = last(h)
    assert h.shape == BOUNDARY_SHAPE and y.shape == big
    y.sum().backward()
    assert x.grad.shape == big and inner.weight.grad is not None and last.weight.grad is not None
