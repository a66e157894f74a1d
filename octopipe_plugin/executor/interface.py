"""The per-stage interface the executor drives; adapters (plain torch, Megatron, DeepSpeed) implement it.

One object serves every stage a rank owns. The executor never looks inside a stage: it
hands each action its input (an activation or an output gradient, each a tensor or a
tuple / list / dict of tensors) and passes on what the action returns, so frameworks keep
their own model, data and loss conventions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """Shape, dtype and gradient flag of one tensor crossing a stage boundary.

    `requires_grad=False` (an integer mask, position ids, a frozen input) means no gradient
    travels back for it; integer and bool tensors never need one whatever the flag says.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True

    @property
    def needs_grad(self) -> bool:
        """Whether this tensor's gradient travels back across the boundary."""
        return self.requires_grad and (self.dtype.is_floating_point or self.dtype.is_complex)

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A fresh receive buffer of this shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def matches(self, t: torch.Tensor) -> bool:
        """Whether `t` can be sent into a buffer made from this meta."""
        return tuple(t.shape) == tuple(self.shape) and t.dtype == self.dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class LossOutput:
    """What the last stage's forward reports for one micro-batch.

    `loss` is the (scaled) loss the backward starts from, detached; `num_tokens` is set when
    the loss function reports it (Megatron's `(loss_sum, num_tokens, dict)`); `logs` is the
    loss function's dict for logging; `raw` is the loss function's own return value.
    """

    loss: torch.Tensor
    num_tokens: torch.Tensor | int | None = None
    logs: Mapping | None = None
    raw: Any = None


@runtime_checkable
class StageRunner(Protocol):
    """What the executor needs from the stages of one rank.

    Contract:
    - `forward(stage, mb, inputs, batch=, forward_only=)`: `inputs` is None on the first
      stage, else stage - 1's output (the received buffers, or the same-device value).
      `batch` is micro-batch `mb` of the step's data source (None when the step has none
      or this stage's source is absent). Returns the value for stage + 1, or on the last
      stage the loss as a tensor or a `LossOutput` (the scaled loss: the step's loss is the
      sum over micro-batches). With `forward_only` nothing is kept for a backward.
    - Backward of the last stage gets `grad_output=None`; otherwise `grad_output` has the
      structure of the stage's output, with None at leaves that need no gradient.
    - `backward_input` / `backward` return the gradient w.r.t. the stage input in the
      structure of the input (None leaves allowed; None on the first stage).
    - `backward_weight` finishes the weight gradients deferred by `backward_input` without
      recomputing anything `backward_input` already computed.
    - Each call frees what its (stage, mb) no longer needs. Received tensors are the
      executor's buffers: valid until the end of the step (they are reused by the next).
    """

    def boundary_meta(self, stage: int):
        """Meta (a TensorMeta or tuple / list / dict of them) of stage `stage`'s output, or None to learn it
        each step from the first message (both ranks of the boundary must agree on which)."""

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """Run F; returns the value for stage + 1, or the scaled loss (tensor or LossOutput) on the last stage."""

    def backward_input(self, stage: int, mb: int, grad_output):
        """Run I: the input gradient only, keeping what W needs."""

    def backward_weight(self, stage: int, mb: int) -> None:
        """Run W: accumulate the parameter gradients deferred by I."""

    def backward(self, stage: int, mb: int, grad_output):
        """Run B: input and parameter gradients in one pass."""
