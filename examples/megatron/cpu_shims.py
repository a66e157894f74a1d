"""CPU-only shims for running Megatron's own pipeline schedule over gloo (benchmark --stand-in only).

megatron-core 0.19.2's schedules and p2p code create a few tensors on "cuda" and call
`torch.cuda.current_device()` / `torch.cuda.synchronize()`. On a machine without a GPU these
are redirected to the CPU; the schedule code that runs is Megatron's own. Never imported by
the plugin; on GPUs the benchmark does not install them.
"""

from __future__ import annotations

import functools

import torch

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full")


def install() -> None:
    """Redirect Megatron's hard-coded CUDA calls to the CPU (idempotent)."""
    if getattr(torch.cuda, "_octopipe_cpu_shims", False):
        return
    torch.cuda._octopipe_cpu_shims = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make
