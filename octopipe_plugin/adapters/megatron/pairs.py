"""Overlapped pairs (`3F12+5B7`) in Megatron: megatron-core's own combined forward/backward step runs them.

Under `--overlap-moe-expert-parallel-comm` megatron-core 0.19 splits every transformer layer into
schedule nodes (models/common/model_chunk_schedule_plan.py `TransformerLayerSchedulePlan`: the
pre-dispatch computation — attention, router, dispatch preprocess —, the dispatch all-to-all, the
experts, the combine all-to-all; callables from models/gpt/fine_grained_callables.py) and its
combined 1F1B runs one micro-batch's forward with another's backward layer by layer
(`TransformerModelChunkSchedulePlan.run`), the all-to-alls on a communication stream while the other
side computes (pipeline_parallel/combined_1f1b.py `combined_forward_backward_step`). This module
runs an OctoPipe pair through exactly that step: the pair's F chunk and its B chunk are the step's
`f_model` and `b_model`, whatever stages and micro-batches the plan pairs. Every other F and B of
the run goes through the same step with the other side empty (as Megatron's own combined schedule
runs its warm-up forwards and cool-down backwards), so each backward finds the schedule plan its
forward built on the output tensor.

What needs CUDA (megatron-core 0.19.2): the chunk plan's event (model_chunk_schedule_plan.py:376
`torch.cuda.Event()`), each node's stream context (pipeline_parallel/utils.py:336-345
`event.wait/record`, `torch.cuda.stream`), the communication stream (utils.py:390/392
`set_streams`, which this module calls as Megatron's combined schedules do) and `record_stream` on
the nodes' tensors (models/gpt/fine_grained_callables.py:243-245, utils.py:269/308). On CUDA the
all-to-alls then overlap the other side's compute. On a CPU the step runs only where those calls have
CPU stand-ins (the tests' and examples' cpu_shims.py): the same callables in the same order, the
all-to-alls synchronous (gloo), so a pair computes what Megatron's combined step computes without
hiding anything; a CPU process without them is refused in one line.

`--delay-wgrad-compute` (Transformer Engine only: megatron/training/arguments.py:1822) defers the
experts' and attention's weight GEMMs inside the step (`backward_dw` right after the other side's
compute), as Megatron runs it; the plan's own W (I/W split) is not taken under the combined step: a
plan that splits a backward on a rank of such a run is refused (its I/W fused into B runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...actions import Kind
from ...errors import OctoPipeError

log = logging.getLogger("octopipe.megatron")


def overlapped(config, forward_only: bool) -> bool:
    """Whether this step runs F and B through Megatron's combined step (`--overlap-moe-expert-parallel-comm`)."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only


def overlap_problem(plan, rank: int, memory=None) -> str | None:
    """Why this rank cannot run `plan` through the combined step (one line naming the field and the fix), or None."""
    flag = "--overlap-moe-expert-parallel-comm"
    split = sorted({a.stage for a in plan.schedule[rank] if a.kind in (Kind.I, Kind.W)})
    if split:
        return (f"plan: stages {split} on pipeline rank {rank} run I/W, but {flag} runs each backward whole in "
                f"megatron-core's combined step; re-plan with B for them (mapping.fuse_backward gives the plan with "
                f"each I run as B), or drop {flag}")
    if plan.splits:
        return (f"plan splits layers {[sp.layer for sp in plan.splits]}: the split head/embedding does not run "
                f"under {flag} (megatron-core's combined step owns the output layer and loss); plan without splits "
                f"or drop {flag}")
    if memory is not None:
        return (f"plan.memory: per-layer recompute/offload does not run under {flag} (megatron-core refuses "
                f"recomputation with it, transformer_config.py); plan without memory choices or drop {flag}")
    return None


def device_problem() -> str | None:
    """Why this process cannot run megatron-core's combined step (no CUDA events and streams), or None."""
    flag = "--overlap-moe-expert-parallel-comm"
    if not _cuda_events_work():
        return (f"{flag} on a CPU process: megatron-core's combined step makes CUDA events and streams "
                "(models/common/model_chunk_schedule_plan.py:376 torch.cuda.Event(), pipeline_parallel/utils.py:340 "
                "torch.cuda.stream) and records streams on its tensors (models/gpt/fine_grained_callables.py:243); "
                f"drop {flag} on CPU (the plan's pairs then run half after half)")
    return None


