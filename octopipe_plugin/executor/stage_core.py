"""The F/B/I/W life cycle of a rank's stages, written once; each runner fills in its hooks.

`StageCore` is what `TorchStages` (plain modules, and DeepSpeed's stages on top of it) and
the Megatron adapter's `MegatronStages` share: what each action keeps for the next one of
its (stage, micro-batch), how the backward starts (the last stage from its loss, times the
gradient scale; the others from the received gradient), which outputs and inputs a backward
differentiates, and the rule that a stage with no input gradient to give (the first stage
on token ids, a data-only input) runs I down to where its gradient chain starts (the tensors
F computed from data and weights alone, `grad_starts`: the embedding's output) and the weights
at W; only a stage where F finds no such start runs nothing at I and its whole backward at W.

A runner says only where its framework differs, through these hooks:
- `_stage_input(stage, mb, inputs, keep)` / `_forward(stage, mb, x, batch, keep)`: the call
  (and on the last stage the loss); `_forward` returns (what F hands on, the `Forwarded`
  state to keep or None);
- `grad_scale` (constructor): multiplies the last stage's loss where its backward starts;
- `_fused(stage, fwd, grad_output, want_dx)`: B, and W of a stage without input gradient;
- `_split_input` / `_split_weight`: I and W of the split backward (the weight-gradient sink);
- `_grad_action(stage, kind, last_backward)`: a context around every backward action (gradient
  synchronisation, the active stage, master gradients);
- `_autograd_view(fwd)`: a context in which autograd sees the kept output whole (an output
  whose storage was freed after its send);
- `_shard_grad(stage, kind, last_backward)`: a context around K and G, the split layers' weight-gradient
  actions (`last_backward`: the rank's last action of that kind in the step; a tied pair's one weight is
  complete after the later of its last K and last G), where a framework's gradient sync sees the shard
  weights' gradients.

Split layers (docs/formats.md, "Split layers"): a runner built with `shards=` (a `VocabShards`, or a
stand-in with the same methods) runs the shard actions there (`SHARD_METHODS`, `split_meta`). With a
split head the last stage is not where the loss is: its F hands the head's input on (`head_input`
builds the `HeadInput` from the hidden states, the targets and the loss rule) and its backward starts
from the summed partials like any other stage's; with a split embedding stage 0 takes the summed
partials as its input and gives their gradient back.

Per-(stage, micro-batch) state is typed (`Forwarded`, `InputGradDone`, `WeightDoesAll`) and
kept in one `StageStates`; each entry dies with its last use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..actions import Kind
from .boundary import flatten, unflatten
from .grad_starts import recorded_starts
from .head_input import HeadInput, coef_dtype, loss_coefficients
from .interface import RunnerInterfaceError


@dataclass(frozen=True, kw_only=True, slots=True)
class Forwarded:
    """After F: the stage input and the output (on the last stage the scaled loss) its backward starts from."""

    input: object
    output: object
    # the output's shape when its storage was freed after the send (Megatron's deallocate_pipeline_outputs): the
    # output then holds one element and `_autograd_view` shows autograd this shape
    output_shape: tuple | None = None
    # on a stage whose input takes no gradient: the tensors its gradient chain starts from (grad_starts), where I
    # stops so that W keeps only the weights' work
    starts: tuple = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class InputGradDone:
    """After I: what W needs to finish the weight gradients (the sink's work; None when nothing is left)."""

    work: object


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightDoesAll:
    """After I on a stage with no input gradient to give: W runs the whole backward from here."""

    forwarded: Forwarded
    grad_output: object


class StageStates:
    """One typed state per (stage, micro-batch) of a rank; `take` drops it, `get` leaves it."""

    def __init__(self):
        self._states: dict[tuple[int, int], object] = {}

    def put(self, stage: int, mb: int, state) -> None:
        """Keep `state` for the next action of (stage, mb), replacing what the previous one kept."""
        self._states[(stage, mb)] = state

    def get(self, stage: int, mb: int, *types):
        """The state of (stage, mb), which must be one of `types` (an action out of order fails here)."""
        state = self._states.get((stage, mb))
        if not isinstance(state, types):
            want = " or ".join(t.__name__ for t in types)
            have = "nothing" if state is None else type(state).__name__
            raise RuntimeError(f"stage {stage}, micro-batch {mb}: expected the state of {want}, found {have} "
                               "(an action ran before the one it depends on)")
        return state

    def take(self, stage: int, mb: int, *types):
        """`get`, and forget it (the action is the pair's last use of it)."""
        state = self.get(stage, mb, *types)
        del self._states[(stage, mb)]
        return state

    def clear(self) -> None:
        """Forget every state (a step abandoned, or a new step that starts over)."""
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)


