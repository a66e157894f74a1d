"""The hand-over into a split LM head: the head's input with its loss terms (docs/formats.md, "Split layers").

Only the owner stage (the one feeding the head) has the micro-batch's labels and the framework's
loss rule, so its F hands every head shard a `HeadInput`: the hidden states, each token's target
and each token's loss coefficient `coef[t]` = d(the step's backward root) / d(per-token loss t).
A shard then needs nothing else: its J computes the per-token cross-entropy from every shard's
statistics and the softmax gradient `coef[t] x (softmax - onehot)` of its rows.

`loss_coefficients` derives `coef` from any loss rule by autograd on a probe leaf. The rule maps
the per-token losses to the backward's root (the framework's reduction, its loss scaling, a loss
scaler's factor); the gradient is exact for rules linear in the per-token losses (a masked sum
or mean, /num_microbatches, x grad scale: Megatron's and DeepSpeed's), which a second probe checks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..errors import OctoPipeError
from .interface import TensorMeta

TARGET_DTYPE = torch.int64


class HeadInput(NamedTuple):
    """What the owner's F hands every head shard: `hidden` [..., h] and, per row of hidden.reshape(-1, h),
    the token's target (`targets`, int64; a target outside the vocabulary, e.g. -100, is a token without
    loss) and its loss coefficient (`coef`, `coef_dtype(hidden.dtype)`; 0 for a masked token)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    coef: torch.Tensor


class NonLinearLossRule(OctoPipeError, ValueError):
    """A loss rule whose gradient in the per-token losses depends on their values: a split head cannot use it."""


def coef_dtype(hidden_dtype: torch.dtype) -> torch.dtype:
    """The coefficients' dtype: float64 for float64 activations (exactness runs), else float32 (bf16 would round
    1/num_tokens to three digits)."""
    return torch.float64 if hidden_dtype == torch.float64 else torch.float32


def head_input_meta(hidden: TensorMeta) -> HeadInput:
    """The meta of the head-input message for a head input of meta `hidden` (split_meta("head-input"))."""
    tokens = 1
    for n in hidden.shape[:-1]:
        tokens *= n
    return HeadInput(hidden=hidden, targets=TensorMeta(shape=(tokens,), dtype=TARGET_DTYPE, requires_grad=False),
                     coef=TensorMeta(shape=(tokens,), dtype=coef_dtype(hidden.dtype), requires_grad=False))


def stats_meta(hidden: TensorMeta) -> TensorMeta:
    """The meta of one head shard's statistics for a head input of meta `hidden`: [tokens, 3] (max, sum of
    exponentials, target logit) in `coef_dtype`."""
    return TensorMeta(shape=(head_input_meta(hidden).targets.shape[0], 3), dtype=coef_dtype(hidden.dtype),
                      requires_grad=False)


def metas_from_head_input(meta) -> dict:
    """The metas the head-input meta `meta` (a HeadInput of metas, or its 3-tuple) implies: what -> meta of the
    head's input, the statistics and the partials (what a transport that learned it by handshake derives)."""
    hidden = meta[0]
    return {"head-input": meta, "stats": stats_meta(hidden),
            "head-partial": TensorMeta(shape=hidden.shape, dtype=hidden.dtype, requires_grad=False)}


def as_head_input(value) -> HeadInput:
    """A received or handed-over head input (a HeadInput or its 3-tuple) as a HeadInput."""
    if isinstance(value, HeadInput):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 3:
        return HeadInput(*value)
    got = type(value).__name__ if not isinstance(value, (tuple, list)) else f"{len(value)}-tuple"
    raise TypeError(f"a split head's input is a HeadInput(hidden, targets, coef) from the owner stage's forward, "
                    f"got {got} (fix: the owner's F returns executor.head_input.HeadInput)")


def loss_coefficients(rule: Callable[[torch.Tensor], torch.Tensor], num_tokens, dtype: torch.dtype,
                      device) -> torch.Tensor:
    """d rule(l) / d l for the per-token losses l (shape `num_tokens`, an int or a shape), flattened to [tokens].

    `rule(l)` returns the backward's root (a scalar) from the per-token losses; it is evaluated at
    two probes and refused (NonLinearLossRule, naming the largest difference) unless its gradient is
    the same at both, i.e. unless the rule is linear in the losses.
    """
    shape = (num_tokens,) if isinstance(num_tokens, int) else tuple(num_tokens)
    n = 1
    for k in shape:
        n *= k
    probes = (torch.ones(shape, dtype=dtype, device=device),
              (torch.arange(n, dtype=dtype, device=device) * 0.37 + 2.5).reshape(shape))
    grads = [_grad(rule, p) for p in probes]
    a, b = grads
    scale = max(float(a.abs().max()) if n else 0.0, float(b.abs().max()) if n else 0.0)
    tol = (1e-12 if dtype == torch.float64 else 1e-5) * scale
    if n and float((a - b).abs().max()) > tol:
        i = int((a - b).abs().argmax())
        raise NonLinearLossRule(
            f"the loss rule is not linear in the per-token losses (its gradient at token {i} is {float(a[i]):.6g} "
            f"at one probe and {float(b[i]):.6g} at another): a split LM head hands each shard fixed per-token "
            f"coefficients, so use a rule that sums or averages the per-token losses with weights that do not "
            f"depend on them (or do not split the head)")
    return a.reshape(-1).detach()


def _grad(rule, probe: torch.Tensor) -> torch.Tensor:
    leaf = probe.detach().requires_grad_(True)
    with torch.enable_grad():
        root = rule(leaf)
        if not isinstance(root, torch.Tensor) or root.numel() != 1:
            got = type(root).__name__ if not isinstance(root, torch.Tensor) else f"a tensor of shape {tuple(root.shape)}"
            raise TypeError(f"a split head's loss rule returns the backward's root, one scalar tensor; got {got}")
        if not root.requires_grad:
            return torch.zeros_like(leaf)  # the root does not depend on the losses (nothing to differentiate)
        (g,) = torch.autograd.grad(root.reshape(()), leaf, allow_unused=True)
    return torch.zeros_like(leaf) if g is None else g
