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
- Split LM head (`shards=`, SHARD_API.md): StageCore runs the shard actions (H, J, K) in the
  `shards` object; the owner (the last stage, built without the head) hands on a `HeadInput`,
  its targets and loss rule read from the module's `loss_fn` (`loss_terms.head_terms`) and scaled
  as this runner's loss (GAS, fp16 loss scale) through `StageCore.head_input`; the shard weights'
  gradients reach DeepSpeed's bf16 masters after every K (`_shard_grad`); the micro-batch's
  unscaled loss (for `total_loss`) is reported by the owner's own shard (`report`). With stand-in
  shards (no real head) the owner hands on (hidden, None, None).
- Split embedding: stage 0 (built without the embedding) takes the shards' summed lookups as its input; the
  token ids they look up are every micro-batch's `batch[0]`, read ahead of the step on stage 0's rank
  (`step_tokens`, the engine sends them to the shards), so the data contract above holds.
- Overlapped pairs (`paired=True`, a plan with pairs): every training action runs phase by phase through
  moe_pairs.PairedStages (DeepSpeed MoE entries as gate / dispatch all-to-all / experts / combine all-to-all /
  combine phases), and `pair` interleaves a pair's halves; the same data, loss bookkeeping and bf16 master
  updates as above. Evaluation runs as without pairs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...actions import RULES, Kind
from ...errors import OctoPipeError
from ...executor.interface import LossOutput
from ...executor.stage_core import Forwarded
from ...executor.torch_stage import TorchStages
from .loss_terms import head_terms


