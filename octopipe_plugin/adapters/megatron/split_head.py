"""The owner's side of a split LM head in a Megatron run (docs/formats.md, "Split layers").

Under a plan that splits the LM head, the chunk of the last stage (the owner) runs without
Megatron's output layer and loss: GPTModel's own `output_processor` hook (its forward takes one)
returns the final-norm hidden states and keeps the micro-batch's labels, and the owner's F hands
on `(hidden, targets, coef)`:
- `hidden` [seq, mbs, hidden] as the output layer would have received it;
- `targets` int64 [seq * mbs], the labels in the hidden states' token order (sequence-major,
  as Megatron's `compute_language_model_loss` transposes them);
- `coef` float32 [seq * mbs] = d(the backward's root)/d(per-token loss): the `loss_func` that
  `forward_step` returned, then Megatron's own scaling (`forward_step_calc_loss`: / num_tokens
  and / num_microbatches unless `calculate_per_token_loss`, x cp size for a 2-tuple loss) and
  `config.grad_scale_func` (`loss_rule`), differentiated at a probe by the executor's
  `loss_coefficients` (StageCore.head_input; linear for Megatron's loss functions, a second probe
  checks it).
The shards' J gives the real per-token losses back; the owner's J reports them through the same
`loss_func` and `forward_step_calc_loss` (MegatronStages.head_loss), so Megatron's logged loss dict and
token count are the ones the unsplit run makes.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import OctoPipeError
from .hooks import replace_forward

PROBE_DTYPE = torch.float32  # Megatron's per-token losses: vocab_parallel_cross_entropy computes in fp32


class HeadCapture:
    """GPTModel's `output_processor`: keeps the labels and returns the final-norm hidden states."""

    def __init__(self):
        self.labels = None

    def __call__(self, *, hidden_states, labels=None, **unused):
        self.labels = labels
        return hidden_states

    def take(self):
        """The labels of the forward that just ran (None when it had none), forgotten here."""
        labels, self.labels = self.labels, None
        return labels


# GPTModel instance -> its capture (weak: a model that goes away takes its entry with it)
_CAPTURES: "weakref.WeakKeyDictionary[torch.nn.Module, HeadCapture]" = weakref.WeakKeyDictionary()


def head_capture(chunk: torch.nn.Module) -> HeadCapture | None:
    """Make the owner chunk's model return its head's input (once per model); None for a chunk without an output
    layer (a stand-in chunk, whose output is the head's input as it is). A model with an output layer whose
    forward takes no `output_processor` (HybridModel) is refused: it would apply its head to the hidden states."""
    inner = chunk
    while inner not in _CAPTURES and not _takes_output_processor(inner) and hasattr(inner, "module"):
        inner = inner.module  # DDP, Float16Module
    if inner in _CAPTURES:  # made to return its head's input already (an earlier step)
        return _CAPTURES[inner]
    if not _takes_output_processor(inner):
        if _has_output_layer(chunk):
            raise OctoPipeError(f"a split LM head needs the owner's model to return its final-norm hidden states "
                                f"(GPTModel's output_processor); {type(inner).__name__} takes none: drop the plan's "
                                f"`splits` for this model")
        return None
    cap = _CAPTURES[inner] = HeadCapture()

    def make(original, _cap=cap):
        def forward(*args, **kwargs):
            kwargs["output_processor"] = _cap
            return original(*args, **kwargs)

        return forward

    replace_forward(inner, make, "the owner of a split LM head returns the final-norm hidden states")
    return cap


def _has_output_layer(chunk) -> bool:
    inner = chunk
    while True:
        if "output_layer" in getattr(inner, "_modules", {}):
            return True
        if not hasattr(inner, "module"):
            return False
        inner = inner.module


def _takes_output_processor(module) -> bool:
    try:
        return "output_processor" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnerLoss:
    """What the owner keeps from F for its J's report: the forward step's loss_func and the labels' shape."""

    loss_func: Callable
    labels_shape: tuple[int, ...]  # [mbs, seq]


@contextlib.contextmanager
def _without_timers(config):
    """Megatron's forward_step stops its 'forward-compute' timer once per forward: the extra calls of
    forward_step_calc_loss made here must not stop it again."""
    saved, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = saved


def calc_loss(model, per_token: torch.Tensor, loss_func, config, vp_stage, num_microbatches: int, cp_size: int,
              store: list):
    """Megatron's own forward_step_calc_loss on the last stage: (scaled loss, num_tokens); the loss dict into store."""
    from megatron.core.pipeline_parallel import schedules

    with _without_timers(config):
        return schedules.forward_step_calc_loss(model, per_token, loss_func, config, vp_stage, False,
                                                num_microbatches, store, cp_size, True)


@contextlib.contextmanager
def _unrecorded_by_rerun_checks():
    """A probe of the loss function is no loss of the run: Megatron's loss functions hand their result to the
    rerun state machine (`validate_result`: NaN checks, `--check-for-spiky-loss`'s running maximum, result
    validation that may request a rerun of the iteration), so during a probe the machine is switched off and
    its spiky-loss statistics are restored after (`.mode` set directly: `set_mode` logs every call)."""
    from megatron.core import rerun_state_machine as rsm

    machine = rsm.get_rerun_state_machine()  # the one the loss function would reach (made if none yet)
    saved = machine.mode, dict(machine.large_value_counts), dict(machine.max_values)
    machine.mode = rsm.RerunMode.DISABLED
    try:
        yield
    finally:
        machine.mode = saved[0]
        machine.large_value_counts.clear()
        machine.large_value_counts.update(saved[1])
        machine.max_values.clear()
        machine.max_values.update(saved[2])


def loss_rule(model, loss_func, config, vp_stage, num_microbatches: int, cp_size: int, labels_shape):
    """The step's backward root as a function of the micro-batch's per-token losses ([seq * mbs], the hidden
    states' row order): the forward step's loss_func, Megatron's scaling, config.grad_scale_func."""
    def rule(losses: torch.Tensor) -> torch.Tensor:
        per_token = per_token_losses(losses.to(PROBE_DTYPE), labels_shape)
        with _unrecorded_by_rerun_checks():
            out, _ = calc_loss(model, per_token, loss_func, config, vp_stage, num_microbatches, cp_size, [])
        return config.grad_scale_func(out) if config.grad_scale_func is not None else out

    return rule


def per_token_losses(losses: torch.Tensor, labels_shape) -> torch.Tensor:
    """The shards' per-token losses ([seq * mbs], sequence-major) as the output layer's loss gives them: [mbs, seq]."""
    mbs, seq = labels_shape
    return losses.reshape(seq, mbs).t().contiguous()  # contiguous, as compute_language_model_loss returns it
