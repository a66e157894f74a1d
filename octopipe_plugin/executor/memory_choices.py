"""A plan's memory choices in the executor (docs/formats.md, "Memory choices"): recompute and offload per layer.

- `recompute`: the layer runs under `torch.utils.checkpoint` (non-reentrant): its forward keeps only its inputs and
  re-runs inside the backward that first needs what it saved (I, or B), exactly at the layers the plan names.
- `selective:<modules>`: the named sub-modules run checkpointed (`SUBMODULES`: the attribute names Megatron-core's
  TransformerLayer uses for them, plus the toy models'; a layer without such a sub-module is refused by name).
- `offload`: the layer's forward runs under `torch.autograd.graph.saved_tensors_hooks`: every tensor it saves for
  its backward (not its parameters) is copied to host memory as it is saved and back when the backward asks for it.
  On CUDA the copies run on a copy stream (pinned host buffers, events; the device tensor is handed to the caching
  allocator once its copy-out has run: `record_stream`), and `LayerMemory.prefetch` starts every copy-in of a
  (stage, micro-batch) when its backward (I or B) begins; on a CPU they are plain copies.
- `offload_w`: the same hooks, but the saved tensors stay on the device until I has run (I reads them); after I
  (`LayerMemory.after_input`) every one W will still read is copied to host memory and the device's reference
  dropped, and W's copy-ins start when W begins (`before_weight`). The gradients I captured for W stay where
  they are (the simulator counts only the layers' activations between I and W).

`apply_memory(modules, plan)` wraps the layers of a rank's stage modules (`nn.Sequential` over each stage's layer
range, as `testing.toy.stage_modules` builds them) and returns the `LayerMemory` a `StageCore` runner takes
(`memory=`): it opens F's offload scope, starts B's, I's and W's copy-ins and sends I's kept tensors away.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import PlanError
from ..formats.memory import OFFLOAD, OFFLOAD_W, RECOMPUTE, SELECTIVE

# Sub-module attribute names each selective module checkpoints (Megatron-core 0.19 TransformerLayer / MoELayer names
# first, then the toy models' of octopipe_plugin/testing).
SUBMODULES = {
    "core_attn": ("core_attention", "attn"),
    "layernorm": ("input_layernorm", "pre_mlp_layernorm", "norm"),
    "mlp": ("mlp",),
    "moe": ("mlp",),
    "moe_act": ("activation_func",),
    "shared_experts": ("shared_experts",),
    "mla_up_proj": ("linear_q_up_proj", "linear_kv_up_proj"),
}


class _Packed:
    """One saved tensor on the host: its copy, where it came from, and the copy events (CUDA)."""

    __slots__ = ("host", "device", "out_done", "back", "in_done")

    def __init__(self, host, device, out_done=None):
        self.host, self.device, self.out_done = host, device, out_done
        self.back = self.in_done = None


class Offloader:
    """Saved-tensor hooks that move a layer's saved tensors to host memory and back (see the module docstring);
    `deferred`: they stay on the device until `away` (after I) sends them (offload_w)."""

    def __init__(self, deferred: bool = False):
        self.deferred = deferred
        self.groups: dict[tuple[int, int], list[_Packed]] = {}
        self.current: tuple[int, int] | None = None
        self.skip: set[int] = set()  # storages of parameters: never copied
        self._stream = None

    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def scope(self, params):
        """The saved-tensor hooks for one layer's forward (`params`: its parameters, kept where they are)."""
        for p in params:
            self.skip.add(p.untyped_storage().data_ptr())
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self.skip or t.numel() == 0:
            return t
        if self.deferred:  # held as the saved tensor itself until `away`
            handle = _Packed(None, t.device)
            handle.back = t
        elif t.device.type == "cuda":
            handle = self._pack_cuda(t)
        else:
            handle = _Packed(t.detach().clone(), t.device)
        if self.current is not None:
            self.groups.setdefault(self.current, []).append(handle)
        return handle

    def _pack_cuda(self, t: torch.Tensor) -> _Packed:
        stream, compute = self.stream(), torch.cuda.current_stream(t.device)
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        stream.wait_stream(compute)  # the copy sees the tensor as the forward wrote it
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory returns to the allocator once the copy-out has run
        return _Packed(host, t.device, stream.record_event())

    def _unpack(self, handle):
        if not isinstance(handle, _Packed):
            return handle
        if handle.host is None:  # deferred, not sent away yet (I's reads)
            return handle.back
        if handle.device.type != "cuda":
            return handle.host
        compute = torch.cuda.current_stream(handle.device)
        if handle.back is None:  # not prefetched: copy in now
            self._copy_in(handle)
        compute.wait_event(handle.in_done)
        back, handle.back = handle.back, None
        return back

    def _copy_in(self, handle: _Packed) -> None:
        stream = self.stream()
        with torch.cuda.stream(stream):
            stream.wait_event(handle.out_done)
            handle.back = handle.host.to(handle.device, non_blocking=True)
            handle.in_done = stream.record_event()
        handle.back.record_stream(torch.cuda.current_stream(handle.device))

    def prefetch(self, stage: int, mb: int) -> None:
        """Start the copy-ins of (stage, mb)'s saved tensors (CUDA; on a CPU the host copy is the tensor)."""
        for handle in self.groups.get((stage, mb), ()):
            if handle.device.type == "cuda" and handle.back is None:
                self._copy_in(handle)

    def away(self, stage: int, mb: int) -> None:
        """Copy (stage, mb)'s held saved tensors to host memory and drop the device's reference (deferred: after I)."""
        for handle in self.groups.get((stage, mb), ()):
            if handle.host is None:
                t, handle.back = handle.back, None
                moved = self._pack_cuda(t) if t.device.type == "cuda" else _Packed(t.detach().clone(), t.device)
                handle.host, handle.out_done = moved.host, moved.out_done

    def release(self, stage: int, mb: int) -> None:
        """Forget (stage, mb)'s handles (its backward is done; autograd drops the tensors themselves)."""
        self.groups.pop((stage, mb), None)


