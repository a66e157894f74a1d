"""The loss terms a split LM head's owner hands to its shards, read from DeepSpeed's `loss_fn`.

DeepSpeed's loss is `module.loss_fn(logits, labels)`, a function of the whole logits. Under a split
head no rank holds them, so the shards compute the per-token cross-entropies ℓ_t themselves and need,
per token, its target and its coefficient c_t in the loss: loss_fn = Σ c_t ℓ_t. Both are read from
the user's loss_fn with autograd at a probe, the logits all zero: there d(loss_fn)/d(logits[t]) =
c_t (1/V - onehot(target_t)) for a weighted cross-entropy, so the target is the row's minimum and
c_t = g[t, target] / (1/V - 1); a zero row is a token that does not count (ignore_index, a mask).
This covers the mean and the sum, ignore_index, label masks and shifted labels alike. Once per
runner a second probe (random logits) checks that loss_fn really is Σ c_t ℓ_t (its gradient
c_t (softmax - onehot) and its value); any other loss (label smoothing, z-loss, a loss on the
logits' magnitudes) is refused by name. The probe runs in float32 (bf16 would round the
coefficients to 3 digits) and costs one loss_fn forward and backward on [tokens, V] zeros.

The runner then scales Σ c_t ℓ_t as it scales a loss (DeepSpeed's division by
gradient_accumulation_steps, the fp16 loss scale) and the executor's `loss_coefficients` turns that
rule into the backward coefficients (`StageCore.head_input`), so the shards' gradients are what
DeepSpeed's backward of the unsplit loss would give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import OctoPipeError

IGNORE = -100  # the target of a token that does not count (its coefficient is 0)
_TOL = 1e-5  # relative to the largest coefficient: float32 round-off of loss_fn's own arithmetic passes


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadTerms:
    """Per token of the head's input: its target (IGNORE where it does not count) and coefficient in loss_fn."""

    targets: torch.Tensor  # int64 [tokens]
    raw_coef: torch.Tensor  # float32 [tokens]: d(loss_fn)/d(per-token loss), the unscaled loss DeepSpeed reports


def head_terms(loss_fn: Callable, hidden: torch.Tensor, labels, *, vocab: int, check: bool = False) -> HeadTerms:
    """Targets and coefficients of `loss_fn(logits, labels)` for logits [*hidden.shape[:-1], vocab] (see above)."""
    if vocab < 2:
        raise OctoPipeError(f"a split LM head needs a vocabulary of at least 2 rows, got {vocab}")
    shape = tuple(hidden.shape[:-1]) + (vocab,)
    g, _ = _probe(loss_fn, torch.zeros(shape, dtype=torch.float32, device=hidden.device), labels)
    g = g.reshape(-1, vocab)
    targets = g.argmin(dim=1)
    raw_coef = g.gather(1, targets[:, None])[:, 0] / (1.0 / vocab - 1.0)
    counts = g.abs().amax(dim=1) > 0
    targets = torch.where(counts, targets, torch.full_like(targets, IGNORE))
    raw_coef = torch.where(counts, raw_coef, torch.zeros_like(raw_coef))
    onehot = _onehot(targets, vocab)
    _expect(g, raw_coef[:, None] * (1.0 / vocab - onehot), raw_coef, "at zero logits")
    if check:
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(shape, generator=gen, dtype=torch.float32).to(hidden.device)
        g2, value = _probe(loss_fn, z, labels)
        zt = z.reshape(-1, vocab)
        _expect(g2.reshape(-1, vocab), raw_coef[:, None] * (torch.softmax(zt, dim=1) - onehot), raw_coef,
                "at random logits")
        per_token = torch.logsumexp(zt, dim=1) - zt.gather(1, targets.clamp(min=0)[:, None])[:, 0]
        want = float((raw_coef * per_token).sum())
        if abs(float(value) - want) > _TOL * max(1.0, abs(want)):
            raise _not_weighted(f"its value {float(value):.6g} is not Σ c_t·cross-entropy_t = {want:.6g}")
    return HeadTerms(targets=targets, raw_coef=raw_coef.detach())


def _probe(loss_fn, logits: torch.Tensor, labels) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        value = loss_fn(leaf, labels)
        if not (torch.is_tensor(value) and value.numel() == 1):
            raise _not_weighted(f"it returned {type(value).__name__}"
                                f"{tuple(value.shape) if torch.is_tensor(value) else ''}, not one loss value")
        (g,) = torch.autograd.grad(value.reshape(()), leaf, allow_unused=True)
    if g is None:
        raise _not_weighted("it does not depend on the logits")
    return g.detach().float(), value.detach()


def _onehot(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros((targets.numel(), vocab), dtype=torch.float32, device=targets.device)
    rows = torch.nonzero(targets >= 0)[:, 0]
    out[rows, targets[rows]] = 1.0
    return out


def _expect(got: torch.Tensor, want: torch.Tensor, coef: torch.Tensor, where: str) -> None:
    bound = _TOL * max(float(coef.abs().max()) if coef.numel() else 0.0, 1e-30)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if err > bound or bool((coef < 0).any()):
        raise _not_weighted(f"its gradient {where} is not c_t·(softmax - onehot(target)) with c_t >= 0 "
                            f"(off by {err:.3g})")


def _not_weighted(why: str) -> OctoPipeError:
    return OctoPipeError(f"module.loss_fn under a split LM head: {why}; a split head computes the loss as "
                         "Σ c_t·cross-entropy(logits_t, target_t) (mean or sum cross-entropy, ignore_index, masks), "
                         "so loss_fn must be one (fix: such a loss_fn, or an unsplit plan)")
