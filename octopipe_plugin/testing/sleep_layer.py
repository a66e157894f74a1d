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

Under a plan that splits the LM head, the owner stage ends in a `HeadHandOver`: its forward
hands the head's input on as a summable stamp (executor/standin.py `split_stamp`) for the
rank's `SleepShards`, its backward waits for the shards' summed partials (`split_ready`), so
the framework's own stage code runs the owner and SleepShards the shard passes, on one clock.
`add_standin_options` / `check_standin_scale`: the command-line options and the host-share
check every stand-in benchmark shares (the Megatron and the DeepSpeed one).
"""

from __future__ import annotations

import torch
from torch import nn

from ..executor.clock import DeviceClock
from ..executor.standin import SleepShards

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


class _HandOver(torch.autograd.Function):
    """The owner's hand-over to a split head: a summable stamp forward, the summed partials' arrival backward."""

    @staticmethod
    def forward(ctx, x, shards, mb):
        ctx.shards, ctx.mb, ctx.in_shape = shards, mb, x.shape
        return shards.stamp("head-input", mb, stamp(x))

    @staticmethod
    def backward(ctx, grad):
        ready = ctx.shards.ready_at(grad, f"owner backward of micro-batch {ctx.mb}", ctx.mb, "head-partial")
        return stamped(ready, ctx.in_shape), None, None


class HeadHandOver(nn.Module):
    """The end of the stage that owns a split LM head: its output is the head's input for every shard.

    `shards`: the rank's SleepShards (its `hand_over` meta is the output's shape and dtype); `mb`: the
    micro-batch when the layer knows it (a callable returning it), else -1 (the shards then check the
    hand-over's kind only)."""

    def __init__(self, shards: SleepShards, mb=None):
        super().__init__()
        self.shards = shards
        self.mb = mb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input as a summable stamp of the end time of the stage's last layer."""
        mb = int(self.mb()) if self.mb is not None else -1
        return _HandOver.apply(x, self.shards, mb)


# ----- what every stand-in benchmark's command line shares

HOST_SHARE_FLAG = "--strict-host-share"


def add_standin_options(p, *, clock_help: str) -> None:
    """Register the stand-in options both framework benchmarks take: the clock, this host's links, the
    overheads the scale is checked against, and the split plan to measure beside the plan without splits."""
    p.add_argument("--clock", default="device", choices=("device", "wall"), help=clock_help)
    p.add_argument("--links", help="with --clock wall: cluster file of this host's links (octopipe cluster --measure) "
                                   "pricing the transfers in the prediction (default: --cluster's)")
    p.add_argument("--overheads", metavar="FILE",
                   help="octopipe-overheads/1 file the scale is checked against (default: this machine's, measured "
                        "once by `octopipe profile --overheads` and cached)")
    p.add_argument(HOST_SHARE_FLAG, action="store_true",
                   help="refuse a --target-ms at which the executor's host overhead exceeds 5%% of a modelled step "
                        "(default: warn)")
    p.add_argument("--splits", default="auto", choices=("auto", "off"),
                   help="auto (default): also run OctoPipe with split layers (the LM head divided by vocabulary rows "
                        "over several ranks; tuned by the split-aware tuner unless --split-plan) and print the "
                        "measured split gain; off: only the plans without splits")
    p.add_argument("--split-plan", metavar="FILE", help="the octopipe-plan/1 file with split layers to run "
                                                        "(default: tune one with --splits auto)")


def standin_sim_options(args, world: int):
    """The simulator options a stand-in benchmark tunes and predicts with: this host's measured overheads (--overheads,
    else `profile.overheads.machine_overheads`) times the ranks per core, since `world` local ranks share
    `os.cpu_count()` cores for the executor's host work (every message's; a split head's fan-out sends many,
    issue 36); the per-byte parts only on the wall clock (on the device clock messages are stamps, not the model's
    bytes); no overheads at hand: plain options."""
    import os

    from ..profile.overheads import machine_overheads
    from ..simulator import SimOptions

    ov = machine_overheads(args.overheads)
    if ov is None:
        return SimOptions()
    return SimOptions(overheads=ov.scaled(max(1.0, world / (os.cpu_count() or 1)), per_mb=args.clock == "wall"))


def check_standin_scale(args, runs) -> bool:
    """Warn, or refuse (True) under --strict-host-share, where --target-ms lets host overhead decide the figures.

    `runs`: (label, plan, modelled step ms at the chosen scale) of every plan the benchmark runs."""
    import sys

    from ..profile.overheads import machine_overheads
    from ..simulator.overheads import scale_warnings

    lines = scale_warnings(runs, machine_overheads(args.overheads), "--target-ms", args.target_ms)
    for line in lines:
        print(f"{'error' if args.strict_host_share else 'warning'}: {line}", file=sys.stderr)
    return bool(lines) and args.strict_host_share
