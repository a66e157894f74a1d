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


class _Recorder:
    """A PairSleeper stand-in that records what a pair asks it to sleep (and sleeps nothing)."""

    def __init__(self):
        self.calls = []

    def sleep(self, seq_f, seq_b, rest_ms):
        self.calls.append((seq_f, seq_b, rest_ms))


def _stamped_input(t0):
    x = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE, requires_grad=True)
    with torch.no_grad():
        x.view(-1)[0] = t0
    return x


def test_a_pair_of_schedule_plans_sleeps_both_sides_phases_once_and_stamps_its_end():
    # the combined step's contract (combined_1f1b.py): type(plan).run(f_plan, b_plan, b_grad=...) -> F's output
    from octopipe_plugin.executor.standin import pair_rest_ms

    clock, pairs = DeviceClock("device"), _Recorder()
    t0 = time.time()
    clock.start(t0)
    seq_f, seq_b = ((False, 1.0), (True, 2.0), (False, 1.0)), ((False, 3.0), (True, 2.0), (False, 1.0))
    make = standin_chunk_class()
    a = make(_config(), StandInStage(stage=1, layers=((F, I, W),), hop_in_ms=4.0, hop_out_ms=0.0, first=False,
                                     last=False, phases_f=seq_f, phases_b=seq_b), clock, pairs=pairs)
    b = make(_config(), StandInStage(stage=2, layers=((F, I, W),) * 2, hop_in_ms=0.0, hop_out_ms=6.0, first=False,
                                     last=False, phases_f=seq_f, phases_b=seq_b), clock, pairs=pairs)
    xb = _stamped_input(t0)
    b.set_input_tensor([xb])
    b_plan = b.build_schedule_plan(None)
    out_b = type(b_plan).run(b_plan, None)  # B's forward alone: its layers sleep F on the clock
    assert stamp(out_b) >= t0 + 2 * F / 1000 - 1e-6 and not pairs.calls
    busy = clock.busy_s
    a.set_input_tensor([_stamped_input(t0)])
    f_plan = a.build_schedule_plan(None)
    grad = torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE)
    grad.view(-1)[0] = stamp(out_b)
    out_a = type(f_plan).run(f_plan, b_plan, b_grad=grad)
    # one pair: A's F phases with B's fused-backward phases, what their costs hold beyond the phases after them
    assert pairs.calls == [(seq_f, seq_b, pair_rest_ms(F, 2 * (I + W), seq_f, seq_b))]
    assert clock.mode == "device" and clock.busy_s - busy < 0.002  # the layers slept nothing of their own
    end = clock.free
    assert end >= stamp(out_b) + 0.006 - 1e-6  # the pair waited for B's gradient to land over its hop
    assert stamp(out_a) == pytest.approx(end) and xb.grad is not None and stamp(xb.grad) == pytest.approx(end)


def test_a_pair_without_phases_sleeps_its_two_sides_back_to_back():
    clock = DeviceClock("device")
    clock.start(time.time())
    make = standin_chunk_class()
    spec = dict(hop_in_ms=0.0, hop_out_ms=0.0, first=False, last=False)
    a = make(_config(), StandInStage(stage=1, layers=((F, I, W),), **spec), clock)
    b = make(_config(), StandInStage(stage=2, layers=((F, I, W),), **spec), clock)
    b.set_input_tensor([_stamped_input(0.0)])
    b_plan = b.build_schedule_plan(None)
    type(b_plan).run(b_plan, None)
    a.set_input_tensor([_stamped_input(0.0)])
    f_plan = a.build_schedule_plan(None)
    busy = clock.busy_s
    type(f_plan).run(f_plan, b_plan, b_grad=torch.zeros(BOUNDARY_SHAPE, dtype=DTYPE))
    assert clock.busy_s - busy == pytest.approx((F + I + W) / 1000)