class DeepSpeedStages(TorchStages):
    """StageRunner for the stages one rank holds of an OctoPipePipelineModule under an engine.

    `shards`: the object running this rank's shard actions of a split plan (a VocabShards over
    the module's head shard, or a stand-in); required when the plan splits a layer. `memory`: the plan's memory
    choices on the module (memory.apply_plan_memory's LayerMemory)."""

    def __init__(self, engine, *, grad_sink: str = "autograd", shards=None, memory=None, paired: bool = False):
        self.engine = engine
        self.module = engine.module
        self.compute_loss = True
        self.losses: dict[int, torch.Tensor] = {}
        self.batches: list = []
        self.keep_outputs = False  # eval_batch(return_logits=True): keep the last stage's outputs
        self.outputs: dict[int, object] = {}
        plan = self.module.octopipe_plan
        if plan.splits and shards is None:
            raise OctoPipeError(f"DeepSpeedStages: the plan splits layers {[sp.layer for sp in plan.splits]} "
                                "but no shards= runs their shard actions (give a VocabShards or a stand-in)")
        self._loss_checked = False  # loss_fn checked to be a weighted cross-entropy (at the owner's first F)
        self._raw_coef: dict[int, torch.Tensor] = {}  # the owner's d(loss_fn)/d(per-token loss), per micro-batch
        super().__init__(modules={s: self.module for s in self.module.local_stages}, num_stages=plan.num_stages,
                         num_microbatches=plan.num_microbatches, metas=None, load_input=self.first_input,
                         loss_fn=self._loss, call=self._call,
                         grad_scale=self._loss_scale if engine.fp16_enabled() else None, grad_sink=grad_sink,
                         shards=shards, memory=memory)
        self.phased = None
        if paired:
            from .moe_pairs import PairedStages

            self.phased = PairedStages(self)

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
        if self.phased is not None:
            self.phased.num_microbatches = num_microbatches
            self.phased.state.clear()
        if getattr(self.shards, "clear", None) is not None:  # a step abandoned left shard states
            self.shards.clear()

    def batch(self, mb: int):
        """Micro-batch `mb` of this step, pulling from the engine's data iterator in order."""
        while len(self.batches) <= mb:
            self.batches.append(self.engine._next_batch())
        return self.batches[mb]

    def _to_device(self, value):
        if torch.is_tensor(value):
            return value.to(self.engine.device)
        return type(value)(self._to_device(v) for v in value)

    def step_tokens(self, num_microbatches: int, vocab: int) -> torch.Tensor:
        """The step's token ids [m, mbs, seq] of a split embedding: each micro-batch's batch[0] (read ahead), refused
        in one line unless they are integer ids of one shape within the vocabulary."""
        ids = [self.batch(mb)[0] for mb in range(num_microbatches)]
        bad = next((i for i in ids if not torch.is_tensor(i) or i.dim() != 2 or i.is_floating_point()), False)
        if bad is not False:
            got = tuple(bad.shape) if torch.is_tensor(bad) else type(bad).__name__
            raise OctoPipeError(f"plan splits the embedding: a micro-batch's inputs (batch[0]) are {got}, expected "
                                f"token ids [micro-batch size, sequence] (one integer tensor); feed the ids alone "
                                f"or drop the embedding's split")
        if len({tuple(i.shape) for i in ids}) > 1:
            raise OctoPipeError(f"plan splits the embedding: the step's token ids change shape "
                                f"({sorted({tuple(i.shape) for i in ids})}); feed one micro-batch shape")
        tokens = torch.stack(ids).to(device=self.engine.device, dtype=torch.int64)
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise OctoPipeError(f"plan splits the embedding: token ids span [{lo}, {hi}], outside the embedding's "
                                f"{vocab} rows; feed ids in [0, {vocab})")
        return tokens

    def first_input(self, mb: int):
        """Stage 0's input of micro-batch `mb` (batch[0], a tensor or a tuple of them) on the engine's device."""
        return self._to_device(self.batch(mb)[0])

    # ---- overlapped pairs: every training action phase by phase (moe_pairs.PairedStages) -------------------
    def pending(self) -> int:
        """(stage, micro-batch) states still held, the phased runtime's included."""
        return super().pending() + (self.phased.pending() if self.phased is not None else 0)

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """F: phase by phase when the plan has pairs (training), else TorchStages' forward."""
        if self.phased is None or forward_only:
            return super().forward(stage, mb, inputs, batch=batch, forward_only=forward_only)
        self.module.activate_stage(stage)
        return self.phased.forward(stage, mb, inputs, batch=batch)

    def backward(self, stage: int, mb: int, grad_output, *, last_backward: bool = False):
        """B (phase by phase under pairs)."""
        if self.phased is None:
            return super().backward(stage, mb, grad_output, last_backward=last_backward)
        with self._grad_action(stage, Kind.B, last_backward):
            return self.phased.backward(stage, mb, grad_output)

    def backward_input(self, stage: int, mb: int, grad_output, *, last_backward: bool = False):
        """I (phase by phase under pairs)."""
        if self.phased is None:
            return super().backward_input(stage, mb, grad_output, last_backward=last_backward)
        with self._grad_action(stage, Kind.I, last_backward):
            return self.phased.backward_input(stage, mb, grad_output)

    def backward_weight(self, stage: int, mb: int, *, last_backward: bool = False) -> None:
        """W (phase by phase under pairs)."""
        if self.phased is None:
            return super().backward_weight(stage, mb, last_backward=last_backward)
        with self._grad_action(stage, Kind.W, last_backward):
            self.phased.backward_weight(stage, mb)

    def pair(self, first, first_input, second, second_input, *, batch=None, last_backward: bool = False):
        """An overlapped pair F+B/I: its halves' phases interleaved, each half's all-to-alls in flight while the
        other computes (PhasedStages.pair); (F's output, the B/I's input gradient)."""
        if self.phased is None:
            raise OctoPipeError("DeepSpeedStages.pair: built without paired=True (a plan without pairs)")
        with self._grad_action(second.stage, second.kind, last_backward):
            out = self.phased.pair(first, first_input, second, second_input, batch=batch)
        self.module.activate_stage(first.stage)
        return out

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

    # ---- the owner of a split head: hands on the head's input with its loss terms --------------------------
    def _forward(self, stage: int, mb: int, x, batch, keep: bool):
        if not (self.head_split and stage == self.num_stages - 1):
            return super()._forward(stage, mb, x, batch, keep)
        if self.keep_outputs:
            raise OctoPipeError("eval_batch(return_logits=True) under a plan that splits the LM head: no rank "
                                "holds the whole logits (evaluate with return_logits=False, or an unsplit plan)")
        hidden = self._module_output(stage, x, batch)
        if self.module.octopipe_head is None:  # stand-in shards: no real head, no loss terms
            return (hidden, None, None), Forwarded(input=x, output=hidden)
        terms = head_terms(self.module.loss_fn, hidden, self._to_device(self.batch(mb)[1]),
                           vocab=self.module.octopipe_head.vocab, check=not self._loss_checked)
        self._loss_checked = True
        self._raw_coef[mb] = terms.raw_coef

        def rule(per_token: torch.Tensor) -> torch.Tensor:  # the backward's root, as TorchStages scales a loss
            scaled = self.scale_loss((terms.raw_coef.to(per_token.dtype) * per_token).sum(), None)
            return self.grad_scale(scaled) if self.grad_scale is not None else scaled

        return self.head_input(hidden, terms.targets, rule), Forwarded(input=x, output=hidden)

    def report(self, mb: int, per_token_losses: torch.Tensor, coef: torch.Tensor) -> LossOutput:
        """The shards' loss report: the scaled loss Σ coef·loss; on the owner also the unscaled loss_fn value
        (DeepSpeed's total_loss), from its own coefficients."""
        scaled = (coef.to(per_token_losses.dtype) * per_token_losses).sum()
        raw = self._raw_coef.pop(mb, None)
        if raw is not None:
            self.losses[mb] = (raw.to(per_token_losses.dtype) * per_token_losses).sum().detach()
        elif self.module.octopipe_head is None and self.num_stages - 1 in self.module.local_stages:
            # stand-in shards: the owner has no loss_fn value; the reported loss stands for it in total_loss
            self.losses.setdefault(mb, scaled.detach())
        return LossOutput(loss=scaled.detach(), raw=self.losses.get(mb))

    @contextmanager
    def _shard_grad(self, stage: int, kind: Kind, last_backward: bool):
        """bf16 without immediate updates: one K's shard gradients added into the fp32 masters (as after a B or W);
        with immediate updates DeepSpeed's own hooks do it (the shards' autograd sink fires them)."""
        opt = self.engine.optimizer
        bf16 = self.engine.using_bf16_optimizer and not opt.immediate_grad_update
        if bf16:
            opt.clear_lp_grads()
        yield
        if bf16:
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

