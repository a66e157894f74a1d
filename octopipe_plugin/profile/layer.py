"""What the profiler measures: a layer as a module factory plus an example input, and its signature."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

InputFactory = Callable[[torch.device], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileLayer:
    """One partitioning unit to profile.

    `build()` makes the module (on CPU; the profiler moves it to its device). `example_input(device)`
    gives one micro-batch's input; None means "a tensor shaped like the previous layer's output"
    (random values: costs do not depend on them). `signature` names the layer's structure when the
    caller knows it without building (adapters: the spec and config); None derives it from the
    built module. Layers with equal signatures and input shapes are measured once.
    """

    name: str
    kind: str
    build: Callable[[], nn.Module]
    example_input: InputFactory | None = None
    signature: str | None = None
    meta: dict = field(default_factory=dict)


def module_signature(module: nn.Module) -> str:
    """A digest of a module's structure: its printed tree, every parameter's and buffer's shape and dtype."""
    parts = [type(module).__module__ + "." + type(module).__qualname__, repr(module)]
    for name, p in module.named_parameters():
        parts.append(f"p {name} {tuple(p.shape)} {p.dtype} {p.requires_grad}")
    for name, b in module.named_buffers():
        parts.append(f"b {name} {tuple(b.shape)} {b.dtype}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def tensor_meta(t: torch.Tensor) -> dict:
    """Shape and dtype of a tensor as JSON."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def tensor_from_meta(meta: dict, device: torch.device, seed: int = 0) -> torch.Tensor:
    """A random tensor of a recorded shape and dtype (integers in [0, 2) so any embedding accepts them)."""
    dtype = getattr(torch, meta["dtype"])
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(meta["shape"], generator=g, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(0, 2, meta["shape"], generator=g, dtype=dtype)
    return t.to(device)
