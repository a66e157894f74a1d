"""The per-stage interface the executor drives; adapters (plain torch, Megatron, DeepSpeed) implement it.

One object serves every stage a rank owns. The executor never looks inside a stage: it
hands each action its input (an activation or an output gradient, each a tensor or a
tuple / list / dict of tensors) and passes on what the action returns, so frameworks keep
their own model, data and loss conventions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from ..actions import Kind
from ..errors import OctoPipeError


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
    - Optional: a `backward` / `backward_input` / `backward_weight` that accepts a
      `last_backward` keyword (or **kwargs) gets `last_backward=True` on the call that is its
      stage's last weight-gradient action of the training step (the kind table's
      `weight_grad`: B or W), False on the others, *before* it runs (e.g. to let the last
      micro-batch's backward start the gradient reduction). Runners without it are called as
      before; `PipelineExecutor(on_last_backward=)` still fires after that call.
    - Split layers (docs/formats.md, "Split layers"): a rank that runs shard actions needs the
      optional methods of `SHARD_METHODS` (H, J, K of the LM head, E, G of the embedding) and
      `split_meta(what)`, the TensorMeta of each split hand-over it receives ("head-input",
      "stats", "head-partial", "embedding-partial", "embedding-grad"). The owner stage's own
      actions run its layers without the split one: with a split head its F returns the head's
      input with its loss terms, a `head_input.HeadInput(hidden, targets, coef)` (handed to every
      shard: only the owner has the labels and the loss rule), and its B/I gets the sum of the
      shards' partials as `grad_output`; with a split embedding stage 0's F gets the sum of the partials as `inputs`
      and its B/I returns their gradient (handed to every G). Shard methods get no `batch`: the
      embedding's shards load their own tokens, the head's get everything from the HeadInput.
      `StageCore` runners run them in the `shards=` they are built with (`vocab_shard.VocabShards`).
    - Optional, overlapped pairs (docs/formats.md, "Overlapped pairs"): a runner with a method
      `pair(first, first_input, second, second_input, *, batch=None, last_backward=False)` gets
      each pair of its rank's list (`first` an F, `second` a B or I of another micro-batch, both
      `Action`s) as one call, once both inputs are there, and returns (first's output, second's
      output), running the two halves interleaved (executor/phased.py: one half's communication
      while the other computes); `batch` is the F's micro-batch, `last_backward` the second's
      flag. A runner without it runs the two halves one after the other, as unpaired actions.
    - `check_runner` refuses, when the executor is built, a runner whose methods cannot take
      these calls.
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


class RunnerInterfaceError(OctoPipeError, TypeError):
    """A stage runner lacks a method, or a parameter, that the executor will call it with."""


# The runner method each kind of action calls (the positional parameters after `self`).
# Shard kinds (optional methods, needed only where a rank runs them):
# - head_forward(stage, mb, hidden) -> the shard's statistics (a [tokens, 3] tensor: local max, sum of
#   exponentials, target logit or 0), handed to every other shard; `hidden` is the owner's F output, a
#   `head_input.HeadInput(hidden, targets, coef)` (received: its 3-tuple);
# - head_backward_input(stage, mb, peer_stats) -> (partial input gradient, LossOutput): peer_stats are the
#   other shards' statistics in shard-device order; every shard reports the micro-batch's loss;
# - head_backward_weight(stage, mb): the shard rows' weight gradient, deferred like W;
# - embedding_forward(stage, mb) -> the partial embedding of the tokens in the shard's rows (zeros elsewhere);
# - embedding_backward(stage, mb, grad_output): the shard rows' weight gradient from stage 0's input gradient.
# In an evaluation step (a forward-only split plan: F, H, J, E) H, J and E get `forward_only=True` and keep
# nothing, J returning (None, LossOutput); K and G, like B and W, may take `last_backward=`.
SHARD_METHODS: Mapping[Kind, str] = MappingProxyType({
    Kind.H: "head_forward", Kind.J: "head_backward_input", Kind.K: "head_backward_weight",
    Kind.E: "embedding_forward", Kind.G: "embedding_backward"})
RUNNER_METHODS: Mapping[Kind, str] = MappingProxyType({
    Kind.F: "forward", Kind.B: "backward", Kind.I: "backward_input", Kind.W: "backward_weight", **SHARD_METHODS})
_POSITIONAL = MappingProxyType({
    "boundary_meta": ("stage",), "forward": ("stage", "mb", "inputs"), "backward": ("stage", "mb", "grad_output"),
    "backward_input": ("stage", "mb", "grad_output"), "backward_weight": ("stage", "mb"),
    "head_forward": ("stage", "mb", "hidden"), "head_backward_input": ("stage", "mb", "peer_stats"),
    "head_backward_weight": ("stage", "mb"), "embedding_forward": ("stage", "mb"),
    "embedding_backward": ("stage", "mb", "grad_output"), "split_meta": ("what",),
    "pair": ("first", "first_input", "second", "second_input")})
_KEYWORDS = MappingProxyType({"forward": ("batch", "forward_only"), "pair": ("batch",)})  # always passed
LAST_BACKWARD = "last_backward"  # passed where the method accepts it
# the methods told `last_backward=`: the stages' weight-gradient actions, and the shards' (K, G: per kind); a
# pair's, for its second half
_TAKES_LAST = ("backward", "backward_input", "backward_weight", "head_backward_weight", "embedding_backward",
               "pair")
PAIR_METHOD = "pair"  # optional: runs an overlapped pair as one call (StageRunner)
FORWARD_ONLY = "forward_only"  # passed (True) to H, J and E in an evaluation step only
_SHARD_NAMES = frozenset(SHARD_METHODS.values()) | {"split_meta"}
_EVAL_SHARD = (SHARD_METHODS[Kind.H], SHARD_METHODS[Kind.J], SHARD_METHODS[Kind.E])  # what evaluation runs


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerBinding:
    """What `check_runner` found: the methods that take `last_backward=`, and the shard methods that cannot take
    an evaluation step's `forward_only=` (an evaluation of a split plan refuses them by name)."""

    takes_last_backward: frozenset[str]
    no_forward_only: frozenset[str] = frozenset()
    runs_pairs: bool = False  # the runner's `pair` runs the rank's overlapped pairs (else: half after half)


