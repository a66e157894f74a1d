"""Real weight-gradient deferral in Megatron's own linear layers (split backward without recomputation).

Megatron's local-spec Column/RowParallelLinear run one autograd Function
(`LinearWithGradAccumulationAndAsyncCommunication`) whose backward computes the input
gradient and the weight gradient together. Split backward (I then W) re-enters that node
at W, so the weight GEMM's partner, the input GEMM, ran twice and I+W cost about 2x B.

`enable_wgrad_split(chunk, phase)` gives each such layer of a chunk (its instance attribute
`_forward_impl`, replaced through `hooks.replace_linear_impl`; no Megatron file changed) a
subclass of that Function whose backward reads `phase.value` at backward time:
- None (B): Megatron's own backward, unchanged;
- "input" (I): only the input-gradient GEMM and its tensor-parallel reduction;
- "weight" (W): only the weight-gradient GEMM (and bias sum), from the input the node saved.
The split itself (which nodes I passes through, the gradients it captures where parameter
sub-graphs join, the W walk from them) is the executor's (`executor.split_backward`); this
module gives that walk its sink (`SplitLinearSink`): the split linears' weight GEMMs, and
every parameter's gradient delivered through autograd's AccumulateGrad node, so hooks on it
(Megatron DDP's main_grad accumulation) fire once per parameter and micro-batch.

Transformer Engine linears defer through their own `delay_wgrad_compute` queue: see
`te_backward_dw` (GPU path, not run on this CPU-only machine).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

from octopipe_plugin.executor.split_backward import WeightSink, backward_input, backward_weight, owned_grad

from .hooks import replace_linear_impl

INPUT, WEIGHT = "input", "weight"


@dataclass(kw_only=True)
class Phase:
    """Which part of the backward the deferrable linears compute right now (None: both)."""

    value: str | None = None


@functools.cache  # one class per process: every chunk's linears share it (tests count GEMMs on it)
def _function_class():
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Base

    class SplitLinear(Base):
        """Megatron's linear Function with a backward that can compute either half alone."""

        @staticmethod
        def forward(ctx, phase, *args):
            ctx.phase = phase
            ctx.octopipe_split = True  # W recognises these nodes among the captured intermediates
            return Base.forward(ctx, *args)

        @staticmethod
        def backward(ctx, grad_output):
            phase = ctx.phase
            if phase.value is None or ctx.gtp_remat_size > 1:  # GTP re-gathers weights: keep Megatron's path
                return (None, *Base.backward(ctx, grad_output))
            if phase.value == INPUT:
                return (None, _input_grad(ctx, grad_output), None, None) + (None,) * 7
            grad_weight, grad_bias = _weight_grad(ctx, grad_output)
            return (None, None, grad_weight, grad_bias) + (None,) * 7

    return SplitLinear


def _input_grad(ctx, grad_output):
    """The input-gradient half of Megatron's backward (layers.py, same operations and reductions)."""
    from megatron.core.tensor_parallel.layers import dist_reduce_scatter_func

    _, weight = ctx.saved_tensors
    grad_input = grad_output.matmul(weight)
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    if ctx.sequence_parallel:
        input_, _ = ctx.saved_tensors
        sub = torch.empty(input_.size(), dtype=input_.dtype, device=grad_input.device, requires_grad=False)
        dist_reduce_scatter_func(sub, grad_input, group=ctx.tp_group)
        return sub
    return grad_input


def _weight_grad(ctx, grad_output):
    """The weight-gradient half of Megatron's backward: the GEMM (fused into main_grad where configured)."""
    from megatron.core.tensor_parallel.layers import dist_all_gather_func, get_global_memory_buffer
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    input_, weight = ctx.saved_tensors
    total_input = input_
    if ctx.sequence_parallel:
        size = list(input_.size())
        size[0] *= ctx.tp_group.size()
        total_input = get_global_memory_buffer().get_tensor(size, input_.dtype, "mpu")
        dist_all_gather_func(total_input, input_, group=ctx.tp_group)
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
        grad_weight = _fused_accumulate(ctx, weight, total_input, grad_output)
    else:
        grad_weight = grad_output.t().matmul(total_input)
    grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    return grad_weight, grad_bias