class _Offloaded(nn.Module):
    """A layer whose saved tensors its forward hands to the Offloader."""

    def __init__(self, layer: nn.Module, offloader: Offloader):
        super().__init__()
        self.layer = layer
        self.run = offloaded(layer.__call__, offloader, layer.parameters)

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def offloaded(forward, offloader: Offloader, params):
    """`forward` with the tensors it saves for its backward handed to `offloader` (`params()`: the parameters,
    kept where they are); as it is without grad. A framework adapter wraps its own layers' forwards with it."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with offloader.scope(params()):
            return forward(*args, **kwargs)

    return run


class _Recomputed(nn.Module):
    """A layer run under a non-reentrant checkpoint."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.run = checkpointed(layer.__call__)

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def checkpointed(forward, context_fn=None):
    """`forward` under a non-reentrant checkpoint (as it is without grad); `context_fn`: torch's checkpoint's
    (forward context, recompute context), e.g. a framework's own RNG states restored for the recompute."""
    more = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **more, **kwargs)

    return run


def named_submodules(layer: nn.Module, module: str) -> list[nn.Module]:
    """The sub-modules of `layer` a selective module checkpoints (`SUBMODULES`' attribute names; none: [])."""
    names = SUBMODULES[module]
    return [m for path, m in layer.named_modules() if path and path.rsplit(".", 1)[-1] in names]


def checkpoint_submodules(layer: nn.Module, index: int, modules) -> None:
    """Checkpoint the sub-modules of `layer` the selective modules name (refused where it has none)."""
    for module in modules:
        names = SUBMODULES[module]
        found = named_submodules(layer, module)
        if not found:
            raise PlanError(f"plan $.memory.{index}: selective:{module} on layer {index} "
                            f"({type(layer).__name__}), which has no sub-module named {' or '.join(names)}; fix: "
                            f"use recompute or offload for this layer")
        for m in found:
            m.forward = checkpointed(m.forward)


class LayerMemory:
    """What a StageCore runner does for the plan's memory choices around its actions."""

    def __init__(self, offloader: Offloader | None, weight_offloader: Offloader | None = None):
        self.offloader, self.weight_offloader = offloader, weight_offloader
        self._all = tuple(o for o in (offloader, weight_offloader) if o is not None)

    def forward_scope(self, stage: int, mb: int, keep: bool):
        """Around F: the saved tensors of its offloaded layers are (stage, mb)'s."""
        if not self._all or not keep:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for o in self._all:
            stack.enter_context(_current(o, (stage, mb)))
        return stack

    def before_backward(self, stage: int, mb: int) -> None:
        """At the start of I or B: the copy-ins of (stage, mb)."""
        if self.offloader is not None:
            self.offloader.prefetch(stage, mb)

    def after_input(self, stage: int, mb: int) -> None:
        """After I: what W reads of (stage, mb)'s offload_w layers goes to host memory."""
        if self.weight_offloader is not None:
            self.weight_offloader.away(stage, mb)

    def before_weight(self, stage: int, mb: int) -> None:
        """At the start of W: the copy-ins of (stage, mb)'s offload_w layers."""
        if self.weight_offloader is not None:
            self.weight_offloader.prefetch(stage, mb)

    def after_backward(self, stage: int, mb: int) -> None:
        """After B or W: (stage, mb)'s handles are done with."""
        for o in self._all:
            o.release(stage, mb)


@contextlib.contextmanager
def _current(offloader: Offloader, key):
    before, offloader.current = offloader.current, key
    try:
        yield
    finally:
        offloader.current = before


def apply_memory(modules: dict[int, nn.Module], plan) -> LayerMemory | None:
    """Wrap the layers of `modules` (stage -> nn.Sequential of the stage's layers) that `plan.memory` names.

    Returns the LayerMemory for the runner (None when the plan has no memory choices: nothing is wrapped)."""
    memory = dict(getattr(plan, "memory", ()))
    if not memory:
        return None
    offloader = Offloader() if any(c.kind == OFFLOAD for c in memory.values()) else None
    w_offloader = Offloader(deferred=True) if any(c.kind == OFFLOAD_W for c in memory.values()) else None
    for s, seq in modules.items():
        st = plan.stages[s]
        mine = [i for i in range(st.start, st.end) if i in memory]
        if not mine:
            continue
        if not isinstance(seq, nn.Sequential) or len(seq) != st.num_layers:
            raise PlanError(f"plan $.memory: stage {s}'s module is a {type(seq).__name__}, not an nn.Sequential of "
                            f"its {st.num_layers} layers; fix: build stage modules as nn.Sequential over the plan's "
                            f"layer ranges (testing.toy.stage_modules) or drop the memory choices")
        for i in mine:
            choice, j = memory[i], i - st.start
            if choice.kind == RECOMPUTE:
                seq[j] = _Recomputed(seq[j])
            elif choice.kind in (OFFLOAD, OFFLOAD_W):
                seq[j] = _Offloaded(seq[j], offloader if choice.kind == OFFLOAD else w_offloader)
            else:
                assert choice.kind == SELECTIVE
                checkpoint_submodules(seq[j], i, choice.modules)
    return LayerMemory(offloader, w_offloader)
