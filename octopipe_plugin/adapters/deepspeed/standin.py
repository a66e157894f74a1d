"""Stand-in layers for DeepSpeed pipelines: each layer sleeps its (scaled) F, I and W times.

The same idea as the executor's SleepStages (octopipe_plugin/executor/standin.py), at the
level DeepSpeed's own engines need: real `nn.Module` layers inside a PipelineModule, so the
stock PipelineEngine, its DualPipeVEngine and OctoPipeEngine run side by side on the same
model. A layer's output is `Compute(x) + Weight(w)`: the input-gradient path sleeps I, the
weight path sleeps W, so a fused backward sleeps I + W and OctoPipe's split backward sleeps I
in its I action and W in its W action. Sleeping costs no CPU, so eight ranks fit on two cores.
Each layer holds a parameter whose size is proportional to the real layer's, so DeepSpeed's
`parameters` partition splits the stand-in model where it would split the real one.
"""

from __future__ import annotations

import time

import torch
from torch import nn

WIDTH = 8  # the activation every stand-in layer passes on: [micro-batch, WIDTH] floats


class SleepClock:
    """Carries each sleep's overshoot into the next one, so a rank's many short sleeps add up to their sum.

    time.sleep wakes late (scheduler granularity, more so on a loaded host); a stage of a few
    layers sleeps hundreds of times per step, and uncorrected those delays would be charged
    to the engines as if the layers were slower. One clock per process (all its layers).
    """

    def __init__(self):
        self.debt = 0.0

    def sleep(self, seconds: float) -> None:
        """Sleep `seconds` minus what earlier sleeps overshot."""
        target = seconds - self.debt
        if target <= 0:
            self.debt = -target
            return
        start = time.perf_counter()
        time.sleep(target)
        self.debt = time.perf_counter() - start - target


CLOCK = SleepClock()  # shared by every SleepLayer of the process: the overshoot is the process's


class _Compute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        CLOCK.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CLOCK.sleep(ctx.bwd_s)
        return grad, None, None


class _Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, like, wgrad_s: float):
        ctx.wgrad_s = wgrad_s
        ctx.shape = w.shape
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad):
        CLOCK.sleep(ctx.wgrad_s)
        return torch.zeros(ctx.shape, dtype=grad.dtype), None, None


class SleepLayer(nn.Module):
    """A layer that sleeps fwd_ms in F, bwd_ms in I and wgrad_ms in W; `numel` sizes its parameter."""

    def __init__(self, fwd_ms: float, bwd_ms: float, wgrad_ms: float, numel: int = 1):
        super().__init__()
        self.times = (fwd_ms / 1000.0, bwd_ms / 1000.0, wgrad_ms / 1000.0)
        self.weight = nn.Parameter(torch.zeros(max(1, int(numel))))

    def forward(self, x):
        f, i, w = self.times
        # x.detach(): the weight path must not lie on the input-gradient path, or I would run (and sleep) W too
        return _Compute.apply(x, f, i) + _Weight.apply(self.weight, x.detach(), w)


def standin_specs(model, scale: float, param_divisor: float):
    """One LayerSpec of SleepLayer per model layer: costs times `scale`, parameters state/18/param_divisor."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(SleepLayer, layer.fwd_ms * scale, layer.bwd_ms * scale, layer.wgrad_ms * scale,
                      max(1, round(layer.state_bytes / 18 / param_divisor)))
            for layer in model.layers]


def standin_loss(out, labels):
    """A scalar from the last stand-in layer's output (the loss's own cost is part of the last layer)."""
    return (out * labels).mean()


def standin_batches(n: int, micro_batch_size: int = 1):
    """n micro-batches (input, labels) of the stand-in width."""
    return [(torch.ones(micro_batch_size, WIDTH), torch.ones(micro_batch_size, WIDTH)) for _ in range(n)]