def _fused_accumulate(ctx, weight, total_input, grad_output):
    """GPU path: accumulate into main_grad with Megatron's fused kernel, return the dummy gradient it returns."""
    import fused_weight_gradient_mlp_cuda  # noqa: F401  (APEX extension Megatron uses for this path)

    main_grad = ctx.main_grad if ctx.main_grad is not None else weight.main_grad
    if main_grad.dtype == torch.float32:
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    else:
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    weight.grad_added_to_main_grad = True
    zero = getattr(weight, "zero_out_wgrad", False)
    make = torch.zeros if zero else torch.empty
    return make(main_grad.shape, dtype=total_input.dtype, device=main_grad.device, requires_grad=False)


# linear -> the Phase its backward reads (the latest enable_wgrad_split's): our state beside Megatron's module
_PHASE_OF: "weakref.WeakKeyDictionary[torch.nn.Module, Phase]" = weakref.WeakKeyDictionary()


def enable_wgrad_split(module: torch.nn.Module, phase: Phase) -> int:
    """Route every Column/RowParallelLinear of `module` through the split-capable Function; returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            _PHASE_OF[m] = phase
            replace_linear_impl(m, _split_impl(weakref.ref(m)),
                                "I/W split: the linear computes only its input GEMM at I, its weight GEMM at W")
            count += 1
    return count


def _split_impl(linear: "weakref.ref"):
    """The `_forward_impl` of one split-capable linear: Megatron's arguments, our Function, the linear's Phase."""
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    split = _function_class()

    def impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
             grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):
        if not weight.requires_grad:
            return linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                             sequence_parallel, tp_group, grad_output_buffer, wgrad_deferral_limit,
                                             gtp_remat_size)
        if grad_output_buffer is not None:
            raise ValueError("defer_embedding_wgrad_compute keeps its own wgrad buffer; with OctoPipe's split "
                             "backward the output layer's weight gradient is already deferred to W: turn it off")
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return split.apply(_PHASE_OF[linear()], input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                           sequence_parallel, None, wgrad_deferral_limit, tp_group, gtp_remat_size)

    return impl


@dataclass(kw_only=True)
class SplitWork:
    """What W needs after I: the executor's weight work (captured gradients) and the phase to run it under."""

    work: object
    phase: Phase
    te_modules: tuple = field(default=())


def input_pass(outputs, grad_outputs, inputs, params, phase: Phase, te_modules=()) -> tuple[tuple, SplitWork]:
    """I: input gradients only (linears compute just their input GEMM); returns them and the work for W."""
    phase.value = INPUT
    try:
        grads, work = backward_input(outputs, grad_outputs, inputs, params)
    finally:
        phase.value = None
    return grads, SplitWork(work=work, phase=phase, te_modules=tuple(te_modules))


def weight_pass(split: SplitWork) -> None:
    """W: every parameter gradient the I pass deferred, delivered through AccumulateGrad (hooks fire)."""
    split.phase.value = WEIGHT
    try:
        backward_weight(split.work, SplitLinearSink())
        for m in split.te_modules:
            te_backward_dw(m)
    finally:
        split.phase.value = None


