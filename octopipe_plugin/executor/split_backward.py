"""Split backward: I computes input gradients only, W later finishes the weight gradients.

Same method as torch.distributed.pipelining's stage_backward_input / stage_backward_weight
(whose graph helpers we reuse): during I, hooks capture the gradient arriving at every
"intermediate" node where a parameter's sub-graph joins the input's path; W starts from
those captured gradients and walks only the parameter side, so no node is run twice.
Unlike the torch version, outputs are released by dropping references instead of an
in-place `detach_()`, which fails on view outputs.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge
# Private torch helpers (torch 2.13): the reverse graph and the parameter grouping.
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightWork:
    """What W needs after I: the parameter groups with the gradients captured at their intermediates."""

    groups: list
    params: tuple[torch.nn.Parameter, ...]
    # parameters on a branch that never meets the input's path (e.g. a text embedding beside a
    # vision input): no intermediate captures their gradient, so W starts from the outputs
    rest: tuple = ()
    incoming: tuple = ()  # the output gradients I started from (received buffers the executor reuses)


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork]:
    """Input gradients of `outputs` (given their gradients) and the deferred weight work; an input may be a
    non-leaf tensor (the start of a stage's gradient chain, `grad_starts`)."""
    out_fns = [fn for fn in map(_get_grad_fn_or_grad_acc, outputs) if fn is not None]
    in_fns = [fn for fn in map(_get_grad_fn_or_grad_acc, inputs) if fn is not None]
    w_fns = [fn for fn in map(_get_grad_fn_or_grad_acc, params) if fn is not None]
    groups = get_param_groups(in_fns, w_fns, construct_reverse_graph(out_fns))
    handles = []
    try:
        for group in groups:
            inter = list(group["intermediates"])
            group["intermediates"] = inter
            group["grads"] = [None] * len(inter)
            for i, node in enumerate(inter):
                handles.append(node.register_prehook(_capture(group, i)))
        dinputs = torch.autograd.grad(
            list(outputs), list(inputs), list(grad_outputs), retain_graph=True, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    _capture_at_inputs(groups, inputs, dinputs)
    grouped = set().union(*(g["params"] for g in groups)) if groups else set()
    leftover = tuple(p for p, fn in zip(params, map(_get_grad_fn_or_grad_acc, params)) if fn not in grouped)
    rest = (tuple(outputs), tuple(grad_outputs), leftover) if leftover else ()
    return tuple(dinputs), WeightWork(groups=groups, params=tuple(params), rest=rest, incoming=tuple(grad_outputs))


def _capture_at_inputs(groups: list, inputs: Sequence[torch.Tensor], dinputs: tuple) -> None:
    """Give W the gradient at an intermediate that is an input's own node (a non-leaf input such as an
    embedding's output, `grad_starts`): I stops at the input, so that node never runs and its hook never fires."""
    at: dict = {}
    for t, g in zip(inputs, dinputs):
        if t.grad_fn is not None and g is not None:
            at.setdefault(t.grad_fn, {})[t.output_nr] = g
    if not at:
        return
    for group in groups:
        for i, node in enumerate(group["intermediates"]):
            if group["grads"][i] is None and node in at:
                n = len(node._input_metadata)  # the node's gradient inputs (its forward outputs)
                group["grads"][i] = tuple(at[node].get(k) for k in range(n))


def _capture(group: dict, i: int):
    def hook(grad_inputs):
        group["grads"][i] = grad_inputs

    return hook


class WeightSink:
    """Where W's weight gradients go: the walk hands it (edge into a parameter's graph, gradient) pairs.

    A sink may compute a group's gradients itself (`group`, e.g. Megatron's split linears run their weight
    GEMM from the gradient I captured, no engine walk), set the context of the walk from the outputs
    (`whole_backward`: the branch I never reached), and deliver as it goes (`take`) or at the end (`finish`).
    """

    def group(self, group) -> list | None:
        """The (edge, gradient) pairs of one parameter group computed without walking the graph, or None."""
        return None

    def whole_backward(self, outputs):
        """Context of the walk from the outputs to the parameters no intermediate captured (default: none)."""
        return contextlib.nullcontext()

    def take(self, pairs: list, owner: dict, incoming: tuple) -> None:
        """Deliver `pairs` (`owner`: gradient accumulator -> parameter; `incoming`: I's received gradients)."""
        raise NotImplementedError

    def finish(self, owner: dict, incoming: tuple) -> None:
        """After the last `take` of one W."""


class DirectSink(WeightSink):
    """Each weight gradient added into `p.grad` here, without running the parameter's hooks."""

    def take(self, pairs: list, owner: dict, incoming: tuple) -> None:
        for edge, g in pairs:
            accumulate_grad(owner[edge.node], owned_grad(g, incoming))


class AutogradSink(WeightSink):
    """Each weight gradient run into its parameter's AccumulateGrad node, so hooks on the grad accumulator
    and post-accumulate-grad hooks fire (once per parameter and W)."""

    def take(self, pairs: list, owner: dict, incoming: tuple) -> None:
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [owned_grad(g, incoming) for _, g in pairs])


SINKS = MappingProxyType({"direct": DirectSink(), "autograd": AutogradSink()})


def backward_weight(work: WeightWork, sink: "str | WeightSink" = "direct") -> None:
    """Accumulate parameter gradients from the gradients I captured; frees the retained graph.

    The one weight-gradient walk: the parameters on no captured path first (from the outputs), then
    each parameter group from its intermediates, every gradient handed to `sink` ('direct',
    'autograd' (see SINKS) or a WeightSink such as Megatron's split-linear one).
    """
    sink = SINKS[sink] if isinstance(sink, str) else sink
    owner = {_get_grad_fn_or_grad_acc(p): p for p in work.params}
    if work.rest:
        # first, while the groups' part of the graph is still retained: this branch shares no node with it
        outputs, grads, leftover = work.rest
        with sink.whole_backward(outputs):
            dws = torch.autograd.grad(list(outputs), list(leftover), list(grads), retain_graph=True,
                                      allow_unused=True)
        sink.take([(GradientEdge(grad_acc(p), 0), dw) for p, dw in zip(leftover, dws) if dw is not None],
                  owner, work.incoming)
    for group in work.groups:
        pairs = sink.group(group)
        sink.take(_walk(group) if pairs is None else pairs, owner, work.incoming)
        group.clear()
    sink.finish(owner, work.incoming)


def _walk(group) -> list[tuple[GradientEdge, torch.Tensor]]:
    """Parameter gradients of one group by walking the engine from its captured intermediates."""
    edges, grads = captured_edges(group)
    if not edges:
        return []
    with pinned_intermediates(group):
        accs = list(group["params"])
        dws = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accs], grads, allow_unused=True)
    return [(GradientEdge(a, 0), d) for a, d in zip(accs, dws) if d is not None]


