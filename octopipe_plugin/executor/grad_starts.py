"""Where a stage's backward ends when its input takes no gradient: the tensors its gradient starts from.

A stage whose input requires no grad (the first stage on token ids, a data-only input) still has an
input side to its backward: the activation chain down to the first tensors computed from data and
weights alone (the embedding's output). The split backward's I walks that chain and W the weights
(the embedding's own scatter included), as on every other stage, so the plan's I/W split is what
runs. Those tensors are found while F runs: every module call whose tensor arguments require no grad
but whose output does (an embedding, a position embedding; the innermost such call when they nest).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_leaves


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@contextmanager
def recorded_starts():
    """Context that collects, into the list it yields, the outputs of module calls that start a gradient
    from data and weights alone (arguments without grad, output with grad); outer calls around one are left out."""
    starts: list[torch.Tensor] = []
    entered: list[int] = []  # per open module call: how many starts existed when it began

    def before(module, args):
        entered.append(len(starts))

    def after(module, args, kwargs, output):
        began = entered.pop() if entered else len(starts)
        if began < len(starts) or not torch.is_grad_enabled():
            return  # a start was found inside this call: the inner one is where the chain ends
        if any(t.requires_grad for t in _tensors((args, kwargs))):
            return
        # a leaf (a module handing out its own parameter) is not a start: its gradient must reach it at W
        starts.extend(t for t in _tensors(output) if t.grad_fn is not None and t.is_floating_point())

    pre = nn_module.register_module_forward_pre_hook(before)
    post = nn_module.register_module_forward_hook(after, with_kwargs=True, always_call=True)
    try:
        yield starts
    finally:
        pre.remove()
        post.remove()
