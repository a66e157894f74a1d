"""A stack of Megatron's own MLP blocks (Column/RowParallelLinear, local spec) for checking and timing I/W.

Shared by the benchmark (benchmarks/megatron_wgrad.py prints B against I+W) and the tests
(gradients of B and of I+W agree, each weight GEMM runs once, AccumulateGrad hooks fire
once per parameter). Needs megatron's parallel state initialised (TP=1 on a one-rank group
will do); builds everything on the CPU.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..adapters.megatron import wgrad
from ..adapters.megatron.wgrad import Phase, enable_wgrad_split, input_pass, weight_pass
from ..executor.split_backward import backward_input, backward_weight


@dataclass
class GemmCounts:
    """What the split linears of this process ran while `counting_gemms` was installed."""

    forward_calls: int = 0  # forwards under autograd (each will need an input and a weight GEMM)
    input_gemms: int = 0
    weight_gemms: int = 0


@contextmanager
def counting_gemms():
    """Count the split linears' forwards and backward GEMMs in this process while the block runs.

    Test-only: wraps the adapter's one `SplitLinear` class (`apply`, `backward`) and its two
    half-backward functions for the block's duration, so the runtime path carries no counter.
    A fused backward (B, Megatron's own) counts one input and one weight GEMM.
    """
    counts = GemmCounts()
    split = wgrad._function_class()
    orig_apply, orig_backward = split.apply, split.__dict__["backward"]
    orig_input, orig_weight = wgrad._input_grad, wgrad._weight_grad

    def apply(*args):
        if torch.is_grad_enabled():
            counts.forward_calls += 1
        return orig_apply(*args)

    def input_grad(*args):
        counts.input_gemms += 1
        return orig_input(*args)

    def weight_grad(*args):
        counts.weight_gemms += 1
        return orig_weight(*args)

    def backward(ctx, grad_output):
        before = (counts.input_gemms, counts.weight_gemms)
        out = orig_backward.__func__(ctx, grad_output)
        if (counts.input_gemms, counts.weight_gemms) == before:  # neither half alone: Megatron's fused B ran
            counts.input_gemms += 1
            counts.weight_gemms += 1
        return out

    split.apply, split.backward = apply, staticmethod(backward)
    wgrad._input_grad, wgrad._weight_grad = input_grad, weight_grad
    try:
        yield counts
    finally:
        del split.apply  # back to torch.autograd.Function's classmethod
        split.backward = orig_backward
        wgrad._input_grad, wgrad._weight_grad = orig_input, orig_weight


class MLPStack(torch.nn.Module):
    """`layers` pre-norm residual blocks of Megatron's MLP (fc1 column-parallel, GELU, fc2 row-parallel)."""

    def __init__(self, hidden: int, layers: int, seed: int = 0):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.mlp import MLP, MLPSubmodules

        cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=1,
                                ffn_hidden_size=4 * hidden,
                                use_cpu_initialization=True, perform_initialization=False,
                                gradient_accumulation_fusion=False, bias_activation_fusion=False,
                                add_bias_linear=True)
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))
        self.mlps = torch.nn.ModuleList(MLP(cfg, sub) for _ in range(layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x)) per block."""
        for norm, mlp in zip(self.norms, self.mlps):
            out, bias = mlp(norm(x))
            x = x + out + (bias if bias is not None else 0)
        return x


def _inputs(hidden: int, seq: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, hidden, generator=g).requires_grad_(True)
    return x, torch.randn(seq, batch, hidden, generator=g)


def run_b(model, x, dy) -> torch.Tensor:
    """Fused backward: returns the input gradient; parameter gradients accumulate in .grad."""
    out = model(x)
    (dx,) = torch.autograd.grad([out], [x], [dy], retain_graph=True)
    torch.autograd.backward([out], [dy])
    return dx


def run_split(model, x, dy, phase: Phase | None) -> torch.Tensor:
    """I then W: with `phase` the adapter's split (linears do one GEMM each), without it the executor's plain split."""
    out = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    if phase is not None:
        (dx,), work = input_pass([out], [dy], [x], params, phase)
        weight_pass(work)
        return dx
    (dx,), work = backward_input([out], [dy], [x], params)
    backward_weight(work)
    return dx


def time_backward(hidden: int = 512, layers: int = 4, seq: int = 256, batch: int = 4, reps: int = 5) -> dict:
    """Median CPU time (ms, this process only: robust to other load) of B, and of I and W under both splits.

    Each repetition runs an untimed forward, then times only the backward part(s) that follow it.
    """
    model = MLPStack(hidden, layers)
    x, dy = _inputs(hidden, seq, batch, 1)
    phase = Phase()
    split_model = MLPStack(hidden, layers)
    enable_wgrad_split(split_model, phase)
    params = [p for p in model.parameters() if p.requires_grad]
    split_params = [p for p in split_model.parameters() if p.requires_grad]
    clock = time.process_time

    def b():
        model.zero_grad(set_to_none=True)
        out = model(x)
        t0 = clock()
        torch.autograd.backward([out, x], [dy, torch.zeros_like(x)])  # x.grad too, as a stage's B gives it
        return {"B": clock() - t0}

    def split():
        split_model.zero_grad(set_to_none=True)
        out = split_model(x)
        t0 = clock()
        _, work = input_pass([out], [dy], [x], split_params, phase)
        t1 = clock()
        weight_pass(work)
        return {"I split linears": t1 - t0, "W split linears": clock() - t1}

    def plain():
        model.zero_grad(set_to_none=True)
        out = model(x)
        t0 = clock()
        _, work = backward_input([out], [dy], [x], params)
        t1 = clock()
        backward_weight(work)
        return {"I plain split": t1 - t0, "W plain split": clock() - t1}

    samples: dict[str, list[float]] = {}
    for fn in (b, split, plain):
        fn()  # warm-up
        for _ in range(reps):
            for k, v in fn().items():
                samples.setdefault(k, []).append(v * 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
