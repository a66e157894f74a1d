"""The executor's per-stage interface over an OctoPipePipelineModule, with DeepSpeed's conventions.

Built on the executor's TorchStages (boundaries of several tensors, split I/W backward, the
gradient sink): this class only says where DeepSpeed differs.
- Data: each rank holding the first or the last stage calls the engine's `_next_batch()`
  exactly once per micro-batch, in micro-batch order (inputs `batch[0]`, labels `batch[1]`),
  as PipelineEngine does.
- Loss: `module.loss_fn(outputs, labels)`; the executor gets it divided by the micro-batch
  count (the gradient DeepSpeed's GAS scaling gives); the engine keeps the unscaled values for
  `total_loss`. Under fp16 the backward starts from the loss scale.
- A stage runs through `PipelineModule.forward` with that stage's layers active (activation
  checkpointing included); every backward activates its stage first, because a checkpointed
  segment recomputes from the module's active layers.
- bf16: the fp32 master gradients are updated after every action that produces weight
  gradients (B, W), as PipelineEngine's backward does; with `immediate_grad_update`
  DeepSpeed's own gradient hooks do it, fired by the autograd gradient sink.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...actions import RULES, Kind
from ...executor.torch_stage import TorchStages


class DeepSpeedStages(TorchStages):
    """StageRunner for the stages one rank holds of an OctoPipePipelineModule under an engine."""

    def __init__(self, engine, *, grad_sink: str = "autograd"):
        self.engine = engine
        self.module = engine.module
        self.compute_loss = True
        self.losses: dict[int, torch.Tensor] = {}
        self.batches: list = []
        self.keep_outputs = False  # eval_batch(return_logits=True): keep the last stage's outputs
        self.outputs: dict[int, object] = {}
        plan = self.module.octopipe_plan
        super().__init__(modules={s: self.module for s in self.module.local_stages}, num_stages=plan.num_stages,
                         num_microbatches=plan.num_microbatches, metas=None, load_input=self.first_input,
                         loss_fn=self._loss, call=self._call,
                         grad_scale=self._loss_scale if engine.fp16_enabled() else None, grad_sink=grad_sink)

    # ---- step state ----------------------------------------------------------------------------------
    def begin_step(self, num_microbatches: int, *, compute_loss: bool = True, keep_outputs: bool = False) -> None:
        """Forget the previous step's batches, losses and outputs."""
        self.num_microbatches = num_microbatches
        self.compute_loss = compute_loss
        self.keep_outputs = keep_outputs
        self.outputs = {}
        self.losses = {}
        self.batches = []
        self.state.clear()

    def batch(self, mb: int):
        """Micro-batch `mb` of this step, pulling from the engine's data iterator in order."""
        while len(self.batches) <= mb:
            self.batches.append(self.engine._next_batch())
        return self.batches[mb]

    def _to_device(self, value):
        if torch.is_tensor(value):
            return value.to(self.engine.device)
        return type(value)(self._to_device(v) for v in value)

    def first_input(self, mb: int):
        """Stage 0's input of micro-batch `mb` (batch[0], a tensor or a tuple of them) on the engine's device."""
        return self._to_device(self.batch(mb)[0])

    # ---- stage compute -------------------------------------------------------------------------------
    def _params(self, stage: int) -> list[torch.nn.Parameter]:
        return self.module.stage_parameters(stage)

    def _call(self, stage: int, module, inputs, batch):
        return module.run_stage(stage, inputs)

    def _loss(self, outputs, mb: int):
        if self.keep_outputs:
            self.outputs[mb] = outputs
        loss = outputs
        if self.compute_loss and self.module.loss_fn is not None:
            loss = self.module.loss_fn(outputs, self._to_device(self.batch(mb)[1]))
        self.losses[mb] = loss.detach()
        return loss

    def _loss_scale(self, root: torch.Tensor) -> torch.Tensor:
        opt = self.engine.optimizer
        return root * float(getattr(opt, "loss_scale", None) or getattr(opt, "cur_scale", 1.0))

    # ---- every backward: the stage active; after B and W the master gradients up to date ----------------
    @contextmanager
    def _grad_action(self, stage: int, kind: Kind, last_backward: bool):
        """The stage active (a checkpointed segment recomputes from it); bf16 without immediate updates: this
        action's weight gradients added into the fp32 masters."""
        self.module.activate_stage(stage)
        opt = self.engine.optimizer
        bf16 = self.engine.using_bf16_optimizer and RULES[kind].weight_grad
        if bf16:
            opt.clear_lp_grads()
        yield
        if bf16:
            opt.update_hp_grads(clear_lp_grads=False)
