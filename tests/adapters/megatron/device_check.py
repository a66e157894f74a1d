"""Catch tensors the plugin makes without placing them on the model's device (CPU tests can fail on it).

On a CPU-only machine every tensor lands on the CPU, placed or not. `PlacementCheck` is a
TorchFunctionMode that records each tensor factory call (torch.zeros, torch.tensor, ...) made
from a frame inside `octopipe_plugin/` that gives no `device=` or makes the tensor on another
device than the model's; `object_sends_with_tensors` wraps torch.distributed's object
collectives and records any object holding a tensor (pickled, it would unpickle onto the
sender's GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

PLUGIN = os.sep + "octopipe_plugin" + os.sep
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.rand, torch.randn,
             torch.randint, torch.as_tensor, torch.eye, torch.linspace}
SKIP = (os.sep + "torch" + os.sep, "cpu_shims.py", "device_check.py")


def _caller() -> tuple[str, int]:
    """The first frame outside torch and the shims: who asked for the tensor."""
    f = sys._getframe(2)
    while f is not None and any(s in f.f_code.co_filename for s in SKIP):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("?", 0)


class PlacementCheck(TorchFunctionMode):
    """Records plugin factory calls without an explicit device on `device`."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.problems: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES or getattr(func, "__wrapped__", None) in FACTORIES:
            path, line = _caller()
            if PLUGIN in path:
                where = f"{path.split(PLUGIN, 1)[1]}:{line} {getattr(func, '__name__', func)}"
                if "device" not in kwargs:
                    self.problems.append(f"{where}: no device= (lands on the default device, not the model's)")
                elif isinstance(out, torch.Tensor) and out.device != self.device:
                    self.problems.append(f"{where}: made on {out.device}, the model is on {self.device}")
        return out


def _tensors_in(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_tensors_in(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_tensors_in(v) for v in obj)
    return False


@contextlib.contextmanager
def object_sends_with_tensors(problems: list[str]):
    """Inside: torch.distributed's object sends record any object holding a tensor into `problems`."""
    names = ("send_object_list", "broadcast_object_list", "all_gather_object", "gather_object")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name, fn):
        def call(objects, *args, **kwargs):
            if _tensors_in(objects) and PLUGIN in _caller()[0]:
                problems.append(f"{name} from {_caller()[0].split(PLUGIN, 1)[1]}: pickles a tensor")
            return fn(objects, *args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