def _cuda_events_work() -> bool:
    try:
        torch.cuda.Event()
    except (RuntimeError, AssertionError):
        return False
    return True


_WARNED: set = set()  # plans already warned about (a runner is made every step)


def warn_unpaired(plan, config) -> None:
    """A plan with pairs on a run without the overlap: its pairs run half after half (correct, nothing hidden)."""
    if plan.pairs and not getattr(config, "overlap_moe_expert_parallel_comm", False) and id(plan) not in _WARNED:
        _WARNED.add(id(plan))
        log.warning("octopipe: plan.pairs (%d overlapped pairs) run half after half: this run has no "
                    "--overlap-moe-expert-parallel-comm (with --moe-token-dispatcher-type alltoall and "
                    "--expert-model-parallel-size > 1), so nothing of their all-to-alls is hidden", len(plan.pairs))


class CombinedSteps:
    """F, B and F+B of one rank's chunks through `combined_forward_backward_step` (module docstring).

    `stages` is the rank's MegatronStages: its chunks, data, forward step, loss bookkeeping and gradient sync;
    `batch_at(batches, mb)` the iterator its forward step reads micro-batch `mb` of a chunk's stream from."""

    def __init__(self, stages, batch_at):
        self.stages, self.batch_at = stages, batch_at
        if torch.cuda.is_available():  # Megatron's combined schedules make their communication stream first
            from megatron.core.pipeline_parallel.utils import set_streams

            set_streams(high_priority=stages.config.high_priority_a2a_comm_stream)

    def forward(self, stage: int, mb: int, x):
        """F alone: the chunk's schedule plan built and run forward (loss on the last stage); (output, Forwarded)."""
        (out, fwd), _ = self._step(f=(stage, mb, x), b=None)
        return out, fwd

    def backward(self, stage: int, fwd, grad_output, want_dx: bool = True):
        """B alone: the schedule plan the forward left on its output, run backward; the input gradient."""
        _, dx = self._step(f=None, b=(stage, fwd, grad_output))
        return dx if want_dx else None

    def pair(self, first_stage: int, first_mb: int, x, second_stage: int, fwd, grad_output):
        """F of one chunk and B of another, layer by layer (TransformerModelChunkSchedulePlan.run)."""
        return self._step(f=(first_stage, first_mb, x), b=(second_stage, fwd, grad_output))

    def _step(self, f, b):
        from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        from ...executor.stage_core import Forwarded
        from .hooks import pipeline_view

        st = self.stages
        config = st.config
        f_model = data = x = None
        first = False
        cf = mb = None
        store: list = []
        if f is not None:
            stage, mb, x = f
            cf = st.chunk_of[stage]
            first = st.sync.before_forward(cf)
            f_model, data = st.model[cf], self.batch_at(st.batches[cf], mb)
        b_model = b_in = b_out = b_grad = None
        if b is not None:
            b_stage, fwd, b_grad = b
            b_model, b_in, b_out = st.model[st.chunk_of[b_stage]], fwd.input, fwd.output
        running = f[0] if f is not None else b[0]
        with pipeline_view(st.plan, st.rank, running=running):  # get_batch's and the loss's rank-level questions
            out, num_tokens, dx = combined_forward_backward_step(
                st.forward_step_func, data, f_model, st.num_microbatches, x,
                store, b_model, b_in, b_out, b_grad, config,
                f_model_chunk_id=cf if f_model is not None and getattr(f_model, "vp_stage", None) is not None
                else None,
                collect_non_loss_data=st.collect_non_loss_data, is_first_microbatch=first, current_microbatch=mb)
        result = None
        if f is not None:
            stage = f[0]
            if stage == st.num_stages - 1:
                st.num_tokens += num_tokens
                st.loss_data[mb] = store[0] if store else None
                result = (out, Forwarded(input=x, output=out))
            elif config.deallocate_pipeline_outputs:  # as Megatron's schedules do once the output is sent
                sent = out.detach()
                fwd_out = Forwarded(input=x, output=out, output_shape=out.shape)
                deallocate_output_tensor(out, True)
                result = (sent, fwd_out)
            else:
                result = (out, Forwarded(input=x, output=out))
        if b is not None and b[0] == 0:
            dx = None
        return result, dx


OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"