class StageCore:
    """The stage life cycle over autograd: F keeps `Forwarded`, B runs `_fused`, I and W split it."""

    def __init__(self, *, num_stages: int, num_microbatches: int,
                 grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None, shards=None, memory=None):
        self.num_stages = num_stages
        # the plan's memory choices (executor/memory_choices.py `apply_memory`): F's offload scope, the backwards'
        # copy-ins; None: no layer recomputes or offloads
        self.memory = memory
        self.num_microbatches = num_microbatches
        self.grad_scale = grad_scale
        self.state = StageStates()
        self.shards = shards  # this rank's split-layer shards (None: the runner runs no shard action)
        self.head_split = bool(getattr(shards, "head_split", False))
        self.embedding_split = bool(getattr(shards, "embedding_split", False))

    # ----- hooks (see the module docstring)

    def _stage_input(self, stage: int, mb: int, inputs, keep: bool):
        raise NotImplementedError

    def _forward(self, stage: int, mb: int, x, batch, keep: bool) -> tuple[object, Forwarded | None]:
        raise NotImplementedError

    def _params(self, stage: int) -> list:
        raise NotImplementedError

    def _fused(self, stage: int, fwd: Forwarded, grad_output, want_dx: bool = True):
        raise NotImplementedError

    def _split_input(self, stage: int, outs: list, gs: list, ins: list) -> tuple[tuple, object]:
        raise NotImplementedError

    def _split_weight(self, stage: int, work) -> None:
        raise NotImplementedError

    def _grad_action(self, stage: int, kind: Kind, last_backward: bool):
        return contextlib.nullcontext()

    def _autograd_view(self, fwd: Forwarded):
        return contextlib.nullcontext()

    def _shard_grad(self, stage: int, kind: Kind, last_backward: bool):
        return contextlib.nullcontext()

    # ----- the life cycle (StageRunner)

    def forward(self, stage: int, mb: int, inputs, *, batch=None, forward_only: bool = False):
        """F: run the stage (the last stage applies the loss); keeps what its backward needs unless forward_only."""
        keep = not forward_only
        with contextlib.nullcontext() if keep else torch.no_grad():
            x = self._stage_input(stage, mb, inputs, keep)
            # a stage whose input takes no gradient: find where its gradient chain starts (grad_starts)
            recording = recorded_starts() if keep and not input_targets(x) else contextlib.nullcontext([])
            scope = self.memory.forward_scope(stage, mb, keep) if self.memory is not None else contextlib.nullcontext()
            with recording as starts, scope:
                value, fwd = self._forward(stage, mb, x, batch, keep)
            if fwd is not None and starts:
                fwd = dataclasses.replace(fwd, starts=tuple(starts))
        if keep and fwd is not None:
            self.state.put(stage, mb, fwd)
        return value

    def backward(self, stage: int, mb: int, grad_output, *, last_backward: bool = False):
        """B: input and parameter gradients in one pass; frees the micro-batch's graph."""
        fwd = self.state.take(stage, mb, Forwarded)
        if self.memory is not None:
            self.memory.before_backward(stage, mb)
        with self._grad_action(stage, Kind.B, last_backward):
            out = self._fused(stage, fwd, grad_output, want_dx=True)
        if self.memory is not None:
            self.memory.after_backward(stage, mb)
        return out

    def backward_input(self, stage: int, mb: int, grad_output, *, last_backward: bool = False):
        """I: the input gradient only; keeps the captured gradients (not the activations above them) for W."""
        fwd = self.state.get(stage, mb, Forwarded)
        ins = input_targets(fwd.input)
        # no input gradient to give (first stage on token ids): I stops where the stage's gradient chain starts
        targets = ins or list(fwd.starts)
        if self.memory is not None:
            self.memory.before_backward(stage, mb)
        with self._grad_action(stage, Kind.I, last_backward):
            if not targets:
                # nor a start found in F (no module computes from data and weights alone): all is W's work
                self.state.put(stage, mb, WeightDoesAll(forwarded=fwd, grad_output=grad_output))
                return self._dx(stage, fwd.input, {})
            with self._autograd_view(fwd):
                outs, gs, _ = self._roots(stage, fwd.output, grad_output)
                dx = _passthrough(outs, gs, ins)
                outs, gs = _computed(outs, gs, ins)
                work = None
                if outs:
                    dins, work = self._split_input(stage, outs, gs, targets)
                    for t, g in zip(ins, dins):  # a start's gradient is W's, not the stage's input gradient
                        _add(dx, t, g)
        self.state.put(stage, mb, InputGradDone(work=work))  # drops the input and output references
        if self.memory is not None:
            self.memory.after_input(stage, mb)
        return self._dx(stage, fwd.input, dx)

    def backward_weight(self, stage: int, mb: int, *, last_backward: bool = False) -> None:
        """W: finish the weight gradients deferred by backward_input."""
        done = self.state.take(stage, mb, InputGradDone, WeightDoesAll)
        if self.memory is not None:
            self.memory.before_weight(stage, mb)
        with self._grad_action(stage, Kind.W, last_backward):
            if isinstance(done, WeightDoesAll):
                self._fused(stage, done.forwarded, done.grad_output, want_dx=False)
            elif done.work is not None:
                self._split_weight(stage, done.work)
        if self.memory is not None:
            self.memory.after_backward(stage, mb)

    def pending(self) -> int:
        """(stage or shard, micro-batch) pairs whose state is still held (0 after a complete step)."""
        return len(self.state) + (self.shards.pending() if self.shards is not None else 0)

    # ----- split layers: the shard actions run in `shards` (StageRunner's optional SHARD_METHODS)

    def split_meta(self, what: str):
        """Meta of a split hand-over this rank receives (the shards' `split_meta`)."""
        return self._the_shards("split_meta").split_meta(what)

    def head_forward(self, stage: int, mb: int, hidden, *, forward_only: bool = False):
        """H: the head shard's statistics from the owner's HeadInput."""
        return self._the_shards("head_forward").head_forward(stage, mb, hidden, **_eval(forward_only))

    def head_backward_input(self, stage: int, mb: int, peer_stats, *, forward_only: bool = False):
        """J: (partial input gradient, LossOutput) from every shard's statistics (no partial when forward_only)."""
        return self._the_shards("head_backward_input").head_backward_input(stage, mb, peer_stats,
                                                                          **_eval(forward_only))

    def head_backward_weight(self, stage: int, mb: int, *, last_backward: bool = False) -> None:
        """K: the head shard's weight gradient, inside `_shard_grad`."""
        shards = self._the_shards("head_backward_weight")
        with self._shard_grad(stage, Kind.K, last_backward):
            shards.head_backward_weight(stage, mb)

    def embedding_forward(self, stage: int, mb: int, *, forward_only: bool = False):
        """E: the embedding shard's partial of stage 0's input."""
        return self._the_shards("embedding_forward").embedding_forward(stage, mb, **_eval(forward_only))

    def embedding_backward(self, stage: int, mb: int, grad_output, *, last_backward: bool = False) -> None:
        """G: the embedding shard's weight gradient from stage 0's input gradient, inside `_shard_grad`."""
        shards = self._the_shards("embedding_backward")
        with self._shard_grad(stage, Kind.G, last_backward):
            shards.embedding_backward(stage, mb, grad_output)

    def _the_shards(self, name: str):
        if self.shards is None:
            raise RunnerInterfaceError(f"stage runner {type(self).__name__}: {name}() called, but the runner was built "
                                       f"without shards= (pass a VocabShards for a plan with split layers)")
        return self.shards

    def head_input(self, hidden: torch.Tensor, targets: torch.Tensor, rule) -> HeadInput:
        """The split head owner's hand-over: `hidden`, the `targets` of its rows (hidden.reshape(-1, h)) and the
        coefficients of the loss rule `rule(per_token_losses) -> backward root` (`loss_coefficients`)."""
        t = targets.reshape(-1)
        if t.numel() * hidden.shape[-1] != hidden.numel():
            raise ValueError(f"the split head's owner hands over {t.numel()} targets for hidden states of shape "
                             f"{tuple(hidden.shape)}: expected one per row of hidden.reshape(-1, "
                             f"{hidden.shape[-1]}) (same order)")
        coef = loss_coefficients(rule, t.numel(), coef_dtype(hidden.dtype), hidden.device)
        return HeadInput(hidden=hidden, targets=t.to(device=hidden.device, dtype=torch.int64), coef=coef)

    # ----- what every backward shares

    def _roots(self, stage: int, out, grad_output) -> tuple[list, list, list]:
        """(output tensors to differentiate, their gradients, incoming gradient tensors) of one backward.

        The last stage starts from its loss times `grad_scale`; the others from the received
        gradients, for the outputs that require grad and got one."""
        if stage == self.num_stages - 1 and not self.head_split:
            root = self.grad_scale(out) if self.grad_scale is not None else out
            return [root], [torch.ones_like(root)], []
        outs, _ = flatten(out)
        gs, _ = flatten(grad_output) if grad_output is not None else ([None] * len(outs), None)
        pairs = [(o, g) for o, g in zip(outs, gs, strict=True)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        incoming = [g for g in gs if isinstance(g, torch.Tensor)]
        return [o for o, _ in pairs], [g for _, g in pairs], incoming

    def _dx(self, stage: int, x, grads: dict):
        """The input gradient in the input's structure (None at leaves without one; None on the first stage, unless
        it takes a split embedding's partials)."""
        if stage == 0 and not self.embedding_split:
            return None
        leaves, structure = flatten(x)
        return unflatten([grads.get(id(t)) for t in leaves], structure)


def _eval(forward_only: bool) -> dict:
    """The keyword of an evaluation step's shard call (none in training: stand-ins need not take it)."""
    return {"forward_only": True} if forward_only else {}


def input_targets(x) -> list:
    """Input leaves that require grad (what I differentiates; none: the stage has no input gradient)."""
    return [t for t in flatten(x)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _passthrough(outs: list, gs: list, ins: list) -> dict:
    """Gradients of output tensors that are input tensors themselves (a stage passing a tensor on unchanged)."""
    ids = {id(t) for t in ins}
    dx: dict = {}
    for o, g in zip(outs, gs):
        if id(o) in ids:
            _add(dx, o, g)
    return dx


def _computed(outs: list, gs: list, ins: list) -> tuple[list, list]:
    """The (output, gradient) pairs a backward must run autograd for (the pass-through ones are done)."""
    ids = {id(t) for t in ins}
    kept = [(o, g) for o, g in zip(outs, gs) if id(o) not in ids]
    return [o for o, _ in kept], [g for _, g in kept]


def _add(dx: dict, t: torch.Tensor, g) -> None:
    if g is None:
        return
    prev = dx.get(id(t))
    dx[id(t)] = g if prev is None else prev + g
