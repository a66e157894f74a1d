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

Multi-token prediction (DeepSeek-V3 Sec. 2.2; `formats.model.head_inputs`): the head of a model
with MTP depth d takes 1 + d hidden states through its one weight. The owner hands them over as
one `HeadInput` whose `hidden` is the states concatenated along dim 0 (`concat_heads`, Megatron's
layout: the MTP block returns them so), so the rows of hidden.reshape(-1, h) are head-major: the
main head's tokens, then depth 1's, ...; `targets` and `coef` follow the same rows (`mtp_targets`:
depth j's targets are the main ones shifted j tokens further, Megatron's roll_tensor and rolled
loss mask; the coefficients of `mtp_loss_scales`: 1 for the main head, the MTP loss scaling factor
/ d for each depth). A shard's math is then the one-head math over all those rows: the logits and
statistics of every hidden state against the same weight rows (the statistics per token and
hidden state), the partial input gradient of every hidden state in one message, the weight
gradient summed over the heads.
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


def concat_heads(hiddens) -> torch.Tensor:
    """The head input of 1 + d hidden states (a sequence of equal-shape tensors, main first, then MTP depths 1..d)
    as one tensor: concatenated along dim 0 (differentiable: the partial's gradient reaches each state).
    A tensor is returned as it is (one head, or the states already concatenated)."""
    if isinstance(hiddens, torch.Tensor):
        return hiddens
    states = list(hiddens)
    if not states or not all(isinstance(h, torch.Tensor) for h in states):
        raise TypeError(f"a split head's hidden states: expected a tensor or a sequence of tensors (main, then each "
                        f"MTP depth), got {type(hiddens).__name__}")
    shapes = {tuple(h.shape) for h in states}
    if len(shapes) != 1:
        raise ValueError(f"the hidden states of a multi-token-prediction head differ in shape {sorted(shapes)}: each "
                         f"head (the main one and every MTP depth) takes the same [..., hidden] states")
    return states[0] if len(states) == 1 else torch.cat(states, dim=0)


def heads_meta(meta: TensorMeta, heads: int) -> TensorMeta:
    """The meta of `heads` hidden states of meta `meta` concatenated along dim 0 (`concat_heads`)."""
    if heads == 1:
        return meta
    shape = tuple(meta.shape)
    if not shape:
        raise ValueError("a multi-token-prediction head's hidden states have a shape [..., hidden], got a scalar")
    return TensorMeta(shape=(heads * shape[0], *shape[1:]), dtype=meta.dtype, requires_grad=meta.requires_grad)


def mtp_targets(targets: torch.Tensor, depth: int, ignore_index: int = -100) -> torch.Tensor:
    """The targets of the main head and of MTP depths 1..`depth`, flattened and concatenated (head-major).

    `targets` are the main head's (next-token) targets, sequence along the last dim; depth j's target at position
    p is the main one at p + j, and the last j positions of each sequence have none (`ignore_index`): Megatron's
    `roll_tensor(labels, shifts=-1)` once per depth with its loss mask rolled alike (multi_token_prediction.py)."""
    heads = [targets.reshape(-1)]
    seq = targets.shape[-1]
    for j in range(1, depth + 1):
        shifted = torch.full_like(targets, ignore_index)
        if j < seq:
            shifted[..., :seq - j] = targets[..., j:]
        heads.append(shifted.reshape(-1))
    return torch.cat(heads) if depth else heads[0]


def mtp_loss_scales(depth: int, factor: float) -> tuple[float, ...]:
    """The loss coefficient of each head: 1 for the main one, `factor` / `depth` for each MTP depth (Megatron's
    `--mtp-loss-scaling-factor`: mtp_loss_scale = mtp_loss_scaling_factor / mtp_num_layers)."""
    return (1.0,) + tuple(factor / depth for _ in range(depth))


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
