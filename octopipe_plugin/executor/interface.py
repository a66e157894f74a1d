"""The per-stage interface the executor drives; adapters (plain torch, Megatron, DeepSpeed) implement it.

One object serves every stage a rank owns. The executor never looks inside a stage: it
hands each action its input (an activation or an output gradient) and passes on what the
action returns, so frameworks keep their own model, data and loss conventions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """Shape and dtype of the tensor that crosses one stage boundary (activation and its gradient)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A fresh receive buffer of this shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def matches(self, t: torch.Tensor) -> bool:
        """Whether `t` can be sent into a buffer made from this meta."""
        return tuple(t.shape) == tuple(self.shape) and t.dtype == self.dtype


@runtime_checkable
class StageRunner(Protocol):
    """What the executor needs from the stages of one rank.

    Contract: `forward` of the first stage gets `inputs=None` and loads its own micro-batch
    (Megatron's forward_step reads the data iterator there); `forward` of the last stage
    returns the micro-batch's loss already divided by the number of micro-batches (so the
    step's loss is the sum, i.e. the mean over micro-batches, as Megatron reports it).
    Backward of the last stage gets `grad_output=None`. `backward_input` / `backward` return
    the gradient w.r.t. the stage input (None on the first stage). `backward_weight` must
    finish the weight gradients deferred by `backward_input` without recomputing anything
    `backward_input` already computed. Each call frees what its (stage, mb) no longer needs.
    """

    def boundary_meta(self, stage: int) -> TensorMeta:
        """Meta of stage `stage`'s output, i.e. of stage `stage + 1`'s input and of its gradient."""

    def forward(self, stage: int, mb: int, inputs: torch.Tensor | None) -> torch.Tensor:
        """Run F; returns the activation for stage + 1, or the scaled loss on the last stage."""

    def backward_input(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Run I: the input gradient only, keeping what W needs."""

    def backward_weight(self, stage: int, mb: int) -> None:
        """Run W: accumulate the parameter gradients deferred by I."""

    def backward(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Run B: input and parameter gradients in one pass."""