@dataclass(frozen=True, kw_only=True, slots=True)
class PairSupport:
    """Whether a launch can run a plan's pairs (its EP, dispatcher, precision and recompute arguments), and why."""

    runs: bool
    why: str  # one line: what the launch has that lets it, or what it lacks and the fix
    add: tuple[str, ...] = ()  # arguments to add to the launch when the plan has pairs


def pair_support(args) -> PairSupport:
    """What megatron-core's combined step needs of a launch (transformer_config.py's checks of the flag), from its
    parsed arguments."""
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    experts = getattr(args, "num_experts", None)
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
    if not experts or ep <= 1:
        return PairSupport(runs=False, why="no expert parallelism (--expert-model-parallel-size 1 or no "
                                           "--num-experts): no all-to-all for a pair to hide")
    if dispatcher not in ("alltoall", "flex"):
        return PairSupport(runs=False, why=f"--moe-token-dispatcher-type {dispatcher}: megatron-core overlaps the "
                                           f"alltoall and flex dispatchers only; pass --moe-token-dispatcher-type "
                                           f"alltoall for pairs")
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return PairSupport(runs=False, why=f"{OVERLAP_FLAG} needs --bf16 or --fp16 (megatron-core's check); add one "
                                           f"for pairs")
    if getattr(args, "recompute_granularity", None) == "full" or getattr(args, "recompute_method", None):
        return PairSupport(runs=False, why=f"{OVERLAP_FLAG} refuses full recomputation (--recompute-granularity "
                                           f"full, --recompute-method); drop them for pairs")
    if getattr(args, "moe_shared_expert_overlap", False):
        return PairSupport(runs=False, why=f"{OVERLAP_FLAG} refuses --moe-shared-expert-overlap; drop it for pairs")
    on = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    return PairSupport(runs=True, why=f"EP {ep} with the {dispatcher} dispatcher: megatron-core's combined step runs "
                                      f"the plan's pairs", add=() if on else (OVERLAP_FLAG,))


def virtual_stage_problem(plan, pipeline_size: int) -> str | None:
    """Why megatron-core cannot build this plan's chunks under the overlap flag: at PP > 1 its TransformerConfig
    requires a virtual pipeline size (transformer_config.py, 'virtual_pipeline_model_parallel_size must be
    specified'), which a plan of one stage per rank does not give; None where it does."""
    if pipeline_size > 1 and min(len(plan.stages_of(d)) for d in range(plan.num_devices)) < 2:
        return (f"{OVERLAP_FLAG} at PP {pipeline_size} needs two or more stages per rank (megatron-core asks for a "
                f"virtual pipeline size), and the plan has one on a rank")
    return None


def launch_refusal(args, plan) -> str | None:
    """Why a launch under the overlap flag cannot run `plan` (at start-up, on every rank, before any model is built:
    the runtime's refusals for every rank, and megatron-core's virtual-stage requirement), or None."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return None
    for rank in range(plan.num_devices):
        problem = overlap_problem(plan, rank, plan.memory or None)
        if problem is not None:
            return problem
    problem = virtual_stage_problem(plan, int(getattr(args, "pipeline_model_parallel_size", 1) or 1))
    return None if problem is None else f"{problem}: re-plan with octopipe plan --megatron-args, or drop {OVERLAP_FLAG}"


def tuning_model(model, support: PairSupport, args):
    """The model the launch's plan is tuned on. A launch that cannot pair: its layers' phases dropped (the same
    times), so the tuner makes no pair (simulator/pairs.communicates). One that runs the combined step (it has or
    gets the overlap flag): every backward one B (te.fused_backward_layers), as that step runs it."""
    import dataclasses

    from .te import fused_backward_layers

    if not support.runs:
        return dataclasses.replace(model, layers=tuple(dataclasses.replace(layer, phases=())
                                                       for layer in model.layers))
    return fused_backward_layers(model, lambda layer: True)


def runnable_plan(plan, support: PairSupport, args):
    """The plan the launch runs under the combined step: each I run as B, W dropped (mapping.fuse_backward), where
    the launch has or gets the overlap flag; otherwise the plan as it is."""
    from .mapping import fuse_backward

    if support.runs and (plan.pairs or getattr(args, "overlap_moe_expert_parallel_comm", False)):
        return fuse_backward(plan, range(plan.num_stages))[0]
    return plan
