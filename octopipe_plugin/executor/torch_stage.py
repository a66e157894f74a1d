"""StageRunner over plain `nn.Module` stages: the reference implementation of the interface."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .interface import TensorMeta
from .split_backward import accumulate_grad, backward_input, backward_weight


class TorchStages:
    """The stages one rank owns, each an `nn.Module` mapping the stage input to its output.

    `load_input(mb)` gives the first stage's input; `loss_fn(output, mb)` the last stage's
    loss, which is divided by `num_microbatches` so the step loss is the mean over
    micro-batches. `metas[s]` is the meta of stage s's output (fixed per boundary, as
    Megatron's tensor_shape is), used by the executor to size receive buffers.
    """

    def __init__(
        self,
        *,
        modules: Mapping[int, nn.Module],
        num_stages: int,
        num_microbatches: int,
        metas: Sequence[TensorMeta],
        load_input: Callable[[int], torch.Tensor],
        loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
    ):
        self.modules = dict(modules)
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.metas = tuple(metas)
        self.load_input = load_input
        self.loss_fn = loss_fn
        # (stage, mb) -> what the next action of that pair needs; entries die with their last use
        self._saved: dict[tuple[int, int], dict] = {}

    def boundary_meta(self, stage: int) -> TensorMeta:
        """Meta of stage `stage`'s output."""
        return self.metas[stage]

    def forward(self, stage: int, mb: int, inputs: torch.Tensor | None) -> torch.Tensor:
        """Run the stage module; the last stage also applies the scaled loss."""
        if stage == 0:
            x = self._first_input(mb)
        else:
            # detach() shares storage: a same-device hand-off is not copied, only cut from the graph
            x = inputs.detach().requires_grad_(True)
        out = self._compute(stage, mb, x)
        if stage == self.num_stages - 1:
            out = out / self.num_microbatches
        self._saved[(stage, mb)] = {"input": x, "output": out}
        return out

    def _first_input(self, mb: int) -> torch.Tensor:
        """Stage 0's input of micro-batch `mb` (subclasses that load data inside the step change it)."""
        x = self.load_input(mb)
        if x.is_floating_point():
            # A float input that "requires grad" lets I walk the activation chain of stage 0 and
            # leave W only the weight products, as on every other stage (a faithful I/W split for
            # zero-bubble plans), at the price of the first layer's unused input-gradient product.
            # Integer inputs (token ids) fall back to "I does nothing, W does everything".
            x = x.detach().requires_grad_(True)
        return x

    def _compute(self, stage: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        """The stage's output, or on the last stage its unscaled loss (subclasses change how)."""
        out = self.modules[stage](x)
        return self.loss_fn(out, mb) if stage == self.num_stages - 1 else out

    def _params(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.modules[stage].parameters() if p.requires_grad]

    def _grads(self, out: torch.Tensor, grad_output: torch.Tensor | None) -> torch.Tensor:
        return torch.ones_like(out) if grad_output is None else grad_output

    def backward(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Fused backward; frees the micro-batch's graph."""
        saved = self._saved.pop((stage, mb))
        x, out = saved["input"], saved["output"]
        if out is x:  # an empty stage forwards its input unchanged
            return self._grads(out, grad_output)
        wants_dx = x.requires_grad and stage > 0
        targets = self._params(stage) + ([x] if wants_dx else [])
        if not targets:
            return None
        grads = torch.autograd.grad([out], targets, [self._grads(out, grad_output)], allow_unused=True)
        for p, g in zip(targets, grads):
            if p is not x and g is not None:
                accumulate_grad(p, g)
        return grads[-1] if wants_dx else None

    def backward_input(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Input gradient only; keeps the captured gradients (not the activations above them) for W."""
        key = (stage, mb)
        saved = self._saved[key]
        x, out = saved["input"], saved["output"]
        g = self._grads(out, grad_output)
        if not x.requires_grad:
            # First stage on integer input: the graph has no input side, so all of it is W's work.
            saved["grad_output"] = g
            return None
        if out is x:
            self._saved[key] = {"work": None}
            return g
        (dx,), work = backward_input([out], [g], [x], self._params(stage))
        self._saved[key] = {"work": work}  # drops input and output references
        return dx if stage > 0 else None

    def backward_weight(self, stage: int, mb: int) -> None:
        """Finish the weight gradients deferred by backward_input."""
        saved = self._saved.pop((stage, mb))
        if "grad_output" in saved:
            self._saved[(stage, mb)] = saved
            self.backward(stage, mb, saved["grad_output"])
        elif saved["work"] is not None:
            backward_weight(saved["work"])

    def pending(self) -> int:
        """Micro-batches whose state is still held (0 after a complete step)."""
        return len(self._saved)
