"""The executor's per-stage interface over an OctoPipePipelineModule, with DeepSpeed's conventions.

Data: each rank holding the first or the last stage calls the engine's `_next_batch()` exactly
once per micro-batch, in micro-batch order (inputs `batch[0]`, labels `batch[1]`), as
PipelineEngine does. Loss: `module.loss_fn(outputs, labels)`; the executor gets it divided by
the micro-batch count (the gradient DeepSpeed's GAS scaling gives), the engine keeps the
unscaled values for `total_loss`. Gradients: computed with autograd.grad (split I/W needs it)
and handed to the parameters by `sink`; under bf16 the fp32 master gradients are updated
around every gradient-producing action, as PipelineEngine's backward does.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...executor.interface import TensorMeta
from ...executor.split_backward import accumulate_grad, backward_input, backward_weight


def hook_sink(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate through autograd's own AccumulateGrad, so hooks on the parameter's gradient fire."""
    torch.autograd.backward(param, grad)


class DeepSpeedStages:
    """StageRunner for the stages one rank holds of an OctoPipePipelineModule under an engine."""

    def __init__(self, engine, *, sink=accumulate_grad):
        self.engine = engine
        self.module = engine.module
        self.plan = self.module.octopipe_plan
        self.num_stages = self.plan.num_stages
        self.sink = sink
        self.metas: dict[int, TensorMeta] = {}
        self.num_microbatches = self.plan.num_microbatches
        self.compute_loss = True
        self.losses: dict[int, torch.Tensor] = {}
        self.batches: list = []
        self._saved: dict[tuple[int, int], dict] = {}

    # ---- step state ----------------------------------------------------------------------------------
    def begin_step(self, num_microbatches: int, *, compute_loss: bool = True) -> None:
        """Forget the previous step's batches and losses."""
        self.num_microbatches = num_microbatches
        self.compute_loss = compute_loss
        self.losses = {}
        self.batches = []
        self._saved.clear()

    def batch(self, mb: int):
        """Micro-batch `mb` of this step, pulling from the engine's data iterator in order."""
        while len(self.batches) <= mb:
            self.batches.append(self.engine._next_batch())
        return self.batches[mb]

    def boundary_meta(self, stage: int) -> TensorMeta:
        """Meta of stage `stage`'s output (probed by the engine before the step)."""
        return self.metas[stage]

    def first_input(self, mb: int) -> torch.Tensor:
        """Stage 0's input of micro-batch `mb`, on the engine's device."""
        x = self.batch(mb)[0]
        if not torch.is_tensor(x):
            raise TypeError(f"micro-batch {mb}: batch[0] is a {type(x).__name__}; this executor carries one "
                            "tensor per stage boundary")
        return x.to(self.engine.device)

    def labels(self, mb: int):
        """Labels of micro-batch `mb` (batch[1]) on the engine's device."""
        y = self.batch(mb)[1]
        if torch.is_tensor(y):
            return y.to(self.engine.device)
        return type(y)(t.to(self.engine.device) for t in y)

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, stage: int, mb: int, inputs: torch.Tensor | None, *, batch=None,
                forward_only: bool = False) -> torch.Tensor:
        """Run the stage's layers; the last stage applies loss_fn to the labels (the engine's own data, not `batch`)."""
        if stage == 0:
            x = self.first_input(mb)
            if x.is_floating_point() and torch.is_grad_enabled():
                x = x.detach().requires_grad_(True)  # lets I walk stage 0's activation chain (see TorchStages)
        else:
            x = inputs.detach().requires_grad_(inputs.is_floating_point() and torch.is_grad_enabled())
        out = self.module.run_stage(stage, x)
        if stage == self.num_stages - 1:
            loss = out
            if self.compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(out, self.labels(mb))
            self.losses[mb] = loss.detach()
            out = loss / self.num_microbatches
        if torch.is_grad_enabled():
            self._saved[(stage, mb)] = {"input": x, "output": out}
        return out

    # ---- backward ------------------------------------------------------------------------------------
    def _seed(self, out: torch.Tensor, grad_output: torch.Tensor | None) -> torch.Tensor:
        if grad_output is not None:
            return grad_output
        seed = torch.ones_like(out)
        if self.engine.fp16_enabled():  # DeepSpeed's loss scaling of the last stage's backward
            opt = self.engine.optimizer
            seed = seed * float(getattr(opt, "loss_scale", None) or getattr(opt, "cur_scale", 1.0))
        return seed

    @contextmanager
    def _producing_grads(self, stage: int):
        """Around an action that writes parameter gradients: bf16 master-gradient upkeep and the sink."""
        opt = self.engine.optimizer
        bf16 = self.engine.using_bf16_optimizer
        if bf16:
            opt.clear_lp_grads()
        params = self.module.stage_parameters(stage)
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            fresh = [p.grad for p in params]
            for p, old in zip(params, held):
                p.grad = old
            for p, g in zip(params, fresh):
                if g is not None:
                    self.sink(p, g)
        if bf16:
            opt.update_hp_grads(clear_lp_grads=False)

    def backward(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: input and parameter gradients in one pass."""
        self.module.activate_stage(stage)  # a checkpointed layer recomputes with this stage's layers
        saved = self._saved.pop((stage, mb))
        x, out = saved["input"], saved["output"]
        g = self._seed(out, grad_output)
        if out is x:
            return g
        wants_dx = x.requires_grad and stage > 0
        params = self.module.stage_parameters(stage)
        targets = params + ([x] if wants_dx else [])
        if not targets:
            return None
        with self._producing_grads(stage):
            grads = torch.autograd.grad([out], targets, [g], allow_unused=True)
            for p, gp in zip(params, grads):
                if gp is not None:
                    accumulate_grad(p, gp)
        return grads[-1] if wants_dx else None

    def backward_input(self, stage: int, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: the input gradient only; W finishes the parameter gradients from what I captured."""
        self.module.activate_stage(stage)
        key = (stage, mb)
        saved = self._saved[key]
        x, out = saved["input"], saved["output"]
        g = self._seed(out, grad_output)
        if not x.requires_grad:  # integer input (token ids): the whole backward is W's
            saved["grad_output"] = g
            return None
        if out is x:
            self._saved[key] = {"work": None}
            return g
        (dx,), work = backward_input([out], [g], [x], self.module.stage_parameters(stage))
        self._saved[key] = {"work": work}
        return dx if stage > 0 else None

    def backward_weight(self, stage: int, mb: int) -> None:
        """W: accumulate the parameter gradients deferred by I."""
        self.module.activate_stage(stage)
        saved = self._saved.pop((stage, mb))
        if "grad_output" in saved:
            self._saved[(stage, mb)] = {"input": saved["input"], "output": saved["output"]}
            self.backward(stage, mb, saved["grad_output"])
        elif saved["work"] is not None:
            with self._producing_grads(stage):
                backward_weight(saved["work"])

    def pending(self) -> int:
        """(stage, micro-batch) pairs whose state is still held (0 after a complete step)."""
        return len(self._saved)
