"""StageRunner over plain `nn.Module` stages: the reference implementation of the interface."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .boundary import flatten, unflatten
from .interface import LossOutput
from .split_backward import accumulate_grad, backward_input, backward_weight, owned_grad
from .stage_core import Forwarded, StageCore, _add, _computed, _passthrough, input_targets

GRAD_SINKS = ("direct", "autograd")


def split_loss(raw) -> tuple[torch.Tensor, object, Mapping | None]:
    """(loss, num_tokens, logs) of what a loss function returned: a tensor, (loss, dict),
    (loss, num_tokens, dict) as Megatron's loss functions do, or a dict with a 'loss' entry."""
    if isinstance(raw, torch.Tensor):
        return raw, None, None
    if isinstance(raw, Mapping):
        return raw["loss"], raw.get("num_tokens"), raw
    if isinstance(raw, (tuple, list)):
        if len(raw) == 2:
            return raw[0], None, raw[1]
        if len(raw) == 3:
            return raw[0], raw[1], raw[2]
    raise TypeError(f"a loss function returns a tensor, (loss, dict), (loss, num_tokens, dict) or a dict with "
                    f"'loss'; got {type(raw).__name__}")


class TorchStages(StageCore):
    """The stages one rank owns, each an `nn.Module` mapping the stage input to its output.

    - Inputs and outputs are a tensor or a tuple / list / dict of tensors (boundary.py);
      tensors that do not require grad (masks, ids) get no gradient back.
    - `call(stage, module, inputs, batch)` runs a stage (default `module(inputs)`); `inputs`
      is stage - 1's output, or on the first stage `load_input(mb)` (None without it);
      `batch` is the step's micro-batch (run_step(data=...)), so any stage can read data
      (a branched model's second source, the last stage's labels).
    - `loss_fn(output, batch)` gives the last stage's loss (`batch` is the micro-batch
      index when the step has no data source) as a tensor, (loss, dict), (loss, num_tokens,
      dict) or {'loss': ...}; `scale_loss(loss, num_tokens)` turns it into what the step
      sums and backward starts from (default: divided by `num_microbatches`); `grad_scale`
      (e.g. a loss scaler) multiplies only the backward's start.
    - The F/B/I/W life cycle is `stage_core.StageCore`'s; this class gives its hooks for plain modules.
    - `metas[s]` declares stage s's output (TensorMeta or a structure of them); None, or a
      None entry, lets the executor learn it by one handshake per step.
    - `grad_sink`: 'autograd' (default: weight gradients reach `p.grad` through each
      parameter's AccumulateGrad, so grad-accumulator hooks such as Megatron DDP's and
      DeepSpeed ZeRO's, and post-accumulate-grad hooks, fire once per parameter and
      micro-batch, B or I+W alike) or 'direct' (computed, then added into `p.grad` without
      running hooks; measured no faster, kept for runners that must bypass the hooks).
    - `memory`: the plan's memory choices, from `memory_choices.apply_memory(modules, plan)` (which wraps the
      layers it names in `modules` first): recompute, selective recompute and offload per layer.
    - Split layers: `shards` runs this rank's shard actions (`vocab_shard.VocabShards`); with a
      split head the last stage's module gives the head's input and `head_loss(mb, batch)` ->
      (targets, rule) its loss terms (`StageCore.head_input`: `rule(per_token_losses)` is the
      backward's root, e.g. the mean, `scale_loss` and `grad_scale`); with a split embedding stage 0
      runs on the summed partials instead of `load_input`. See `vocab_shard.SplitTorchStages`.
    """

    def __init__(
        self,
        *,
        modules: Mapping[int, nn.Module],
        num_stages: int,
        num_microbatches: int,
        metas: Sequence | None = None,
        load_input: Callable[[int], object] | None = None,
        loss_fn: Callable | None = None,
        call: Callable | None = None,
        scale_loss: Callable | None = None,
        grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        grad_sink: str = "autograd",
        shards=None,
        head_loss: Callable | None = None,
        memory=None,
    ):
        if grad_sink not in GRAD_SINKS:
            raise ValueError(f"grad_sink {grad_sink!r}: expected one of {', '.join(GRAD_SINKS)}")
        super().__init__(num_stages=num_stages, num_microbatches=num_microbatches, grad_scale=grad_scale,
                         shards=shards, memory=memory)
        self.head_loss = head_loss
        self.modules = dict(modules)
        self.metas = tuple(metas) if metas is not None else None
        self.load_input = load_input
        self.loss_fn = loss_fn
        self.call = call
        self.scale_loss = scale_loss or (lambda loss, num_tokens: loss / self.num_microbatches)
        self.grad_sink = grad_sink

    def boundary_meta(self, stage: int):
        """Meta of stage `stage`'s output (None: learned per step)."""
        return self.metas[stage] if self.metas is not None else None

    # ----- forward (StageCore hooks)

    def _stage_input(self, stage: int, mb: int, inputs, keep: bool):
        """Stage 0 loads its input; the others take the received value, cut from the producer's graph when kept."""
        if stage == 0:
            if self.embedding_split:  # the summed partials (made without a graph): their gradient goes to every G
                return inputs.detach().requires_grad_(keep)
            return self._first_input(mb)
        return _cut(inputs) if keep else inputs

    def _forward(self, stage: int, mb: int, x, batch, keep: bool):
        if stage == self.num_stages - 1 and self.head_split:
            hidden = self._module_output(stage, x, batch)
            if self.head_loss is None:
                raise ValueError(f"{type(self).__name__}: the plan splits the LM head, but no head_loss= was given "
                                 f"(the owner stage hands each shard the targets and the loss rule)")
            targets, rule = self.head_loss(mb, batch)
            return self.head_input(hidden, targets, rule), Forwarded(input=x, output=hidden)
        out = self._compute(stage, mb, x, batch)
        if stage < self.num_stages - 1:
            return out, Forwarded(input=x, output=out)
        result, root = self._loss_output(out)
        return result, Forwarded(input=x, output=root)

    def _first_input(self, mb: int):
        """Stage 0's pipeline input of micro-batch `mb` (None without `load_input`)."""
        if self.load_input is None:
            return None
        x = self.load_input(mb)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            # A float input that "requires grad" lets I walk the activation chain of stage 0 and
            # leave W only the weight products, as on every other stage (a faithful I/W split for
            # zero-bubble plans), at the price of the first layer's unused input-gradient product.
            # Integer inputs (token ids): I stops at the embedding's output instead (stage_core, grad_starts).
            x = x.detach().requires_grad_(True)
        return x

    def _compute(self, stage: int, mb: int, x, batch):
        """The stage's output, or on the last stage what its loss function returned (subclasses change how)."""
        out = self._module_output(stage, x, batch)
        if stage < self.num_stages - 1:
            return out
        return self.loss_fn(out, batch if batch is not None else mb)

    def _module_output(self, stage: int, x, batch):
        """What the stage's module gives for input `x` (through `call` when given)."""
        module = self.modules[stage]
        return self.call(stage, module, x, batch) if self.call is not None else module(x)

    def _loss_output(self, raw) -> tuple[LossOutput, torch.Tensor]:
        """(what the step reports, the tensor the backward starts from)."""
        loss, num_tokens, logs = split_loss(raw)
        scaled = self.scale_loss(loss, num_tokens)
        return LossOutput(loss=scaled.detach(), num_tokens=num_tokens, logs=logs, raw=raw), scaled

    def _params(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.modules[stage].parameters() if p.requires_grad]

    # ----- backward (StageCore hooks): autograd, and the executor's split walk with this runner's sink

    def _fused(self, stage: int, fwd: Forwarded, grad_output, want_dx: bool = True):
        x = fwd.input
        outs, gs, incoming = self._roots(stage, fwd.output, grad_output)
        ins = input_targets(x) if want_dx and (stage > 0 or self.embedding_split) else []
        dx = _passthrough(outs, gs, ins)
        outs, gs = _computed(outs, gs, ins)
        params = self._params(stage)
        if outs and (params or ins):
            if self.grad_sink == "autograd":
                for t in ins:
                    t.grad = None
                torch.autograd.backward(outs, gs, inputs=params + ins)
                for t in ins:
                    _add(dx, t, t.grad)
            else:
                grads = torch.autograd.grad(outs, params + ins, gs, allow_unused=True)
                for p, g in zip(params, grads):
                    if g is not None:
                        accumulate_grad(p, owned_grad(g, incoming))
                for t, g in zip(ins, grads[len(params):]):
                    _add(dx, t, g)
        return self._dx(stage, x, dx)

    def _split_input(self, stage: int, outs: list, gs: list, ins: list):
        return backward_input(outs, gs, ins, self._params(stage))

    def _split_weight(self, stage: int, work) -> None:
        backward_weight(work, self.grad_sink)


def _cut(inputs):
    """The received value as fresh autograd leaves (detach() shares storage: a same-device hand-off is not
    copied, only cut from the producer's graph); each keeps the producer's requires_grad."""
    leaves, structure = flatten(inputs)
    return unflatten([t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                      for t in leaves], structure)
