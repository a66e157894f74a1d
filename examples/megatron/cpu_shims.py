"""CPU-only shims that let megatron-core 0.19.x run on CPU processes over gloo (never imported by the plugin).

The one copy, used by `cpu_run.py` (a launch on a laptop), `benchmark.py --stand-in` and the
tests (tests/adapters/megatron/megatron_cpu_shims.py imports this file). Megatron hard-codes a
few CUDA calls (current device, streams, synchronize, `.cuda()`, the dropout RNG tracker,
`param.type() == 'torch.cuda.FloatTensor'` checks in its optimizers). Each shim redirects one
of them to its CPU equivalent; the model, DDP, optimizer, schedule and training-loop code that
runs is Megatron's own. `install_for_pretrain()` adds what `megatron.training.pretrain` needs
on top (see docs in the function).

What the distributed optimizer and `--overlap-grad-reduce` meet (megatron-core 0.19.2): the
bucket's `start_grad_sync` calls `torch.cuda.current_stream()` on every reduction (the stream
shims); the optimizer's `param.type() == 'torch.cuda.FloatTensor'` checks (the type names);
its state-dict buffers on `torch.cuda.current_device()` (the factories); and, on a resume from
a torch_dist checkpoint, torch Adam's per-parameter 'step', which Megatron's fallback keeps when
neither Transformer Engine's nor Apex's fused Adam (both CUDA) is installed — `_torch_adam_resume`.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from octopipe_plugin.compat import allow_megatron_training_import

_INSTALLED = False


def install() -> None:
    """Install every shim (idempotent); call before importing megatron in a worker."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    allow_megatron_training_import()  # Python 3.11: typing.override, which megatron.training imports
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = lambda *a, **k: _NullEvent()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    # Megatron's recompute checkpoints (--recompute-granularity) read it from the submodule
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    _cuda_type_names()
    _cpu_factories()

    import megatron.core.tensor_parallel.random as rnd

    rnd.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, None)
    rnd.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    rnd._set_cuda_rng_state = lambda *a, **k: None
    _torch_adam_resume()
    _moe_alltoall_on_cpu()


def _moe_alltoall_on_cpu() -> None:
    """The all-to-all token dispatcher at EP > 1 and `--overlap-moe-expert-parallel-comm` on CPU (megatron-core 0.19.2).

    - The dispatcher brings its split counts to the host as numpy arrays (moe_utils.maybe_move_tensor_to_cpu,
      called by token_dispatcher._maybe_dtoh_and_synchronize) only from a GPU tensor: on CPU they stay tensors,
      which gloo's all_to_all_single refuses as split sizes. They become numpy arrays here as on a GPU.
    - The combined step's schedule nodes call `record_stream` on their tensors (pipeline_parallel/utils.py:269/308,
      models/gpt/fine_grained_callables.py:243): on a CPU tensor (its stream a _NullStream) nothing to record.
    """
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    plain = dispatcher.maybe_move_tensor_to_cpu
    if getattr(plain, "_cpu_shim", False):
        return

    def to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy and not tensor.is_cuda:
            return tensor.numpy()
        return plain(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._cpu_shim = True
    dispatcher.maybe_move_tensor_to_cpu = to_host
    record = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: record(self, stream) if self.is_cuda else None


def _torch_adam_resume() -> None:
    """Resume the distributed optimizer from a torch_dist checkpoint with torch's Adam (three places it fails).

    A GPU install has Transformer Engine's or Apex's fused Adam (CUDA extensions), which keep Adam's step
    in the param groups. Without them DistributedOptimizer falls back to torch Adam ("for non-Apex/TE
    support" in distrib_optimizer.py), whose step is a per-parameter state tensor; a resume then fails in
    three places (Megatron's fallback, not the plugin; each shim below is the smallest that fixes one):
    - `state_dict()` reads the step from that state and asserts one value; `sharded_state_dict(is_loading=
      True)` calls it before any step, when the state is empty (AssertionError). A fresh optimizer reports
      step 0 in this template, as the fused path reports its param groups' (the checkpoint sets the real one);
    - `load_state_dict` then puts the loaded step into every parameter's state, and
      `_set_main_param_and_optimizer_states` copies each state tensor from the checkpoint's per-parameter
      tensors, which carry no step (KeyError 'step'): the step stays the one just loaded;
    - that loaded step is one tensor shared by every parameter's state, and torch Adam adds 1 to each
      parameter's step in place: after one step it is 3 + (number of parameters), so every later update has
      another bias correction (measured: the resumed run's second iteration off in the third digit). Each
      parameter gets its own copy.
    """
    import megatron.core.optimizer.distrib_optimizer as distrib

    cls = distrib.DistributedOptimizer
    if distrib.HAVE_APEX_OR_TE or getattr(cls.state_dict, "_cpu_shim", False):
        return
    plain_state_dict, plain_set, plain_load = (cls.state_dict, cls._set_main_param_and_optimizer_states,
                                               cls.load_state_dict)

    def state_dict(self):
        inner = self.optimizer
        if len(inner.state) > 0:
            return plain_state_dict(self)
        for group in inner.param_groups:  # only for this call: load_state_dict reads an empty state as fresh
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(0.0)}
        try:
            return plain_state_dict(self)
        finally:
            inner.state.clear()

    def set_states(self, model_param, tensors):
        return plain_set(self, model_param, {"step": None, **tensors})  # None: not copied

    def load_state_dict(self, state_dict):
        plain_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    state_dict._cpu_shim = True
    cls.state_dict, cls._set_main_param_and_optimizer_states = state_dict, set_states
    cls.load_state_dict = load_state_dict


