"""Split backward: I computes input gradients only, W later finishes the weight gradients.

Same method as torch.distributed.pipelining's stage_backward_input / stage_backward_weight
(whose graph helpers we reuse): during I, hooks capture the gradient arriving at every
"intermediate" node where a parameter's sub-graph joins the input's path; W starts from
those captured gradients and walks only the parameter side, so no node is run twice.
Unlike the torch version, outputs are released by dropping references instead of an
in-place `detach_()`, which fails on view outputs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
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
    """Input gradients of `outputs` (given their gradients) and the deferred weight work."""
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
    grouped = set().union(*(g["params"] for g in groups)) if groups else set()
    leftover = tuple(p for p, fn in zip(params, map(_get_grad_fn_or_grad_acc, params)) if fn not in grouped)
    rest = (tuple(outputs), tuple(grad_outputs), leftover) if leftover else ()
    return tuple(dinputs), WeightWork(groups=groups, params=tuple(params), rest=rest, incoming=tuple(grad_outputs))


def _capture(group: dict, i: int):
    def hook(grad_inputs):
        group["grads"][i] = grad_inputs

    return hook


def backward_weight(work: WeightWork, sink: str = "direct") -> None:
    """Accumulate parameter gradients from the gradients I captured; frees the retained graph.

    sink 'direct' computes each weight gradient and adds it into `p.grad`; 'autograd' lets the
    engine run each parameter's AccumulateGrad node, so hooks on the grad accumulator and
    post-accumulate-grad hooks fire (once per parameter and call).
    """
    owner = {_get_grad_fn_or_grad_acc(p): p for p in work.params}
    if work.rest:
        # first, while the groups' part of the graph is still retained: this branch shares no node with it
        outputs, grads, leftover = work.rest
        if sink == "autograd":
            torch.autograd.backward(list(outputs), list(grads), retain_graph=True, inputs=list(leftover))
        else:
            dws = torch.autograd.grad(list(outputs), list(leftover), list(grads), retain_graph=True,
                                      allow_unused=True)
            for p, dw in zip(leftover, dws):
                if dw is not None:
                    accumulate_grad(p, owned_grad(dw, work.incoming))
    for group in work.groups:
        edges, grads = captured_edges(group)
        with pinned_intermediates(group):
            if edges:
                accs = list(group["params"])
                if sink == "autograd":
                    torch.autograd.backward(edges, grads, inputs=[owner[a] for a in accs])
                else:
                    dws = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accs], grads)
                    for acc, dw in zip(accs, dws):
                        accumulate_grad(owner[acc], owned_grad(dw, work.incoming))
        group.clear()


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
