"""CPU-only shims that let megatron-core 0.19.x run on CPU processes over gloo (never imported by the plugin).

The one copy, used by `cpu_run.py` (a launch on a laptop), `benchmark.py --stand-in` and the
tests (tests/adapters/megatron/megatron_cpu_shims.py imports this file). Megatron hard-codes a
few CUDA calls (current device, streams, synchronize, `.cuda()`, the dropout RNG tracker,
`param.type() == 'torch.cuda.FloatTensor'` checks in its optimizers). Each shim redirects one
of them to its CPU equivalent; the model, DDP, optimizer, schedule and training-loop code that
runs is Megatron's own. `install_for_pretrain()` adds what `megatron.training.pretrain` needs
on top (see docs in the function).
"""

from __future__ import annotations

import contextlib
import os
import typing

import torch
import torch.distributed as dist

_INSTALLED = False


def install() -> None:
    """Install every shim (idempotent); call before importing megatron in a worker."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not hasattr(typing, "override"):  # megatron.training imports it (Python >= 3.12)
        typing.override = lambda fn: fn
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = lambda *a, **k: _NullEvent()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    _cuda_type_names()
    _cpu_factories()

    import megatron.core.tensor_parallel.random as rnd

    rnd.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, None)
    rnd.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    rnd._set_cuda_rng_state = lambda *a, **k: None


def install_for_pretrain() -> None:
    """`install()` plus what megatron.training's start-up needs on a machine without a GPU (idempotent).

    - `initialize_megatron` asserts `torch.cuda.is_available()` unless `allow_no_cuda=True`: pretrain's
      call gets it;
    - `_initialize_distributed` opens Megatron's model-parallel groups only when
      `torch.cuda.device_count() > 0` (then `set_device(local_rank)`): one "device", set_device a no-op;
    - not CUDA, the pip wheel: it ships the compiled dataset helpers but no Makefile, and start-up runs
      `make` on them (exit 1); with the helpers importable, that compilation is skipped.
    """
    install()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    import functools

    import megatron.training.training as training

    _prebuilt_dataset_helpers()
    if not getattr(training.initialize_megatron, "_cpu_shim", False):
        allow = functools.partial(training.initialize_megatron, allow_no_cuda=True)
        allow._cpu_shim = True
        training.initialize_megatron = allow


def _prebuilt_dataset_helpers() -> None:
    import importlib.util
    import os

    import megatron.core.datasets.utils as dataset_utils

    folder = os.path.dirname(dataset_utils.__file__)
    if (importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
            and not os.path.exists(os.path.join(folder, "Makefile"))):
        dataset_utils.compile_helpers = lambda: None


class _NullStream:
    """A CPU stand-in for a CUDA stream: everything is already ordered."""

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def synchronize(self):
        return None

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    """A CPU stand-in for a CUDA event: already complete."""

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def record(self, stream=None):
        return None


def _cuda_type_names() -> None:
    """`t.type()` reports CPU float tensors under their CUDA names, as Megatron's optimizers expect."""
    plain = torch.Tensor.type
    names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
             "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = plain(self)
            return names.get(name, name)
        return plain(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "zeros_like",
              "ones_like", "empty_like", "full_like", "as_tensor")


def _cpu_factories() -> None:
    """`device='cuda'` (or a cuda torch.device) in tensor factories means the CPU here."""
    def fixed(fn):
        def call(*args, **kwargs):
            dev = kwargs.get("device")
            if dev is not None and "cuda" in str(dev):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        call.__wrapped__ = fn
        return call

    for name in _FACTORIES:
        setattr(torch, name, fixed(getattr(torch, name)))
