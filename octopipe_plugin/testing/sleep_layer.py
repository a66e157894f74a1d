"""The sleeping stand-in layer every framework benchmark builds on: F forward, I and W backward, on a DeviceClock.

One model-graph layer becomes one SleepLayer of its (scaled) F, I and W time. Its output is
`InputPath(x) + WeightPath(weight)`: the input-gradient path sleeps I, the weight path
(reached only from the parameter) sleeps W, so a fused backward (B) sleeps I + W once and a
split backward sleeps I in its I action and W in its W action, as zero-bubble pipelines do,
nothing twice. Every activation and gradient carries, in its element 0, the device-clock time
its producer finished (float64: a host time stamp needs its precision); a layer does not use
its input before that time plus the transfer time of the cut, on the rank's DeviceClock
(executor/clock.py, the simulator's timing rule). The parameter's size is a knob, so a
framework's size-based partition (DeepSpeed's `parameters`) cuts the stand-in model where it
would cut the real one. Adapters only wrap it: a MegatronModule chunk of SleepLayers
(testing/megatron_standin.py), a LayerSpec list (testing/deepspeed_standin.py).

On the clock's 'wall' mode the stamps are not waited for (executor/clock.py): the benchmarks
then make the tensors that cross a cut as large as the model's bytes there (`wall_numel`),
so the framework's own p2p really moves them; `out_shape` lets a chunk keep its inner
layers' tensors small and give only its last layer the boundary's size.
"""

from __future__ import annotations

import torch
from torch import nn

from ..executor.clock import DeviceClock

DTYPE = torch.float64


def stamp(t: torch.Tensor) -> float:
    """The producer's end time carried in element 0 (0 for an empty tensor)."""
    return float(t.detach().reshape(-1)[0]) if t.numel() else 0.0


def stamped(end: float, shape) -> torch.Tensor:
    """A float64 tensor of `shape` carrying `end` in element 0."""
    out = torch.zeros(shape, dtype=DTYPE)
    if out.numel():
        out.view(-1)[0] = end
    return out


class _InputPath(torch.autograd.Function):
    """F on the way forward, I on the way back; passes the producer's end time along in the tensor."""

    @staticmethod
    def forward(ctx, x, clock, f_ms, i_ms, hop_in_ms, hop_out_ms, out_shape=None):
        ctx.clock, ctx.i_ms, ctx.hop_out_ms, ctx.in_shape = clock, i_ms, hop_out_ms, x.shape
        return stamped(clock.work(f_ms, stamp(x) + hop_in_ms / 1000.0), out_shape or x.shape)

    @staticmethod
    def backward(ctx, grad):
        end = ctx.clock.work(ctx.i_ms, stamp(grad) + ctx.hop_out_ms / 1000.0)
        return stamped(end, ctx.in_shape), None, None, None, None, None, None


class _WeightPath(torch.autograd.Function):
    """W: the weight gradient, reached only from the parameter (so I never runs it)."""

    @staticmethod
    def forward(ctx, weight, clock, w_ms, shape):
        ctx.clock, ctx.w_ms, ctx.weight_like = clock, w_ms, (weight.shape, weight.dtype)
        return torch.zeros(shape, dtype=DTYPE)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.work(ctx.w_ms)
        shape, dtype = ctx.weight_like
        return torch.zeros(shape, dtype=dtype), None, None, None


class SleepLayer(nn.Module):
    """One model-graph layer: sleeps F forward, I for the input gradient, W for its weight gradient.

    `hop_in_ms` / `hop_out_ms`: transfer time of the cut into / out of this layer (first / last
    layer of a stage); `numel`: parameter size (for size-based partitions); `param_dtype`: the
    parameter's dtype (DeepSpeed reduces float32 gradients, not float64); `out_shape`: the
    output's shape (None: the input's).
    """

    def __init__(self, clock: DeviceClock, f_ms: float, i_ms: float, w_ms: float, hop_in_ms: float = 0.0,
                 hop_out_ms: float = 0.0, numel: int = 1, param_dtype: torch.dtype = DTYPE,
                 out_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.clock, self.f_ms, self.i_ms, self.w_ms = clock, f_ms, i_ms, w_ms
        self.hop_in_ms, self.hop_out_ms = hop_in_ms, hop_out_ms
        self.out_shape = tuple(out_shape) if out_shape is not None else None
        self.weight = nn.Parameter(torch.zeros(max(1, int(numel)), dtype=param_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stamped output; adding the zero weight path ties W to this layer's backward."""
        y = _InputPath.apply(x, self.clock, self.f_ms, self.i_ms, self.hop_in_ms, self.hop_out_ms, self.out_shape)
        return y + _WeightPath.apply(self.weight, self.clock, self.w_ms, y.shape)