def check_runner(runner, kinds, *, split: bool = False, pairs: bool = False) -> RunnerBinding:
    """Refuse (RunnerInterfaceError, one line naming class, method and what is missing) a runner that cannot
    take the calls the executor makes for actions of `kinds` (`split`: and a split layer's hand-overs; `pairs`:
    the rank runs overlapped pairs, which go to the runner's optional `pair` where it has one); say which
    methods take `last_backward=`."""
    cls = type(runner).__name__
    kinds = set(kinds)
    names = ["boundary_meta"] + [RUNNER_METHODS[k] for k in Kind if k in kinds]
    if split or kinds & set(SHARD_METHODS):
        names.append("split_meta")
    runs_pairs = pairs and callable(getattr(runner, PAIR_METHOD, None))
    if runs_pairs:
        names.append(PAIR_METHOD)
    takes, no_eval = set(), set()
    for name in names:
        method = getattr(runner, name, None)
        # a StageCore runner has the shard methods, but runs them only with the shards it was built with
        unbuilt = name in _SHARD_NAMES and hasattr(runner, "shards") and runner.shards is None
        if not callable(method) or unbuilt:
            why = " (built without shards=: pass a VocabShards, or a stand-in)" if unbuilt else ""
            raise RunnerInterfaceError(f"stage runner {cls}: has no method {name}(){why}: the executor calls "
                                       f"{_call(name)} (see executor.interface.StageRunner)")
        try:
            sig = inspect.signature(method)
        except (TypeError, ValueError):  # a builtin or C callable without a signature: trust it
            continue
        problem = _mismatch(sig, name)
        if problem is not None:
            raise RunnerInterfaceError(f"stage runner {cls}: {name}{sig} {problem}: the executor calls "
                                       f"{_call(name)} (see executor.interface.StageRunner)")
        if name in _TAKES_LAST and _accepts(sig, LAST_BACKWARD):
            takes.add(name)
        if name in _EVAL_SHARD and not _accepts(sig, FORWARD_ONLY):
            no_eval.add(name)
    return RunnerBinding(takes_last_backward=frozenset(takes), no_forward_only=frozenset(no_eval),
                         runs_pairs=runs_pairs)


def check_evaluation(runner, binding: RunnerBinding, kinds) -> None:
    """Refuse (RunnerInterfaceError, one line) an evaluation step whose shard actions of `kinds` call a method
    that cannot take `forward_only=True`: the runner's, or that of the `shards` a StageCore runner hands it to."""
    shards = getattr(runner, "shards", None)
    for k in (k for k in SHARD_METHODS if k in kinds):
        name = SHARD_METHODS[k]
        owner = runner if name in binding.no_forward_only else None
        if owner is None and shards is not None:
            try:
                sig = inspect.signature(getattr(shards, name))
            except (AttributeError, TypeError, ValueError):
                sig = None
            owner = shards if sig is not None and not _accepts(sig, FORWARD_ONLY) else None
        if owner is not None:
            raise RunnerInterfaceError(f"stage runner {type(runner).__name__}: {type(owner).__name__}.{name}() lacks "
                                       f"the keyword forward_only=: an evaluation step of a split plan calls "
                                       f"{name}(..., forward_only=True) (see executor.interface.StageRunner)")


def _call(name: str) -> str:
    kws = [f"{k}=..." for k in _KEYWORDS.get(name, ())]
    return f"{name}({', '.join(list(_POSITIONAL[name]) + kws)})"


def _accepts(sig: inspect.Signature, keyword: str) -> bool:
    p = sig.parameters.get(keyword)
    if p is not None:
        return p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    return any(q.kind is q.VAR_KEYWORD for q in sig.parameters.values())


def _mismatch(sig: inspect.Signature, name: str) -> str | None:
    missing = [k for k in _KEYWORDS.get(name, ()) if not _accepts(sig, k)]
    if missing:
        return "lacks the keyword" + ("s " if len(missing) > 1 else " ") + ", ".join(f"{k}=" for k in missing)
    try:
        sig.bind(*_POSITIONAL[name], **{k: None for k in _KEYWORDS.get(name, ())})
    except TypeError as exc:
        return f"cannot take {len(_POSITIONAL[name])} positional arguments ({exc})"
    return None