def shim_device_arch() -> None:
    """Tensor (or context) parallelism on CPU: validate_args asks the GPU's architecture (to require
    CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell, a CUDA stream setting); it answers Hopper's (9), and the
    variable is set as required (idempotent)."""
    import megatron.training.arguments as arguments

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    arguments.get_device_arch_version = lambda: 9


class _CpuFusedLayerNormAffine:
    """apex's FusedLayerNormAffineFunction (a CUDA kernel) as torch's layer_norm on CPU, same signature."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):
        return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps):
        return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


def shim_sequence_parallel_norm() -> None:
    """--sequence-parallel on CPU with LayerNorm models (idempotent; call before the model is built). Megatron's
    local spec without apex builds torch's LayerNorm, which refuses sequence parallelism (torch_norm.
    WrappedTorchNorm); with apex it builds Megatron's FusedLayerNorm (marks its weights `sequence_parallel`, so
    finalize_model_grads all-reduces them over TP), whose kernel is CUDA. As on a GPU install with apex:
    FusedLayerNorm in the layer specs and the final norm, its kernel torch's layer_norm (the same function).
    Not for RMSNorm models (FusedLayerNorm is LayerNorm only), so not part of `install()`."""
    import megatron.core.fusions.fused_layer_norm as fused
    import megatron.core.models.backends as backends
    import megatron.core.transformer.transformer_block as block

    fused.HAVE_FUSED_LAYER_NORM = True
    fused.FusedLayerNormAffineFunction = _CpuFusedLayerNormAffine
    backends.LNImpl = fused.FusedLayerNorm
    block.LayerNormImpl = fused.FusedLayerNorm


def install_for_pretrain() -> None:
    """`install()` plus what megatron.training's start-up needs on a machine without a GPU (idempotent).

    - `initialize_megatron` asserts `torch.cuda.is_available()` unless `allow_no_cuda=True`: pretrain's
      call gets it;
    - `_initialize_distributed` opens Megatron's model-parallel groups only when
      `torch.cuda.device_count() > 0` (then `set_device(local_rank)`): one "device", set_device a no-op;
    - at TP > 1 validate_args asks the GPU's architecture (`shim_device_arch`);
    - not CUDA: start-up runs `make` on the dataset helpers on rank 0; the pip wheel ships them compiled
      but no Makefile (exit 1), and a checkout's Makefile needs pybind11 (and, under pyenv, reads the
      checkout's .python-version: another Python's extension suffix). With the helpers importable for
      this Python, that compilation is skipped;
    - not CUDA: start-up warms up the fused bias-GeLU/SwiGLU and bias-dropout-add kernels (torch.compile: on
      CPU, inductor probes the compiler and builds C++, ~4 CPU seconds a rank) even when the arguments switch
      those fusions off, as a CPU run does; the warm-up is then skipped (the warmed functions never run; its
      random inputs, drawn on the GPU's generator on a GPU, no longer advance the CPU generator the weights
      of `--use-cpu-initialization` are drawn from).
    """
    install()
    shim_device_arch()  # --tensor-model-parallel-size > 1
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    import functools

    import megatron.training.training as training

    _prebuilt_dataset_helpers()
    _warmup_only_used_fusions()
    if not getattr(training.initialize_megatron, "_cpu_shim", False):
        allow = functools.partial(training.initialize_megatron, allow_no_cuda=True)
        allow._cpu_shim = True
        training.initialize_megatron = allow


def _warmup_only_used_fusions() -> None:
    import megatron.training.initialize as initialize

    warmup = initialize._warmup_jit_function
    if getattr(warmup, "_cpu_shim", False):
        return

    def warmup_used(tp_size=None):
        args = initialize.get_args()
        activation = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion  # what the MLP fuses
        if activation or args.bias_dropout_fusion:
            warmup(tp_size=tp_size)

    warmup_used._cpu_shim = True
    initialize._warmup_jit_function = warmup_used


def _prebuilt_dataset_helpers() -> None:
    import importlib.util

    import megatron.core.datasets.utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
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