class SplitLinearSink(WeightSink):
    """The executor's W walk with Megatron's split linears: their weight GEMMs run directly, and every
    gradient is sunk through AccumulateGrad in one engine call at the end.

    A group whose parameters join the input path only at split linears needs no graph walk:
    each linear's weight GEMM runs directly from the input its node saved and the gradient I
    captured there. Walking the engine from such a node would also run, with zero gradients,
    every node between it and a later use of the same weight (MTP reuses the output layer),
    and some of those (Megatron's cross-entropy) changed their saved tensors in place at I.
    """

    def __init__(self):
        self.pairs: list[tuple[GradientEdge, torch.Tensor]] = []

    def group(self, group) -> list | None:
        inter, captured = group["intermediates"], group["grads"]
        if not (inter and all(getattr(n, "octopipe_split", False) for n in inter)):
            return None
        pairs = []
        for node, cap in zip(inter, captured):
            if cap and cap[0] is not None:
                pairs.extend(_direct_weight_grad(node, cap[0]))
        return pairs

    @contextlib.contextmanager
    def whole_backward(self, outputs):
        """Parameters on a branch that never meets the input's path are walked from the outputs with the
        linears' whole backward (none in a GPT chunk; kept for other models)."""
        phases = {id(p): p for p in _phases_in(outputs)}
        saved = {k: p.value for k, p in phases.items()}
        for p in phases.values():
            p.value = None
        try:
            yield
        finally:
            for k, p in phases.items():
                p.value = saved[k]

    def take(self, pairs: list, owner: dict, incoming: tuple) -> None:
        self.pairs.extend(pairs)

    def finish(self, owner: dict, incoming: tuple) -> None:
        if self.pairs:
            # a received gradient buffer (reused by the executor next step) must not become a parameter's .grad
            torch.autograd.backward([e for e, _ in self.pairs], [owned_grad(g, incoming) for _, g in self.pairs])
        self.pairs = []


def _phases_in(outputs) -> list:
    """The Phase objects of the split linears reachable from `outputs` (walks the graph once)."""
    seen, stack, found = set(), [t.grad_fn for t in outputs if t.grad_fn is not None], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "octopipe_split", False):
            found.append(node.phase)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _direct_weight_grad(node, grad_output) -> list[tuple[GradientEdge, torch.Tensor]]:
    """W of one split linear: its weight (and bias) gradient and the edges they flow into."""
    grad_weight, grad_bias = _weight_grad(node, grad_output)
    out = []
    # next_functions holds the tensor arguments of forward only: input, weight, and bias when given
    nexts = node.next_functions
    for pos, g in ((1, grad_weight), (2, grad_bias)):
        if g is not None and pos < len(nexts) and nexts[pos][0] is not None:
            out.append((GradientEdge(*nexts[pos]), g))
    return out


def te_backward_dw(module) -> None:
    """Transformer Engine: run the weight GEMMs its `delay_wgrad_compute` queued at I (GPU; FIFO per module).

    TE queues one entry per backward and pops the oldest, so a plan's W actions of one stage
    must follow the order of its I actions (`check_te_order`).
    """
    fn = getattr(module, "backward_dw", None)
    if fn is not None:
        fn()


def te_modules_of(module) -> list:
    """TE linears of `module` configured to defer their weight gradient (empty without TE)."""
    out = []
    for m in module.modules():
        if type(m).__module__.startswith("megatron.core.extensions.transformer_engine") and \
                getattr(m, "delay_wgrad_compute", False) and hasattr(m, "backward_dw"):
            out.append(m)
    return out


def check_te_order(plan, rank: int) -> None:
    """Refuse a plan whose W order of a stage differs from its I order (TE's wgrad queue is FIFO)."""
    from octopipe_plugin.errors import PlanError
    from octopipe_plugin.actions import Kind

    order: dict[tuple[str, int], list[int]] = {}
    for a in plan.schedule[rank]:
        if a.kind in (Kind.I, Kind.W):
            order.setdefault((a.kind.value, a.stage), []).append(a.microbatch)
    for (kind, stage), mbs in order.items():
        if kind == Kind.I.value and order.get((Kind.W.value, stage), mbs) != mbs:
            raise PlanError(f"plan: device {rank} runs W of stage {stage} in micro-batch order "
                            f"{order[(Kind.W.value, stage)]} but I in {mbs}; Transformer Engine's deferred "
                            "weight gradients are a FIFO queue: W must follow the I order")
