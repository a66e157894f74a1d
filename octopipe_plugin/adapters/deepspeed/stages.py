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
- Split LM head (`shards=`, SHARD_API.md): the shard actions (H, J, K) run on the `shards`
  object; the owner (the last stage, built without the head) hands on the head's input with
  its loss terms (`head_input(mb, hidden)`, default `loss_terms.head_terms` over the module's
  `loss_fn` and this runner's scaling) and starts its backward from the summed partials; the
  shard weights' gradients reach DeepSpeed's bf16 masters after every K; the micro-batch's
  unscaled loss (for `total_loss`) is reported by the owner's own shard (`report`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...actions import RULES, Kind
from ...errors import OctoPipeError
from ...executor.interface import LossOutput
from ...executor.stage_core import Forwarded
from ...executor.torch_stage import TorchStages
from ...formats.splits import side_of
from .loss_terms import head_terms


class DeepSpeedStages(TorchStages):
    """StageRunner for the stages one rank holds of an OctoPipePipelineModule under an engine.

    `shards`: the object running this rank's shard actions of a split plan (a VocabShards over
    the module's head shard, or a stand-in); required when the plan splits a layer.
    `head_input(mb, hidden)`: what the owner of a split head hands on (default: the hidden states
    with the targets and loss coefficients of `loss_terms.head_terms`)."""

    def __init__(self, engine, *, grad_sink: str = "autograd", shards=None, head_input=None):
        self.engine = engine
        self.module = engine.module
        self.compute_loss = True
        self.losses: dict[int, torch.Tensor] = {}
        self.batches: list = []
        self.keep_outputs = False  # eval_batch(return_logits=True): keep the last stage's outputs
        self.outputs: dict[int, object] = {}
        plan = self.module.octopipe_plan
        n = plan.stages[-1].end
        sides = sorted({side_of(sp, n) or "?" for sp in plan.splits})
        if plan.splits and shards is None:
            raise OctoPipeError(f"DeepSpeedStages: the plan splits layers {[sp.layer for sp in plan.splits]} "
                                "but no shards= runs their shard actions (give a VocabShards or a stand-in)")
        if "input" in sides or "?" in sides:
            raise OctoPipeError(f"DeepSpeedStages: the plan splits layers {[sp.layer for sp in plan.splits]}; under "
                                "DeepSpeed only the LM head (the last layer) can be split so far (drop the "
                                "embedding's split)")
        self.shards = shards
        self.head_split = "output" in sides
        # stand-in shards (no real head): the owner hands on the hidden states alone, as MegatronStages does
        self.head_input = head_input or (self._head_terms if self.module.octopipe_head is not None
                                         else (lambda mb, hidden: (hidden, None, None)))
        self._loss_checked = False  # loss_fn checked to be a weighted cross-entropy (the first F of the owner)
        self._raw_coef: dict[int, torch.Tensor] = {}  # the owner's d(loss_fn)/d(per-token loss), per micro-batch
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
        self._raw_coef = {}
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

    # ---- the owner of a split head: hands on the head's input, backward from the summed partials -------
    def _forward(self, stage: int, mb: int, x, batch, keep: bool):
        if not (self.head_split and stage == self.num_stages - 1):
            return super()._forward(stage, mb, x, batch, keep)
        if self.keep_outputs:
            raise OctoPipeError("eval_batch(return_logits=True) under a plan that splits the LM head: no rank "
                                "holds the whole logits (evaluate with return_logits=False, or an unsplit plan)")
        hidden = self._call(stage, self.modules[stage], x, batch)
        return self.head_input(mb, hidden), Forwarded(input=x, output=hidden)

    def _head_terms(self, mb: int, hidden: torch.Tensor):
        """(hidden, targets, coef): the loss terms of the module's loss_fn, scaled as this runner's loss."""
        labels = self._to_device(self.batch(mb)[1])
        placement = self.module.octopipe_head
        terms = head_terms(self.module.loss_fn, hidden, labels, vocab=placement.vocab, scale=self._backward_root,
                           check=not self._loss_checked)
        self._loss_checked = True
        self._raw_coef[mb] = terms.raw_coef
        return hidden, terms.targets, terms.coef

    def _backward_root(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor the backward starts from for a micro-batch's loss (TorchStages' scale_loss, grad_scale)."""
        scaled = self.scale_loss(loss, None)
        return self.grad_scale(scaled) if self.grad_scale is not None else scaled

    def _roots(self, stage: int, out, grad_output):
        if self.head_split and stage == self.num_stages - 1:
            # the owner's output is the head's input: its gradient is the shards' summed partials
            return [out], [grad_output], [grad_output]
        return super()._roots(stage, out, grad_output)

    def report(self, mb: int, per_token_losses: torch.Tensor, coef: torch.Tensor) -> LossOutput:
        """The shards' loss report: the scaled loss Σ coef·loss; on the owner also the unscaled loss_fn value."""
        scaled = (coef.to(per_token_losses.dtype) * per_token_losses).sum()
        raw = self._raw_coef.pop(mb, None)
        if raw is not None:
            self.losses[mb] = (raw.to(per_token_losses.dtype) * per_token_losses).sum().detach()
        return LossOutput(loss=scaled.detach(), raw=self.losses.get(mb))

    # ---- shard actions (the `shards` object) -----------------------------------------------------------
    def split_meta(self, what: str):
        """Meta of a split hand-over (the shards')."""
        return self.shards.split_meta(what)

    def head_forward(self, stage: int, mb: int, hidden):
        """H on this rank's head shard."""
        return self.shards.head_forward(stage, mb, hidden)

    def head_backward_input(self, stage: int, mb: int, peer_stats):
        """J on this rank's head shard: (partial input gradient, LossOutput)."""
        return self.shards.head_backward_input(stage, mb, peer_stats)

    def head_backward_weight(self, stage: int, mb: int) -> None:
        """K on this rank's head shard, its gradient then in DeepSpeed's bf16 masters."""
        with self._shard_grads():
            self.shards.head_backward_weight(stage, mb)

    def pending(self) -> int:
        """(stage or shard, micro-batch) pairs whose state is still held (0 after a complete step)."""
        return super().pending() + (self.shards.pending() if self.shards is not None else 0)

    @contextmanager
    def _shard_grads(self):
        """bf16: the shard weights' gradients of one K added into the fp32 masters (as after a B or W)."""
        opt = self.engine.optimizer
        if not self.engine.using_bf16_optimizer:
            yield
            return
        if opt.immediate_grad_update:  # no autograd hook fires for a shard's directly added gradient
            yield
            for p in self.module.head_shard_parameters():
                if p.grad is not None:
                    i, j = _group_index(opt, p)
                    opt.accumulate_hp_grads_and_remove_lp(p, i, j)
            return
        opt.clear_lp_grads()
        yield
        opt.update_hp_grads(clear_lp_grads=False)

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


def _group_index(opt, param) -> tuple[int, int]:
    """(group, index) of `param` in the bf16 optimizer's groups (where its fp32 master gradient lives)."""
    for i, group in enumerate(opt.bf16_groups):
        for j, p in enumerate(group):
            if p is param:
                return i, j
    raise OctoPipeError(f"a head shard weight {tuple(param.shape)} is not in the optimizer: pass "
                        "model_parameters=[p for p in module.parameters() if p.requires_grad] to deepspeed.initialize")