def grad_acc(t: torch.Tensor):
    """The autograd node a tensor's gradient flows into: its grad_fn, or a leaf's AccumulateGrad."""
    return _get_grad_fn_or_grad_acc(t)


def captured_edges(group) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """The edges into a parameter group's intermediates and the gradients I captured on them."""
    edges, grads = [], []
    for captured, node in zip(group["grads"], group["intermediates"]):
        for i, g in enumerate(captured or ()):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    return edges, grads


@contextmanager
def pinned_intermediates(group):
    """While W walks a group: every intermediate's incoming gradient is pinned to what I captured there."""
    handles = []
    if len(group["intermediates"]) > 1:
        # an intermediate below another would otherwise count the upper one's gradient twice
        for captured, node in zip(group["grads"], group["intermediates"]):
            handles.append(node.register_prehook(lambda _g, sg=captured: sg))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def owned_grad(g: torch.Tensor, incoming) -> torch.Tensor:
    """`g`, or a copy when it shares memory with an incoming gradient (the executor reuses those buffers, and
    a parameter added straight onto the output gets that very tensor as its gradient)."""
    ptr = g.untyped_storage().data_ptr()
    if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in incoming):
        return g.clone()
    return g


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.grad` (taking it as the gradient when there is none yet), as autograd would."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
